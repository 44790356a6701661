"""The OpenAI provider's error mapping, table-driven, against a real aiohttp server on
localhost (no real network): status × body shape × Retry-After form → the normalized
``AttemptFailed`` (kind, status, retryable, code/param/message, retry delay, provider
request id). Then the body and stream faults the transport maps: a body cut mid-way, a
stream whose first event is malformed, a long event line, a line over the bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from aiohttp import web

from ncap.config import OpenAIRoute
from ncap.lifecycle.failures import retryable
from ncap.providers.base import AttemptFailed
from ncap.providers.openai import OpenAIProvider
from ncap.streaming import sse

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RID = "req-upstream-42"
ENVELOPE = (
    b'{"error":{"message":"Invalid value for n","type":"invalid_request_error",'
    b'"param":"n","code":"invalid_value"}}'
)
BODIES: dict[str, bytes] = {
    "envelope": ENVELOPE,
    "envelope_nulls": b'{"error":{"message":"Server error","type":"server_error",'
    b'"param":null,"code":null}}',
    "empty": b"",
    "html": b"<html><body><h1>502 Bad Gateway</h1></body></html>",
    "non_json": b"upstream exploded",
    "truncated": ENVELOPE[:40],
    "wrong_shape": b'{"error":"just a string"}',
}
DETAILS = {
    "envelope": ("Invalid value for n", "invalid_value", "n"),
    "envelope_nulls": ("Server error", None, None),
}
RETRY_AFTER: dict[str, tuple[dict[str, str], float | None]] = {
    "none": ({}, None),
    "seconds": ({"retry-after": "7"}, 7.0),
    "fraction": ({"retry-after": "0.5"}, 0.5),
    "ms": ({"retry-after-ms": "250"}, 0.25),
    "ms_wins": ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
    "http_date": ({"retry-after": "Wed, 21 Oct 2026 07:28:00 GMT"}, None),
    "bad_ms_then_seconds": ({"retry-after-ms": "soon", "retry-after": "3"}, 3.0),
    "negative": ({"retry-after": "-4"}, 0.0),
}
STATUSES = {400: False, 401: False, 404: False, 408: True, 409: True, 422: False,
            429: True, 500: True, 502: True, 503: True, 504: True}  # fmt: skip


@dataclass
class Upstream:
    """A localhost server whose one route answers with whatever ``handler`` says."""

    url: str
    handler: Handler | None = None


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    app = web.Application()
    up = Upstream("")

    async def route(request: web.Request) -> web.StreamResponse:
        assert up.handler is not None
        return await up.handler(request)

    app.router.add_post("/v1/chat/completions", route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    up.url = f"http://127.0.0.1:{port}/v1"
    yield up
    await runner.cleanup()


@pytest.fixture
async def provider(upstream: Upstream) -> AsyncIterator[OpenAIProvider]:
    p = OpenAIProvider(OpenAIRoute(provider="openai", base_url=upstream.url), route_id="r")
    yield p
    await p.aclose()


def _answer(status: int, body: bytes, headers: dict[str, str]) -> Handler:
    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(status=status, body=body, headers={"x-request-id": RID, **headers})

    return handler


async def _complete_failure(provider: OpenAIProvider) -> AttemptFailed:
    with pytest.raises(AttemptFailed) as info:
        await provider.complete({"model": "m", "messages": []}, timeout=5)
    return info.value


async def _stream_failure(provider: OpenAIProvider) -> AttemptFailed:
    with pytest.raises(AttemptFailed) as info:
        async with provider.stream({"model": "m", "stream": True}, timeout=5) as (_, events):
            async for _event in events:
                pass
    return info.value


@pytest.mark.parametrize("shape", BODIES)
@pytest.mark.parametrize("status", STATUSES)
@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_status_and_body_shape_normalize(
    upstream: Upstream, provider: OpenAIProvider, status: int, shape: str, stream: bool
) -> None:
    upstream.handler = _answer(status, BODIES[shape], {})
    failure = await (_stream_failure if stream else _complete_failure)(provider)
    assert (failure.kind, failure.status, retryable(failure)) == (
        "status",
        status,
        STATUSES[status],
    )
    assert failure.provider_request_id == RID
    assert failure.retry_after is None
    assert (failure.partial, failure.dispatched) == (False, True)
    detail = DETAILS.get(shape)
    if detail is None:
        assert failure.error is None  # nothing readable: no message is invented
    else:
        assert failure.error is not None
        assert (failure.error.message, failure.error.code, failure.error.param) == detail


@pytest.mark.parametrize("form", RETRY_AFTER)
@pytest.mark.parametrize("status", [429, 503])
async def test_retry_after_forms(
    upstream: Upstream, provider: OpenAIProvider, status: int, form: str
) -> None:
    headers, expected = RETRY_AFTER[form]
    upstream.handler = _answer(status, ENVELOPE, headers)
    failure = await _complete_failure(provider)
    assert (failure.status, failure.retry_after, retryable(failure)) == (status, expected, True)


async def test_an_error_body_is_read_only_up_to_its_bound(
    upstream: Upstream, provider: OpenAIProvider
) -> None:
    """A huge error body is cut before decoding: an envelope past 64 KiB is unreadable."""
    upstream.handler = _answer(400, ENVELOPE[:-2] + b" " * 70_000 + b"}}", {})
    assert (await _complete_failure(provider)).error is None
    upstream.handler = _answer(400, ENVELOPE[:-2] + b" " * 60_000 + b"}}", {})
    assert (await _complete_failure(provider)).error is not None


async def test_a_200_that_is_not_a_completion_is_a_protocol_failure(
    upstream: Upstream, provider: OpenAIProvider
) -> None:
    upstream.handler = _answer(200, b"<html>oops</html>", {})
    failure = await _complete_failure(provider)
    assert (failure.kind, failure.status, failure.provider_request_id) == ("protocol", 200, RID)
    assert not retryable(failure)


def _cut_body(first: bytes, declared: int) -> Handler:
    """A response head (with its request id) and part of the body, then a closed socket."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"x-request-id": RID, "Content-Length": str(declared)})
        await resp.prepare(request)
        await resp.write(first)
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return resp

    return handler


