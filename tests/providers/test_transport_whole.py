"""A whole answer's body as ``HttpTransport.post`` returns it: the bytes the upstream
sent, however they arrived (at once, in chunks, with or without a length), and past
the answer's bound an ``oversized`` failure, never a body longer than the bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from ncap.providers.base import AttemptFailed
from ncap.providers.transport import HttpTransport


async def _answer(request: web.Request) -> web.StreamResponse:
    """``?size=N`` bytes; ``&chunks=K``: chunked, in K writes a moment apart."""
    size = int(request.query["size"])
    chunks = int(request.query.get("chunks", "0"))
    body = bytes(48 + i % 10 for i in range(size))
    if not chunks:
        return web.Response(body=body, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    step = -(-size // chunks)
    for start in range(0, size, step):
        await resp.write(body[start : start + step])
        await asyncio.sleep(0.01)
    await resp.write_eof()
    return resp


@pytest.fixture
async def upstream() -> AsyncIterator[TestServer]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _answer)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


def _transport(server: TestServer, query: str) -> HttpTransport:
    def failure(status: int, headers: Any, payload: bytes) -> AttemptFailed:
        return AttemptFailed("status", status)

    url = f"http://127.0.0.1:{server.port}/v1/chat/completions?{query}"
    return HttpTransport(
        url, headers={}, connect_timeout_s=2, max_connections=4, failure_of=failure
    )


def _expected(size: int) -> bytes:
    return bytes(48 + i % 10 for i in range(size))


@pytest.mark.parametrize(
    ("size", "chunks"), [(0, 0), (1, 0), (5000, 0), (200_000, 0), (5000, 3), (200_000, 7)]
)
async def test_the_body_is_the_bytes_sent(upstream: TestServer, size: int, chunks: int) -> None:
    transport = _transport(upstream, f"size={size}&chunks={chunks}")
    try:
        for _ in range(2):  # the second on the kept connection
            payload, _headers, _ = await transport.post(b"{}", timeout=5, limit=1 << 20)
            assert payload == _expected(size)
    finally:
        await transport.aclose()


@pytest.mark.parametrize(("size", "chunks"), [(101, 0), (5000, 0), (5000, 3), (200_000, 0)])
async def test_a_body_past_the_bound_is_oversized(
    upstream: TestServer, size: int, chunks: int
) -> None:
    transport = _transport(upstream, f"size={size}&chunks={chunks}")
    try:
        with pytest.raises(AttemptFailed) as failed:
            await transport.post(b"{}", timeout=5, limit=100)
        assert failed.value.kind == "oversized"
        # the bound itself is not past it
        exact = _transport(upstream, "size=100")
        try:
            payload, _headers, _ = await exact.post(b"{}", timeout=5, limit=100)
            assert payload == _expected(100)
        finally:
            await exact.aclose()
    finally:
        await transport.aclose()
