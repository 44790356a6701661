"""An Anthropic route through the real gateway: the official ``openai`` SDK with n=4
against the fake Anthropic Messages API, which has no ``n``, so the gateway fans out;
tools per choice; and Anthropic's errors as the client sees them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest

from ncap.client import demux, tool_call_agreement
from ncap.config import Config
from ncap.domain.events import LedgerEvent
from ncap.errors import ConfigError
from ncap.http.app import create_app
from ncap.stores import SQLiteLedgerStore
from ncap.testing.fake_anthropic import (
    ANTHROPIC_STATE,
    AnthropicFakeState,
    create_anthropic_app,
)
from tests.support import ServerThread, gateway, gateway_config

KEY_ENV = "NCAP_TEST_ANTHROPIC_KEY"
KEY = "sk-ant-route-key"
MESSAGES: list[Any] = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Name a prime."},
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture
def fake_anthropic() -> Iterator[tuple[str, AnthropicFakeState]]:
    server = ServerThread(lambda: create_anthropic_app(api_key=KEY)).start()
    try:
        assert server.app is not None
        yield server.url + "/v1", server.app[ANTHROPIC_STATE]
    finally:
        server.stop()


def _config(base_url: str, tmp: Path, headers: dict[str, str] | None = None) -> Config:
    route = {
        "provider": "anthropic",
        "base_url": base_url,
        "upstream_model": "claude-fake",
        "api_key_env": KEY_ENV,
        "retries": 1,
        "backoff_s": 0.01,
        "headers": headers or {},
        "pricing": {"input_per_mtok": 3.0, "cached_input_per_mtok": 0.3, "output_per_mtok": 15.0},
        "contract": {"candidates": "emulate", "max_candidates": 8, "stream_usage": "include_usage"},
    }
    return gateway_config(
        "http://unused",
        tmp,
        workloads={"default": {"max_candidates": 8, "output_ceiling": 256}},
        models={"claude": ["a"]},
        routes={"a": route},
    )


def _rows(tmp: Path, count: int) -> list[LedgerEvent]:
    async def read() -> list[LedgerEvent]:
        store = SQLiteLedgerStore(tmp / "ledger.db")
        try:
            return [e async for e in store.export()]
        finally:
            await store.close()

    deadline = time.monotonic() + 10
    while True:
        found = [r for r in asyncio.run(read()) if r.policy_result == "allow"]
        if len(found) >= count and all(r.state != "reserved" for r in found):
            return found
        assert time.monotonic() < deadline, found
        time.sleep(0.05)


@pytest.fixture
def client_for(
    fake_anthropic: tuple[str, AnthropicFakeState], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., openai.OpenAI]]:
    monkeypatch.setenv(KEY_ENV, KEY)
    with ExitStack() as stack:

        def make(headers: dict[str, str] | None = None) -> openai.OpenAI:
            config = _config(fake_anthropic[0], tmp_path, headers)
            server = stack.enter_context(gateway(config))
            return openai.OpenAI(base_url=server.url + "/v1", api_key="client-key", max_retries=0)

        yield make


def _sent(state: AnthropicFakeState) -> list[dict[str, Any]]:
    return [json.loads(body) for body in state.recent_bodies]


def test_sdk_n4_through_anthropic_fans_out(
    client_for: Any, fake_anthropic: tuple[str, AnthropicFakeState], tmp_path: Path
) -> None:
    state = fake_anthropic[1]
    client = client_for()
    raw = client.chat.completions.with_raw_response.create(
        model="claude", messages=MESSAGES, n=4, max_completion_tokens=40, temperature=0.5
    )
    whole = raw.parse()
    assert raw.headers["x-ncap-candidates-returned"] == "4"
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert all(c.message.content and c.finish_reason == "stop" for c in whole.choices)
    # four Messages requests, each one candidate, in Anthropic's shape, with the route's key
    sent = _sent(state)
    assert len(sent) == 4
    for body in sent:
        assert "n" not in body and body["max_tokens"] == 40 and body["temperature"] == 0.5
        assert body["system"] == [{"type": "text", "text": "Answer briefly."}]
        assert body["messages"] == [
            {"role": "user", "content": [{"type": "text", "text": "Name a prime."}]}
        ]
    headers = state.last_headers
    assert headers is not None
    assert headers["x-api-key"] == KEY and headers["anthropic-version"] == "2023-06-01"
    assert "Authorization" not in headers  # the client's own key never goes upstream

    rows = _rows(tmp_path, 4)
    assert len(rows) == 4
    usage = whole.usage
    assert usage is not None
    assert usage.prompt_tokens == sum(r.input_tokens or 0 for r in rows)
    assert usage.completion_tokens == sum(r.output_tokens_total or 0 for r in rows)
    assert usage.completion_tokens == sum(
        len((c.message.content or "").split()) for c in whole.choices
    )
    for row in rows:
        assert row.state == "settled" and row.returned_candidate_count == 1
        assert (row.requested_candidate_count, row.effective_candidate_count) == (4, 4)
        assert row.provider_request_id and row.upstream_model == "claude-fake"

    stream = client.chat.completions.create(
        model="claude",
        messages=MESSAGES,
        n=4,
        max_completion_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    streamed = demux(stream)
    assert sorted(streamed.choices) == [0, 1, 2, 3]
    for choice in whole.choices:
        buffer = streamed.choices[choice.index]
        assert buffer.content == choice.message.content
        assert buffer.finish_reason == choice.finish_reason
    assert streamed.usage is not None
    assert streamed.usage.total_tokens == usage.total_tokens
    rows = _rows(tmp_path, 8)
    assert [r.stream_mode for r in rows].count(True) == 4


@pytest.mark.parametrize("stream", [False, True])
def test_tools_per_choice(client_for: Any, stream: bool) -> None:
    """Half the branches call the tool, half answer in prose: each choice keeps its own
    finish reason and tool calls."""
    client = client_for({"x-fake-fault": "tool_every=2"})
    kwargs: dict[str, Any] = {
        "model": "claude",
        "messages": MESSAGES,
        "n": 4,
        "max_completion_tokens": 60,
        "tools": [WEATHER],
    }
    if stream:
        choices = demux(client.chat.completions.create(**kwargs, stream=True)).to_choices()
        calls = [c.ordered_tool_calls() for c in choices]
        finishes = [c.finish_reason for c in choices]
        arguments = [json.loads(call.arguments) for cs in calls for call in cs]
    else:
        whole = client.chat.completions.create(**kwargs)
        choices = whole.choices
        finishes = [c.finish_reason for c in choices]
        arguments = [
            json.loads(call.function.arguments)
            for c in choices
            for call in c.message.tool_calls or []
        ]
    assert tool_call_agreement(choices) == {"get_weather": 0.5, None: 0.5}
    assert sorted(finishes) == ["stop", "stop", "tool_calls", "tool_calls"]
    assert arguments == [{"city": "fake"}, {"city": "fake"}]


def test_tool_results_go_back_as_tool_result_blocks(
    client_for: Any, fake_anthropic: tuple[str, AnthropicFakeState]
) -> None:
    client = client_for()
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
    ]
    answer = client.chat.completions.create(
        model="claude",
        messages=messages,
        tools=[WEATHER],
        tool_choice="none",
        max_completion_tokens=20,
    )
    assert answer.choices[0].finish_reason == "stop"
    body = _sent(fake_anthropic[1])[-1]
    assert body["messages"][1:] == [
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Oslo"},
                }
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"}],
        },
    ]
    assert body["tool_choice"] == {"type": "none"}


def test_temperature_above_anthropics_range_is_a_400(
    client_for: Any, fake_anthropic: tuple[str, AnthropicFakeState]
) -> None:
    client = client_for()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="claude", messages=MESSAGES, temperature=1.5, max_completion_tokens=20
        )
    assert info.value.param == "temperature"
    assert "temperature" in info.value.message
    assert fake_anthropic[1].requests == 0  # refused before anything was sent


@pytest.mark.parametrize(
    ("fault", "error", "code"),
    [
        ("overloaded", openai.InternalServerError, "server_is_overloaded"),
        ("rate_limit_exceeded=0", openai.RateLimitError, "rate_limit_exceeded"),
        ("server_error_400", openai.BadRequestError, None),
    ],
)
def test_anthropic_errors_as_the_client_sees_them(
    client_for: Any,
    fake_anthropic: tuple[str, AnthropicFakeState],
    fault: str,
    error: type[openai.APIStatusError],
    code: str | None,
) -> None:
    client = client_for({"x-fake-fault": fault})
    with pytest.raises(error) as info:
        client.chat.completions.create(model="claude", messages=MESSAGES, max_completion_tokens=20)
    body = info.value.body
    assert isinstance(body, dict)
    if code is not None:
        assert body["code"] == code
    if fault == "server_error_400":
        assert "this value is not supported" in body["message"]  # Anthropic's own message
        assert fake_anthropic[1].requests == 1  # a 400 is the request's: not retried
    else:
        assert fake_anthropic[1].requests == 2  # retried once on the same route
    if fault == "overloaded":
        assert info.value.status_code == 503


def test_response_format_json_schema_by_forced_tool(
    client_for: Any, fake_anthropic: tuple[str, AnthropicFakeState]
) -> None:
    client = client_for()
    schema = {"type": "object", "properties": {"prime": {"type": "integer"}}, "required": ["prime"]}
    answer = client.chat.completions.create(
        model="claude",
        messages=MESSAGES,
        max_completion_tokens=20,
        response_format={"type": "json_schema", "json_schema": {"name": "prime", "schema": schema}},
    )
    choice = answer.choices[0]
    assert json.loads(choice.message.content or "") == {"prime": 1}
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    body = _sent(fake_anthropic[1])[-1]
    assert body["tool_choice"] == {"type": "tool", "name": "prime"}


def test_a_native_contract_on_an_anthropic_route_is_refused_at_start(tmp_path: Path) -> None:
    config = _config("http://unused", tmp_path)
    route = config.routes["a"]
    native = route.contract.model_copy(update={"candidates": "native"})
    bad = config.model_copy(update={"routes": {"a": route.model_copy(update={"contract": native})}})
    with pytest.raises(ConfigError) as info:
        create_app(bad)
    assert "routes.a.contract.candidates" in str(info.value)