async def test_a_body_cut_mid_way_keeps_the_request_id(
    upstream: Upstream, provider: OpenAIProvider
) -> None:
    upstream.handler = _cut_body(b'{"id":"chatcmpl-1","choices":[', 500)
    failure = await _complete_failure(provider)
    assert (failure.kind, failure.provider_request_id) == ("connection", RID)
    assert failure.partial and not retryable(failure)  # it may have been generated and billed


def _sse(text: bytes, *, chunk: int = 0) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"x-request-id": RID, "Content-Type": "text/event-stream"}
        )
        await resp.prepare(request)
        step = chunk or len(text) or 1
        for start in range(0, len(text), step):
            await resp.write(text[start : start + step])
        await resp.write_eof()
        return resp

    return handler


async def test_a_malformed_first_event_keeps_the_request_id(
    upstream: Upstream, provider: OpenAIProvider
) -> None:
    upstream.handler = _sse(b"data: {not json\n\n")
    failure = await _stream_failure(provider)
    assert (failure.kind, failure.status, failure.provider_request_id) == ("protocol", 200, RID)
    assert failure.partial


async def test_a_stream_cut_before_its_first_event_keeps_the_request_id(
    upstream: Upstream, provider: OpenAIProvider
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"x-request-id": RID})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(b'data: {"id":"c1","cho')
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return resp

    upstream.handler = handler
    failure = await _stream_failure(provider)
    assert (failure.kind, failure.provider_request_id) == ("connection", RID)


LONG = b'data: {"id":"' + b"x" * 300_000 + b'","choices":[]}\n\n'


async def test_a_long_event_line_streams_through(
    upstream: Upstream, provider: OpenAIProvider
) -> None:
    """300 KB on one line (over aiohttp's 128 KiB line limit) arrives as one event."""
    upstream.handler = _sse(LONG + sse.DONE, chunk=16_384)
    async with provider.stream({"model": "m", "stream": True}, timeout=5) as (rid, events):
        raws = [e.raw async for e in events]
    assert (rid, raws) == (RID, [LONG, sse.DONE])


async def test_a_line_over_the_bound_is_a_protocol_failure(
    upstream: Upstream, provider: OpenAIProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the relay then does with it is the malformed-JSON row of the fault table
    (tests/http/test_fault_table.py): an error event to the client, the row cut and held."""
    monkeypatch.setattr(sse, "MAX_LINE_BYTES", 100_000)
    upstream.handler = _sse(LONG, chunk=16_384)
    failure = await _stream_failure(provider)
    assert (failure.kind, failure.status, failure.partial) == ("protocol", 200, True)
    assert failure.provider_request_id == RID
    assert "over 100000 bytes" in failure.detail
