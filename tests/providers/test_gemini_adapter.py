"""The Gemini adapter on the shared transport, against canned HTTP answers: the URL and
credential it sends, Gemini 3's replay sentinel, and when a failure is the attempt's
(nothing relayed yet) or a cut of a relayed stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from ncap.config import GeminiRoute
from ncap.errors import InvalidRequest, InvalidValue, RouteDoesNotSupportCandidates
from ncap.lifecycle.failures import client_error, may_fall_back, retryable
from ncap.providers import transport
from ncap.providers.base import AttemptFailed
from ncap.providers.gemini import DEFAULT_BASE_URL, GeminiProvider
from ncap.providers.http1 import HttpClient

Seen = list[tuple[str, dict[str, str], dict[str, Any]]]
BODY: dict[str, Any] = {
    "model": "gemini-x",
    "messages": [{"role": "user", "content": "hi"}],
    "max_completion_tokens": 8,
}
DONE_EVENT = {
    "candidates": [
        {"content": {"role": "model", "parts": [{"text": "ok"}]}, "finishReason": "STOP"}
    ],
    "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 1, "totalTokenCount": 4},
    "responseId": "resp-1",
}


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events)


@asynccontextmanager
async def _upstream(
    answer: Callable[[web.Request], web.Response],
) -> AsyncIterator[tuple[str, Seen]]:
    seen: Seen = []

    async def handle(request: web.Request) -> web.Response:
        seen.append((request.path_qs, dict(request.headers), await request.json()))
        return answer(request)

    app = web.Application()
    app.router.add_post("/v1beta/models/{target}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1beta", seen
    finally:
        await runner.cleanup()


def _provider(base_url: str | None, model: str = "gemini-2.5-flash") -> GeminiProvider:
    route = GeminiRoute(
        provider="gemini", base_url=base_url, upstream_model=model, api_key_env="NCAP_T_GKEY"
    )
    return GeminiProvider(route, route_id="g")


def test_default_base_url_and_model_path(monkeypatch: pytest.MonkeyPatch) -> None:
    provider = _provider(None)
    assert provider._transport.url == f"{DEFAULT_BASE_URL}/models/gemini-2.5-flash:generateContent"
    assert provider._stream_url.endswith(":streamGenerateContent?alt=sse")


async def test_whole_and_streamed_calls_share_one_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """One route, one connection pool: a streamed call after a whole one reuses its
    kept-alive connection, and one client (one pool) is ever opened (was: a transport,
    a client and a pool per method)."""
    sessions: list[HttpClient] = []

    def counted(*args: Any, **kwargs: Any) -> HttpClient:
        sessions.append(HttpClient(*args, **kwargs))
        return sessions[-1]

    monkeypatch.setattr(transport, "HttpClient", counted)
    peers: list[tuple[str, int]] = []
    paths: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        paths.append(request.path_qs)
        await request.read()
        if request.query.get("alt") == "sse":
            return web.Response(body=_sse(DONE_EVENT), content_type="text/event-stream")
        return web.json_response(DONE_EVENT)

    app = web.Application()
    app.router.add_post("/v1beta/models/{target}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        provider = _provider(f"http://127.0.0.1:{runner.addresses[0][1]}/v1beta")
        await provider.complete(BODY, timeout=5)
        async with provider.stream(BODY, timeout=5) as (_, events):
            assert [e async for e in events]
        await provider.complete(BODY, timeout=5)
        await provider.aclose()
    finally:
        await runner.cleanup()
    assert [p.rpartition(":")[2] for p in paths] == [
        "generateContent",
        "streamGenerateContent?alt=sse",
        "generateContent",
    ]
    assert len(sessions) == 1
    assert peers[0] == peers[1]  # the stream went over the whole call's connection


async def test_key_in_header_never_in_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCAP_T_GKEY", "secret-key")

    def answer(_: web.Request) -> web.Response:
        return web.json_response(DONE_EVENT)

    async with _upstream(answer) as (url, seen):
        provider = _provider(url)
        result = await provider.complete(BODY, timeout=5)
        await provider.aclose()
    path, headers, _ = seen[0]
    assert path == "/v1beta/models/gemini-2.5-flash:generateContent"
    assert headers["x-goog-api-key"] == "secret-key"
    assert "secret-key" not in path
    assert result.provider_request_id == "resp-1"
    assert json.loads(result.body)["choices"][0]["message"]["content"] == "ok"


async def test_gemini_3_replays_calls_with_the_skip_sentinel() -> None:
    body = {
        **BODY,
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    }

    def answer(_: web.Request) -> web.Response:
        return web.json_response(DONE_EVENT)

    async with _upstream(answer) as (url, seen):
        for model in ("gemini-3-pro-preview", "gemini-2.5-pro"):
            provider = _provider(url, model)
            await provider.complete(body, timeout=5)
            await provider.aclose()
    signatures = [
        [
            p.get("thoughtSignature")
            for c in sent["contents"]
            for p in c["parts"]
            if "functionCall" in p
        ]
        for _, _, sent in seen
    ]
    assert signatures == [["skip_thought_signature_validator"], [None]]


async def test_a_prompt_blocked_at_the_first_event_fails_the_attempt() -> None:
    blocked = {
        "promptFeedback": {"blockReason": "SAFETY"},
        "usageMetadata": {"promptTokenCount": 5},
    }

    def answer(_: web.Request) -> web.Response:
        return web.Response(body=_sse(blocked), content_type="text/event-stream")

    async with _upstream(answer) as (url, _):
        provider = _provider(url)
        with pytest.raises(AttemptFailed) as info:
            async with provider.stream(BODY, timeout=5) as (_, events):
                async for _event in events:
                    pass
        await provider.aclose()
    failure = info.value
    assert not failure.partial and not may_fall_back(failure)  # the request's own fault
    client = client_error(failure)
    assert isinstance(client, InvalidRequest) and client.code == "content_filter"
    assert failure.usage is not None and failure.usage.prompt_tokens == 5


async def test_an_error_event_after_content_is_a_cut_of_a_relayed_stream() -> None:
    first = {"candidates": [{"content": {"role": "model", "parts": [{"text": "par"}]}}]}
    error = {"error": {"code": 503, "status": "UNAVAILABLE", "message": "overloaded"}}

    def answer(_: web.Request) -> web.Response:
        return web.Response(body=_sse(first, error), content_type="text/event-stream")

    async with _upstream(answer) as (url, _):
        provider = _provider(url)
        relayed = []
        with pytest.raises(AttemptFailed) as info:
            async with provider.stream(BODY, timeout=5) as (_, events):
                async for event in events:
                    relayed.append(event)
        await provider.aclose()
    assert relayed and info.value.partial and not retryable(info.value)


async def test_a_candidates_refusal_may_fall_back() -> None:
    refusal = {
        "error": {
            "code": 400,
            "status": "INVALID_ARGUMENT",
            "message": "Multiple candidates is not enabled for this model",
        }
    }

    def answer(_: web.Request) -> web.Response:
        return web.json_response(refusal, status=400)

    async with _upstream(answer) as (url, _):
        provider = _provider(url)
        with pytest.raises(AttemptFailed) as info:
            await provider.complete({**BODY, "n": 2}, timeout=5)
        await provider.aclose()
    failure = info.value
    assert (retryable(failure), may_fall_back(failure), failure.max_candidates) == (False, True, 1)
    client = client_error(failure)
    assert isinstance(client, RouteDoesNotSupportCandidates)
    assert client.param == "n"


async def test_legacy_completions_are_refused_before_sending() -> None:
    provider = _provider("http://127.0.0.1:9/v1beta")
    with pytest.raises(InvalidValue) as info:
        await provider.complete({"model": "g", "prompt": "p"}, timeout=1, kind="completions")
    assert info.value.param == "model"
