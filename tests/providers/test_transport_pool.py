"""A streamed answer read to its last event gives its upstream connection back to the
pool, even when the body's own end (the chunked body's last, empty chunk) comes in a
later read; a stream left on an error, or whose end never comes, closes it. A real
aiohttp upstream tells connections apart by the client's port."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

import ncap.providers.transport as transport_module
from ncap.providers.base import AttemptFailed
from ncap.providers.transport import HttpTransport

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'


class Upstream:
    """Streams two events and ``[DONE]``, then ends the body after ``end_after_s`` (a
    separate write: the terminating chunk in a read of its own), or never (``None``)."""

    def __init__(self, end_after_s: float | None = 0.05) -> None:
        self.end_after_s = end_after_s
        self.peers: list[Any] = []
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self.server = TestServer(app, host="127.0.0.1")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.peers.append(
            request.transport.get_extra_info("peername") if request.transport else None
        )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(EVENT + EVENT + b"data: [DONE]\n\n")
        if self.end_after_s is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.end_after_s)
        await resp.write_eof()
        return resp


def _transport(url: str) -> HttpTransport:
    def failure(status: int, headers: Any, payload: bytes) -> AttemptFailed:
        return AttemptFailed("status", status)

    return HttpTransport(
        url,
        headers={"Authorization": "Bearer k"},
        connect_timeout_s=2,
        max_connections=8,
        failure_of=failure,
    )


async def _stream_to_done(transport: HttpTransport) -> None:
    """As the relay reads: up to ``[DONE]``, then out of the context without an error."""
    async with transport.open(b"{}", timeout=5) as resp:
        body = b""
        while not body.endswith(b"data: [DONE]\n\n"):
            body += await resp.content.readany()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    await up.server.start_server()
    yield up
    await up.server.close()


async def test_a_finished_stream_keeps_its_connection(upstream: Upstream) -> None:
    transport = _transport(str(upstream.server.make_url("/v1/chat/completions")))
    try:
        for _ in range(3):
            started = time.monotonic()
            await _stream_to_done(transport)
            # the body's end is read in the background: the stream ends at once
            assert time.monotonic() - started < upstream.end_after_s
            await asyncio.sleep(upstream.end_after_s * 3)
        assert len(upstream.peers) == 3 and len(set(upstream.peers)) == 1, upstream.peers
    finally:
        await transport.aclose()


async def test_a_stream_left_on_an_error_closes_its_connection(upstream: Upstream) -> None:
    transport = _transport(str(upstream.server.make_url("/v1/chat/completions")))
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError):
                async with transport.open(b"{}", timeout=5) as resp:
                    await resp.content.readany()
                    raise RuntimeError("the client went away")
            await asyncio.sleep(upstream.end_after_s * 3)
        assert len(set(upstream.peers)) == 2, upstream.peers
    finally:
        await transport.aclose()


async def test_a_body_whose_end_never_comes_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transport_module, "_DRAIN_S", 0.2)
    up = Upstream(end_after_s=None)
    await up.server.start_server()
    transport = _transport(str(up.server.make_url("/v1/chat/completions")))
    try:
        await _stream_to_done(transport)
        await asyncio.sleep(0.5)  # the drain gave up and closed the connection
        await _stream_to_done(transport)
        assert len(set(up.peers)) == 2, up.peers
    finally:
        await transport.aclose()  # cancels the second stream's drain
        await up.server.close()
