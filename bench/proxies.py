"""Bare pass-through proxies, one per candidate server/client stack.

Each receives ``POST /v1/chat/completions``, forwards the body unchanged to the
upstream, and returns the upstream's status, content type and body. No parsing,
no logging: what is left is the cost of the HTTP server, the HTTP client and the
event loop, which is the floor under any gateway built on that stack.

The ``+fixed`` kinds answer a fixed chat completion without any upstream: what the
HTTP server alone costs per request, on aiohttp's ``web.Application`` (with as many
paths as ncap's router holds), on its low-level ``web_server.Server`` (no router, no
application layer), or on a bare ``asyncio.Protocol`` over ``httptools`` (llhttp):
the floor of a server of ncap's own, which this sketch is not (keep-alive only, no
limits, no chunked bodies, no pipelining, no streaming, no drain). ``protocol+lean``
puts that sketch in front of ncap's upstream client: the floor of a pass-through built
on both.

Usage: proxies.py KIND --port P --upstream URL
KIND is one of KINDS; the granian kinds exec the ``granian`` CLI on this module.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, Protocol

KINDS = (
    "aiohttp+aiohttp",
    "aiohttp+httpx",
    "aiohttp+lean",
    "aiohttp+fixed",
    "aiohttp-server+fixed",
    "protocol+fixed",
    "protocol+lean",
    "front+fixed",
    "uvicorn-asgi+aiohttp",
    "granian-asgi+aiohttp",
    "granian-rsgi+aiohttp",
)
UPSTREAM_ENV = "NCAP_BENCH_UPSTREAM_URL"
Reply = tuple[int, bytes, str]


class Forwarder(Protocol):
    async def post(self, body: bytes) -> Reply: ...

    async def close(self) -> None: ...


class AiohttpForwarder:
    """One pooled aiohttp session, created on first use inside the server's loop."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._session: Any = None

    async def post(self, body: bytes) -> Reply:
        import aiohttp

        if self._session is None:
            connector = aiohttp.TCPConnector(limit=1024, ttl_dns_cache=None)
            self._session = aiohttp.ClientSession(connector=connector)
        headers = {"Content-Type": "application/json"}
        async with self._session.post(self.url, data=body, headers=headers) as resp:
            data = await resp.read()
            return resp.status, data, resp.headers.get("Content-Type", "application/json")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class LeanForwarder:
    """ncap's own pooled HTTP/1.1 client (``ncap.providers.http1``: asyncio.Protocol and
    httptools), created on first use inside the server's loop."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: Any = None

    async def post(self, body: bytes) -> Reply:
        from ncap.providers.http1 import HttpClient

        if self._client is None:
            headers = {"Content-Type": "application/json"}
            self._client = HttpClient(headers, max_connections=1024, connect_timeout=60)
        resp = await self._client.post(self.url, body, whole=True, cap=1 << 20)
        data = await resp.read()
        return resp.status, data, resp.headers.get("Content-Type", "application/json")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


class HttpxForwarder:
    """One pooled httpx.AsyncClient, created on first use inside the server's loop."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: Any = None

    async def post(self, body: bytes) -> Reply:
        import httpx

        if self._client is None:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
            self._client = httpx.AsyncClient(limits=limits, timeout=60)
        headers = {"Content-Type": "application/json"}
        resp = await self._client.post(self.url, content=body, headers=headers)
        return resp.status_code, resp.content, resp.headers.get("Content-Type", "application/json")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


class FixedAnswer:
    """No upstream: the same small chat completion for every request."""

    BODY = (
        b'{"id":"chatcmpl-fixed","object":"chat.completion","created":1,"model":"fake-model",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},'
        b'"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
        b'"total_tokens":2}}'
    )

    async def post(self, body: bytes) -> Reply:
        return 200, self.BODY, "application/json"

    async def close(self) -> None:
        return None


def _upstream() -> str:
    return os.environ[UPSTREAM_ENV]


# --- aiohttp server ---


ROUTES_BESIDE = 16  # ncap's default app has 17 resources (paths), 42 routes


def run_aiohttp(port: int, forwarder: Forwarder) -> None:
    import uvloop
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        status, data, ctype = await forwarder.post(await request.read())
        return web.Response(status=status, body=data, headers={"Content-Type": ctype})

    async def close(_: web.Application) -> None:
        await forwarder.close()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    if isinstance(forwarder, FixedAnswer):  # as many paths as ncap's router holds
        for i in range(ROUTES_BESIDE):
            app.router.add_get(f"/other/{i}", handle)
    app.on_cleanup.append(close)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def run_aiohttp_server(port: int, forwarder: Forwarder) -> None:
    """aiohttp's low-level server: every request to one handler (no router, no app)."""
    import asyncio

    import uvloop
    from aiohttp import web, web_server

    async def handle(request: web.BaseRequest) -> web.Response:
        status, data, ctype = await forwarder.post(await request.read())
        return web.Response(status=status, body=data, headers={"Content-Type": ctype})

    async def serve() -> None:
        runner = web.ServerRunner(web_server.Server(handle, access_log=None))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    uvloop.install()
    asyncio.run(serve())


