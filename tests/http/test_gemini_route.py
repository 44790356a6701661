"""A Gemini route through the real gateway: the official ``openai`` SDK with n=3 against
the fake Gemini API, and Gemini's errors as the client sees them."""

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

from ncap.client import demux
from ncap.config import Config
from ncap.domain.events import LedgerEvent
from ncap.domain.money import cost_micros
from ncap.http.app import ACCOUNTING
from ncap.stores import SQLiteLedgerStore
from ncap.testing._fake_content import PromptMessage, digest_messages
from ncap.testing.fake_gemini import GEMINI_STATE, GeminiFakeState, create_gemini_app
from tests.support import ServerThread, gateway, gateway_config

KEY_ENV = "NCAP_TEST_GEMINI_KEY"
KEY = "gemini-route-key"
MESSAGES: list[Any] = [{"role": "user", "content": "Name a prime."}]


@pytest.fixture
def fake_gemini() -> Iterator[tuple[str, GeminiFakeState]]:
    server = ServerThread(lambda: create_gemini_app(api_key=KEY)).start()
    try:
        assert server.app is not None
        yield server.url + "/v1beta", server.app[GEMINI_STATE]
    finally:
        server.stop()


def _config(
    base_url: str, tmp: Path, headers: dict[str, str] | None = None, **contract: Any
) -> Config:
    route = {
        "provider": "gemini",
        "base_url": base_url,
        "upstream_model": "gemini-2.5-flash",
        "api_key_env": KEY_ENV,
        "retries": 1,
        "backoff_s": 0.01,
        # the fake reads these to report thoughts and cached tokens
        "headers": {"x-fake-reasoning-tokens": "7", "x-fake-cached-tokens": "4", **(headers or {})},
        "pricing": {"input_per_mtok": 0.3, "output_per_mtok": 2.5},
        "contract": {
            "candidates": "native",
            "max_candidates": 12,
            "stream_usage": "include_usage",
            **contract,
        },
    }
    return gateway_config(
        "http://unused",
        tmp,
        workloads={"default": {"max_candidates": 12, "output_ceiling": 256}},
        models={"gem": ["g"]},
        routes={"g": route},
    )


def _rows(tmp: Path, count: int) -> list[LedgerEvent]:
    """The ledger once ``count`` allowed rows are written and settled (an answer settles
    beside its last byte, so the test waits for it, within a bound)."""

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
    fake_gemini: tuple[str, GeminiFakeState], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., openai.OpenAI]]:
    monkeypatch.setenv(KEY_ENV, KEY)
    with ExitStack() as stack:

        def make(**contract: Any) -> openai.OpenAI:
            server = stack.enter_context(gateway(_config(fake_gemini[0], tmp_path, **contract)))
            return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

        yield make


def _sent(state: GeminiFakeState) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(state.recent_bodies[-1])
    return body


def test_sdk_n3_through_gemini(
    client_for: Any, fake_gemini: tuple[str, GeminiFakeState], tmp_path: Path
) -> None:
    client = client_for()
    raw = client.chat.completions.with_raw_response.create(
        model="gem", messages=MESSAGES, n=3, max_completion_tokens=40
    )
    whole = raw.parse()
    assert raw.headers["x-ncap-candidates-returned"] == "3"
    assert raw.headers["x-ncap-route"] == "g"
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.message.content for c in whole.choices)
    assert {c.finish_reason for c in whole.choices} <= {"stop", "length"}
    usage = whole.usage
    assert usage is not None
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 7
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 4
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # the upstream saw Gemini's request: candidateCount, maxOutputTokens, header key
    sent = _sent(fake_gemini[1])
    assert sent["generationConfig"]["candidateCount"] == 3
    assert sent["generationConfig"]["maxOutputTokens"] == 40
    assert fake_gemini[1].last_headers is not None
    assert fake_gemini[1].last_headers["x-goog-api-key"] == KEY

    stream = client.chat.completions.create(
        model="gem",
        messages=MESSAGES,
        n=3,
        max_completion_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    streamed = demux(stream)
    assert sorted(streamed.choices) == [0, 1, 2]
    for choice in whole.choices:
        buffer = streamed.choices[choice.index]
        assert buffer.content == choice.message.content
        assert buffer.finish_reason == choice.finish_reason
    assert streamed.usage.total_tokens == usage.total_tokens

    rows = _rows(tmp_path, 2)
    assert len(rows) == 2
    for row in rows:
        assert (row.requested_candidate_count, row.effective_candidate_count) == (3, 3)
        assert row.returned_candidate_count == 3
        assert row.state == "settled"
        assert row.input_tokens == usage.prompt_tokens
        assert row.cached_input_tokens == 4
        assert row.reasoning_tokens == 7
        assert row.output_tokens_total == usage.completion_tokens
        assert row.provider_request_id
        assert row.upstream_model == "gemini-2.5-flash"
    assert [r.stream_mode for r in rows] == [False, True]


def test_stream_without_include_usage_has_no_usage_chunk(client_for: Any) -> None:
    client = client_for()
    chunks = list(
        client.chat.completions.create(
            model="gem", messages=MESSAGES, n=2, max_completion_tokens=20, stream=True
        )
    )
    assert all(c.usage is None for c in chunks)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_gemini_refusal_of_n_is_route_does_not_support_candidates(
    client_for: Any, fake_gemini: tuple[str, GeminiFakeState]
) -> None:
    client = client_for()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="gem", messages=MESSAGES, n=9, max_completion_tokens=20
        )
    body = info.value.body
    assert isinstance(body, dict)
    assert body["code"] == "route_does_not_support_candidates"
    assert body["param"] == "n"
    assert fake_gemini[1].requests == 1  # a refusal is not retried


