"""The official openai SDK, sync and async, stream and non-stream, through the gateway."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import openai
import pytest

from tests.support import UPSTREAM_KEY, ServerThread
from tests.wire import validate_chunk, validate_response

MESSAGES: list[Any] = [{"role": "user", "content": "Name three colours."}]


def _client(gw: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-client-secret", max_retries=0)


def _aclient(gw: ServerThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-client-secret", max_retries=0)


def _demux(chunks: list[Any]) -> tuple[dict[int, str], dict[int, str | None], list[Any]]:
    text: dict[int, str] = defaultdict(str)
    finish: dict[int, str | None] = {}
    usages = []
    for chunk in chunks:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return dict(text), finish, usages


def test_sync_non_stream_n3(gw: ServerThread, fake_state: Any) -> None:
    raw = _client(gw).chat.completions.with_raw_response.create(
        model="fake-model", messages=MESSAGES, n=3
    )
    body = json.loads(raw.text)
    validate_response(body)
    completion = raw.parse()
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in completion.choices)
    assert len({c.message.content for c in completion.choices}) == 3
    assert completion.usage is not None
    assert completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens
    )
    assert raw.headers["x-ncap-candidates-requested"] == "3"
    assert raw.headers["x-ncap-candidates-effective"] == "3"
    assert raw.headers["x-ncap-candidates-returned"] == "3"
    assert raw.headers["x-ncap-route"] == "fake"
    assert raw.headers["x-request-id"].startswith("req-")
    assert int(raw.headers["x-ncap-reserved-tokens"]) >= 3 * 256
    # the route's credential went upstream, never the client's
    assert fake_state.stats()["last_headers_seen"]["Authorization"] == f"Bearer {UPSTREAM_KEY}"


def test_sync_stream_demux_equals_non_stream(gw: ServerThread) -> None:
    client = _client(gw)
    plain = client.chat.completions.create(model="fake-model", messages=MESSAGES, n=3)
    raw_stream = client.chat.completions.with_raw_response.create(
        model="fake-model",
        messages=MESSAGES,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(raw_stream.parse())
    for chunk in chunks:
        validate_chunk(chunk.model_dump(exclude_unset=True))
    text, finish, usages = _demux(chunks)
    assert text == {c.index: c.message.content for c in plain.choices}
    assert finish == {c.index: c.finish_reason for c in plain.choices}
    assert len(usages) == 1
    assert usages[0].completion_tokens == plain.usage.completion_tokens  # type: ignore[union-attr]
    assert raw_stream.headers["x-ncap-candidates-effective"] == "3"


def test_stream_without_include_usage_strips_gateway_usage_chunk(gw: ServerThread) -> None:
    chunks = list(
        _client(gw).chat.completions.create(model="fake-model", messages=MESSAGES, n=2, stream=True)
    )
    _, finish, usages = _demux(chunks)
    assert usages == []
    assert set(finish) == {0, 1}


async def test_async_non_stream_and_stream_n3(gw: ServerThread) -> None:
    client = _aclient(gw)
    plain = await client.chat.completions.create(model="fake-model", messages=MESSAGES, n=3)
    assert len(plain.choices) == 3
    stream = await client.chat.completions.create(
        model="fake-model",
        messages=MESSAGES,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text, finish, usages = _demux(chunks)
    assert text == {c.index: c.message.content for c in plain.choices}
    assert finish == {c.index: c.finish_reason for c in plain.choices}
    assert len(usages) == 1
    await client.close()


def test_models_lists_aliases(gw: ServerThread) -> None:
    ids = [m.id for m in _client(gw).models.list()]
    assert ids == ["fake-model"]


@pytest.mark.parametrize(
    ("kwargs", "status", "code", "param"),
    [
        ({"n": 0}, 400, "invalid_value", "n"),
        ({"temperature": 3}, 400, "invalid_value", "temperature"),
        ({"extra_body": {"best_of": 4}}, 400, "unknown_parameter", "best_of"),
        ({"model": "nope"}, 404, "model_not_found", "model"),
    ],
)
def test_sdk_sees_openai_errors(
    gw: ServerThread, kwargs: dict[str, Any], status: int, code: str, param: str
) -> None:
    args: dict[str, Any] = {"model": "fake-model", "messages": MESSAGES, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        _client(gw).chat.completions.create(**args)
    assert info.value.status_code == status
    assert info.value.code == code
    assert info.value.param == param
