"""The gateway's ``local`` provider over the real engine (model loaded once here)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from ncap.config import LocalRoute
from ncap.errors import ContextLengthExceeded
from ncap.providers.local import LocalProvider
from tests.engine._require import require_engine

require_engine()
pytestmark = pytest.mark.engine

BODY = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Name a colour."}],
    "n": 3,
    "max_tokens": 6,
    "seed": 21,
}


@pytest.fixture
async def provider() -> AsyncIterator[LocalProvider]:
    p = LocalProvider(LocalRoute(provider="local", n_ctx=1024, max_sequences=8, threads=2))
    yield p
    await p.aclose()


async def test_complete_returns_a_chat_completion_and_its_summary(provider: LocalProvider) -> None:
    result = await provider.complete(BODY, timeout=60)
    body = json.loads(result.body)
    assert result.status == 200
    assert body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert result.summary.id == body["id"] == result.provider_request_id
    assert [(c.index, c.finish_reason) for c in result.summary.choices] == [
        (c["index"], c["finish_reason"]) for c in body["choices"]
    ]
    assert result.summary.usage is not None
    assert result.summary.usage.completion_tokens == body["usage"]["completion_tokens"]

    stream_body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    async with provider.stream(stream_body, timeout=60) as (request_id, events):
        seen = [e async for e in events]
    assert seen[-1].raw == b"data: [DONE]\n\n" and seen[-1].summary is None
    assert all(e.raw.startswith(b"data: ") for e in seen)
    assert seen[-2].summary is not None and seen[-2].summary.usage is not None
    assert seen[-2].summary.usage.completion_tokens == body["usage"]["completion_tokens"]
    text: dict[int, str] = {}
    for event in seen[:-2]:
        (choice,) = json.loads(event.raw[6:])["choices"]
        text[choice["index"]] = text.get(choice["index"], "") + (
            choice["delta"].get("content") or ""
        )
    assert text == {c["index"]: c["message"]["content"] for c in body["choices"]}
    assert request_id is not None


async def test_engine_errors_propagate_unchanged(provider: LocalProvider) -> None:
    with pytest.raises(ContextLengthExceeded) as info:
        await provider.complete({**BODY, "max_tokens": 5000}, timeout=60)
    assert info.value.param == "messages"
    with pytest.raises(ContextLengthExceeded):
        async with provider.stream({**BODY, "max_tokens": 5000, "stream": True}, timeout=60):
            pass