class _ProtocolServer:
    """One connection: requests parsed by httptools, each answered by ``forwarder`` in
    a task of its own (no pipelining: the load generator waits for each answer); the
    measure of a lean server's floor, not a server."""

    def __init__(self, forwarder: Forwarder) -> None:
        import asyncio

        import httptools

        self._forwarder = forwarder
        self._parser = httptools.HttpRequestParser(self)
        self._body: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        self._transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._transport = None

    def eof_received(self) -> bool:
        return False

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body, self._body = b"".join(self._body), []
        self._loop.create_task(self._answer(body))

    async def _answer(self, body: bytes) -> None:
        status, data, ctype = await self._forwarder.post(body)
        if self._transport is not None:
            head = f"HTTP/1.1 {status} OK\r\nContent-Type: {ctype}\r\n"
            head += f"Content-Length: {len(data)}\r\n\r\n"
            self._transport.write(head.encode() + data)


def run_protocol_server(port: int, forwarder: Forwarder) -> None:
    import asyncio

    import uvloop

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _ProtocolServer(forwarder), "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    uvloop.install()
    asyncio.run(serve())


def run_front_server(port: int, forwarder: Forwarder) -> None:
    """ncap's own HTTP/1.1 front (``ncap.http.front``) answering the completion path
    with ``forwarder``'s answer: what the front costs a request, limits, keep-alive
    and headers included."""
    import asyncio

    import uvloop
    from aiohttp import web

    from ncap.config import Limits
    from ncap.http.front import FrontRunner, Message

    async def chat(message: Message) -> None:
        message.body_now(1 << 20)
        status, data, ctype = await forwarder.post(b"")
        message.answer(status, {"Content-Type": ctype}, data)

    async def serve() -> None:
        app = web.Application()
        runner = FrontRunner(app, lambda: ({"/v1/chat/completions": chat}, Limits()))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    uvloop.install()
    asyncio.run(serve())


# --- raw ASGI (uvicorn, granian) ---

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class AsgiProxy:
    """A minimal ASGI 3 app: no framework, so only the server's own cost shows."""

    def __init__(self, forwarder: Forwarder) -> None:
        self.forwarder = forwarder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, self.forwarder)
            return
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        status, data, ctype = await self.forwarder.post(body)
        headers = [(b"content-type", ctype.encode()), (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


async def _lifespan(receive: Receive, send: Send, forwarder: Forwarder) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await forwarder.close()
            await send({"type": "lifespan.shutdown.complete"})
            return


def make_asgi_app() -> AsgiProxy:
    """Factory for ``granian --factory``: the upstream comes from the environment."""
    return AsgiProxy(AiohttpForwarder(_upstream()))


class RsgiProxy:
    """Granian's native RSGI interface: body in, bytes out, no ASGI messages."""

    def __init__(self, forwarder: Forwarder) -> None:
        self.forwarder = forwarder

    async def __call__(self, scope: Any, proto: Any) -> None:
        status, data, ctype = await self.forwarder.post(await proto())
        proto.response_bytes(status, [("content-type", ctype)], data)

    def __rsgi_del__(self, loop: Any) -> None:
        loop.run_until_complete(self.forwarder.close())


def make_rsgi_app() -> RsgiProxy:
    return RsgiProxy(AiohttpForwarder(_upstream()))


def run_uvicorn(port: int, forwarder: Forwarder) -> None:
    import uvicorn

    uvicorn.run(
        AsgiProxy(forwarder),
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
    )


def exec_granian(port: int, interface: str) -> None:
    """Replace this process with granian (1 worker, 1 runtime thread, uvloop)."""
    granian = str(Path(sys.executable).parent / "granian")
    factory = "proxies:make_asgi_app" if interface == "asgi" else "proxies:make_rsgi_app"
    argv = [granian, "--interface", interface, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--workers", "1", "--runtime-threads", "1", "--loop", "uvloop", "--no-ws"]
    argv += ["--log-level", "warning", "--working-dir", str(Path(__file__).parent)]
    argv += ["--factory", factory]
    os.execv(granian, argv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="full upstream chat-completions URL")
    args = p.parse_args()
    os.environ[UPSTREAM_ENV] = args.upstream
    match args.kind:
        case "aiohttp+aiohttp":
            run_aiohttp(args.port, AiohttpForwarder(args.upstream))
        case "aiohttp+httpx":
            run_aiohttp(args.port, HttpxForwarder(args.upstream))
        case "aiohttp+lean":
            run_aiohttp(args.port, LeanForwarder(args.upstream))
        case "aiohttp+fixed":
            run_aiohttp(args.port, FixedAnswer())
        case "aiohttp-server+fixed":
            run_aiohttp_server(args.port, FixedAnswer())
        case "protocol+fixed":
            run_protocol_server(args.port, FixedAnswer())
        case "protocol+lean":
            run_protocol_server(args.port, LeanForwarder(args.upstream))
        case "front+fixed":
            run_front_server(args.port, FixedAnswer())
        case "uvicorn-asgi+aiohttp":
            run_uvicorn(args.port, AiohttpForwarder(args.upstream))
        case "granian-asgi+aiohttp":
            exec_granian(args.port, "asgi")
        case "granian-rsgi+aiohttp":
            exec_granian(args.port, "rsgi")


if __name__ == "__main__":
    main()