def test_unsupported_field_is_refused_before_dispatch(
    client_for: Any, fake_gemini: tuple[str, GeminiFakeState]
) -> None:
    client = client_for()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="gem", messages=MESSAGES, logit_bias={"1": 5}, max_completion_tokens=20
        )
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == "logit_bias"
    assert fake_gemini[1].requests == 0


def test_emulated_gemini_route_fans_out_and_merges(
    client_for: Any, fake_gemini: tuple[str, GeminiFakeState], tmp_path: Path
) -> None:
    """``candidates: emulate`` on a Gemini route: k single-candidate Gemini requests,
    merged whole and streamed (the translator's chunks carry their data for the merge)."""
    client = client_for(candidates="emulate")
    whole = client.chat.completions.create(
        model="gem", messages=MESSAGES, n=2, max_completion_tokens=20
    )
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(
        _sent_config(body).get("candidateCount", 1) == 1 for body in fake_gemini[1].recent_bodies
    )
    streamed = demux(
        client.chat.completions.create(
            model="gem",
            messages=MESSAGES,
            n=2,
            max_completion_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert sorted(streamed.choices) == [0, 1]
    assert streamed.usage is not None and whole.usage is not None
    assert streamed.usage.total_tokens == whole.usage.total_tokens
    rows = _rows(tmp_path, 4)
    assert len(rows) == 4 and all(r.state == "settled" for r in rows)


def _sent_config(raw: bytes) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(raw).get("generationConfig") or {}
    return config


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_blocked_prompt_settles_the_prompt_tokens_gemini_reported(
    fake_gemini: tuple[str, GeminiFakeState],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    """A prompt Gemini blocks (``promptFeedback.blockReason``, no candidates) is the
    client's 400 ``content_filter``, and its row is ``settled`` at the
    ``usageMetadata.promptTokenCount`` Gemini reported, the budget charged the same
    (was: zero tokens, the hold released, as if nothing had been billed)."""
    monkeypatch.setenv(KEY_ENV, KEY)
    config = _config(fake_gemini[0], tmp_path, headers={"x-fake-fault": "blocked_prompt"})
    with gateway(config) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            args: dict[str, Any] = {"model": "gem", "messages": MESSAGES, "n": 2}
            if stream:
                list(client.chat.completions.create(**args, stream=True))
            else:
                client.chat.completions.create(**args)
        (row,) = _rows(tmp_path, 1)
        assert server.app is not None
        budgets = server.app[ACCOUNTING].budgets
        live = server.call(budgets.usage("default"))
        outstanding = server.call(budgets.outstanding())
    error = info.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == ("content_filter", "messages")
    assert fake_gemini[1].requests == 1  # the request's own fault: not retried
    _, prompt_tokens = digest_messages([PromptMessage("user", MESSAGES[0]["content"])])
    assert prompt_tokens > 0
    assert row.state == "settled"
    assert row.upstream_status == 400
    assert row.returned_candidate_count == 0
    assert (row.input_tokens, row.output_tokens_total) == (prompt_tokens, 0)
    assert row.total_tokens == prompt_tokens
    assert row.cost_micros == cost_micros(prompt_tokens, 0, 0, config.routes["g"].pricing)
    assert row.usage_source == ("provider_stream" if stream else "provider_response")
    assert (live.tokens_day, live.cost_day) == (row.total_tokens, row.cost_micros)
    assert outstanding == []
