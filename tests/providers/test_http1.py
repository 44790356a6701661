"""The upstream HTTP/1.1 client (``ncap.providers.http1``) against real local servers:
an aiohttp server for the ordinary answers, and raw asyncio servers where the test needs
the bytes and the closes exactly (a stale kept-alive connection, an answer cut after its
first byte, a trickling body). Connections are told apart by the client's port."""

from __future__ import annotations

import asyncio
import datetime
import gzip
import ipaddress
import ssl
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import ncap.providers.http1 as http1
from ncap.providers.base import AttemptFailed
from ncap.providers.http1 import (
    ConnectError,
    HttpClient,
    LineTooLong,
    PayloadError,
    ServerDisconnected,
)
from ncap.providers.transport import HttpTransport, ReadGapWatch, mapped

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Server:
    """An aiohttp server on a free port that records each request's peer and headers."""

    def __init__(self, handler: Handler, ssl_context: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.ssl_context = ssl_context
        self.peers: list[Any] = []
        self.headers: list[Any] = []
        self.bodies: list[bytes] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        self.headers.append([(k.decode(), v.decode()) for k, v in request.raw_headers])
        self.bodies.append(await request.read())
        return await self.handler(request)

    async def __aenter__(self) -> Server:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    def url(self, path: str = "/v1/chat/completions", scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"


def _client(limit: int = 8, **kwargs: Any) -> HttpClient:
    headers = {"Authorization": "Bearer k", "Content-Type": "application/json"}
    return HttpClient(headers, max_connections=limit, connect_timeout=2, **kwargs)


@asynccontextmanager
async def _session(limit: int = 8, **kwargs: Any) -> AsyncIterator[HttpClient]:
    """``_client``, closed at the end of the block."""
    client = _client(limit, **kwargs)
    try:
        yield client
    finally:
        await client.close()


async def _whole(client: HttpClient, url: str, data: bytes = b"{}") -> tuple[int, bytes]:
    resp = await client.post(url, data, whole=True, cap=1 << 20)
    return resp.status, await resp.read()


# --- bodies ---


async def test_content_length_and_chunked_bodies_are_read_whole_on_one_connection() -> None:
    big = b"0123456789" * 50_000  # 500 KB: many reads, in both framings

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.query.get("chunked"):
            resp = web.StreamResponse()
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for start in range(0, len(big), 65_536):
                await resp.write(big[start : start + 65_536])
            await resp.write_eof()
            return resp
        return web.Response(body=big)

    async with Server(handler) as server, _session() as client:
        for query in ("", "?chunked=1", "", "?chunked=1"):
            assert await _whole(client, server.url("/x" + query)) == (200, big)
            resp = await client.post(server.url("/x" + query), b"{}")  # streamed
            assert await resp.content.read() == big and resp.content.at_eof()
            resp.release()
    assert len(server.peers) == 8 and len(set(server.peers)) == 1


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw-deflate"])
async def test_compressed_bodies_are_decoded(encoding: str) -> None:
    text = b'{"choices":[{"text":"' + b"abc" * 200_000 + b'"}]}'
    if encoding == "gzip":
        sent = gzip.compress(text)
    elif encoding == "deflate":
        sent = zlib.compress(text)
    else:  # what some servers send as deflate: the stream without zlib's wrapper
        obj = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        sent = obj.compress(text) + obj.flush()
    header = "gzip" if encoding == "gzip" else "deflate"

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=sent, headers={"Content-Encoding": header})

    async with Server(handler) as server, _session() as client:
        assert await _whole(client, server.url()) == (200, text)
        resp = await client.post(server.url(), b"{}")
        reads = []
        while piece := await resp.content.readany():
            reads.append(piece)
        resp.release()
        # a compressed body is decoded a bounded step at a time
        assert b"".join(reads) == text and max(map(len, reads)) <= 1 << 18
    assert ("Accept-Encoding", "gzip, deflate") in server.headers[0]


async def test_a_corrupt_compressed_body_is_a_payload_error() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b"not gzip at all", headers={"Content-Encoding": "gzip"})

    async with Server(handler) as server, _session() as client:
        resp = await client.post(server.url(), b"{}")
        with pytest.raises(PayloadError):
            await resp.read()


async def test_headers_are_case_insensitive_and_the_request_is_what_aiohttp_sent() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b"{}", headers={"X-Request-ID": "rid-1", "Set-Cookie": "a=b"})

    async with Server(handler) as server, _session() as client:
        resp = await client.post(server.url(), b'{"a":1}', headers={"X-Client-Request-Id": "c"})
        await resp.read()
    for name in ("x-request-id", "X-REQUEST-ID", "X-Request-Id"):
        assert resp.headers.get(name) == "rid-1"
        assert resp.headers[name] == "rid-1"
    sent = dict(server.headers[0])
    assert sent == {
        "Host": f"127.0.0.1:{server.port}",
        "Authorization": "Bearer k",
        "Content-Type": "application/json",
        "Accept": "*/*",
        "Accept-Encoding": "gzip, deflate",
        "User-Agent": http1.USER_AGENT,
        "X-Client-Request-Id": "c",
        "Content-Length": "7",
    }
    assert server.bodies == [b'{"a":1}']


async def test_a_request_header_replaces_the_clients_own_of_the_same_name() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b"{}")

    async with Server(handler) as server, _session() as client:
        await _whole(client, server.url())
        resp = await client.post(server.url(), b"{}", headers={"authorization": "Bearer 2"})
        await resp.read()
    second = server.headers[1]
    assert [v for k, v in second if k.lower() == "authorization"] == ["Bearer 2"]
    with pytest.raises(ValueError):
        client.encode(server.url(), b"", {"X-Bad": "a\r\nInjected: 1"})


async def test_a_redirect_is_returned_not_followed() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=307, headers={"Location": "http://127.0.0.1:9/elsewhere"})

    async with Server(handler) as server, _session() as client:
        assert await _whole(client, server.url()) == (307, b"")
    assert len(server.peers) == 1


async def test_a_connection_close_answer_is_not_reused() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b"{}", headers={"Connection": "close"})

    async with Server(handler) as server, _session() as client:
        for _ in range(3):
            assert await _whole(client, server.url()) == (200, b"{}")
    assert len(set(server.peers)) == 3


# --- raw servers: exact bytes and closes ---

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"


class RawServer:
    """An asyncio server that hands each request (its head, read up to the blank line,
    and a body of ``Content-Length``) with its connection number to ``answer``."""

    def __init__(self, answer: Callable[[int, int, asyncio.StreamWriter], Awaitable[bool]]) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[tuple[int, bytes]] = []
        self.server: asyncio.Server | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                self.requests.append((number, body))
                if not await self.answer(number, len(self.requests), writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"


async def test_a_stale_kept_alive_connection_is_retried_once_on_a_fresh_one() -> None:
    """The server takes the second request on the kept-alive connection and closes it
    without a byte (an idle timeout racing the request): the request goes again on a
    new connection, and its answer is the caller's."""

    async def answer(conn: int, number: int, writer: asyncio.StreamWriter) -> bool:
        if conn == 1 and number == 2:
            return False  # closed without a byte of the answer
        writer.write(OK)
        return True

    async with RawServer(answer) as server, _session() as client:
        assert await _whole(client, server.url, b'{"n":1}') == (200, b"{}")
        assert await _whole(client, server.url, b'{"n":2}') == (200, b"{}")
    assert server.requests == [(1, b'{"n":1}'), (1, b'{"n":2}'), (2, b'{"n":2}')]


async def test_a_fresh_connection_closed_before_the_answer_is_not_retried() -> None:
    async def answer(conn: int, number: int, writer: asyncio.StreamWriter) -> bool:
        return False

    async with RawServer(answer) as server, _session() as client:
        with pytest.raises(ServerDisconnected):
            await _whole(client, server.url)
    assert server.requests == [(1, b"{}")]


async def test_no_retry_once_a_byte_of_the_answer_arrived() -> None:
    """On the reused connection the server sends the start of a status line, then
    closes: the upstream may have acted on the request, so it is not sent again."""

    async def answer(conn: int, number: int, writer: asyncio.StreamWriter) -> bool:
        if number == 2:
            writer.write(b"HTTP/1.1 200")
            await writer.drain()
            return False
        writer.write(OK)
        return True

    async with RawServer(answer) as server, _session() as client:
        await _whole(client, server.url)
        with pytest.raises(ServerDisconnected):
            await _whole(client, server.url)
    assert server.requests == [(1, b"{}"), (1, b"{}")]


async def test_a_body_cut_after_the_head_is_a_payload_error_with_the_head_kept() -> None:
    async def answer(conn: int, number: int, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nX-Request-Id: r9\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        return False

    async with RawServer(answer) as server, _session() as client:
        resp = await client.post(server.url, b"{}", whole=True, cap=1 << 20)
        assert resp.headers.get("x-request-id") == "r9"
        with pytest.raises(PayloadError):
            await resp.read()


async def test_a_malformed_chunk_is_a_payload_error() -> None:
    async def answer(conn: int, number: int, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\nzz\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)
        return False

    async with RawServer(answer) as server, _session() as client:
        resp = await client.post(server.url, b"{}")
        with pytest.raises(PayloadError):
            await resp.content.read()


async def test_a_body_to_the_connections_close_is_read_whole() -> None:
    async def answer(conn: int, number: int, writer: asyncio.StreamWriter) -> bool:
        writer.write(b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"a":')
        await writer.drain()
        writer.write(b"1}")
        return False

    async with RawServer(answer) as server, _session() as client:
        assert await _whole(client, server.url) == (200, b'{"a":1}')


async def test_a_refused_connection_is_a_connect_error() -> None:
    async with RawServer(lambda *a: asyncio.sleep(0, False)) as server:
        url = server.url
    async with _session() as client:
        with pytest.raises(ConnectError):
            await _whole(client, url)


async def test_a_whole_answer_declared_over_the_bound_is_handed_over_at_its_head() -> None:
    async def answer(conn: int, number: int, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n{")
        await writer.drain()
        await asyncio.sleep(5)
        return False

    async with RawServer(answer) as server, _session() as client:
        async with asyncio.timeout(1):
            resp = await client.post(server.url, b"{}", whole=True, cap=1000)
        assert resp.content_length == 1_000_000
        resp.close()


async def test_the_transport_maps_a_refused_connection_as_not_dispatched() -> None:
    async with RawServer(lambda *a: asyncio.sleep(0, False)) as server:
        url = server.url
    transport = _transport(url)
    try:
        with pytest.raises(AttemptFailed) as caught:
            await transport.post(b"{}", timeout=5)
    finally:
        await transport.aclose()
    assert (caught.value.kind, caught.value.dispatched) == ("connection", False)


# --- the pool ---


async def test_the_pool_limit_holds_under_concurrency() -> None:
    active = 0
    most = 0

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal active, most
        active += 1
        most = max(most, active)
        await asyncio.sleep(0.02)
        active -= 1
        return web.Response(body=b"{}")

    async with Server(handler) as server, _session(limit=3) as client:
        answers = await asyncio.gather(*(_whole(client, server.url()) for _ in range(20)))
        assert client.pool(server.url()).limit == 3
        assert len(client.pool(server.url()).open) <= 3
    assert answers == [(200, b"{}")] * 20
    assert most == 3 and len(set(server.peers)) == 3


async def test_a_waiter_cancelled_in_the_queue_leaves_the_pool_usable() -> None:
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(body=b"{}")

    async with Server(handler) as server, _session(limit=1) as client:
        first = asyncio.create_task(_whole(client, server.url()))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(_whole(client, server.url()))
        await asyncio.sleep(0.05)
        queued.cancel()
        release.set()
        assert await first == (200, b"{}")
        assert await _whole(client, server.url()) == (200, b"{}")
    assert len(set(server.peers)) == 1


# --- streams: cancellation, flow control, gaps, lines ---


def _streaming(pieces: int, gap_s: float, piece: bytes = b"data: x\n\n") -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(pieces):
            await resp.write(piece)
            await asyncio.sleep(gap_s)
        await resp.write_eof()
        return resp

    return handler


def _transport(url: str, **kwargs: Any) -> HttpTransport:
    def failure(status: int, headers: Any, payload: bytes) -> AttemptFailed:
        return AttemptFailed("status", status)

    return HttpTransport(
        url,
        headers={"Authorization": "Bearer k", "Content-Type": "application/json"},
        connect_timeout_s=2,
        max_connections=8,
        failure_of=failure,
        **kwargs,
    )


async def test_a_cancelled_stream_closes_its_connection() -> None:
    async with Server(_streaming(50, 0.02)) as server:
        transport = _transport(server.url())
        reading = asyncio.Event()

        async def read() -> None:
            async with transport.open(b"{}", timeout=5) as resp:
                await resp.content.readany()
                reading.set()
                while await resp.content.readany():
                    pass

        try:
            task = asyncio.create_task(read())
            await reading.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            pool = transport._client().pool(server.url())
            assert not pool.open  # closed, not back in the pool half read
            payload, _, _ = await transport.post(b"{}", timeout=5)
        finally:
            await transport.aclose()
    assert payload.count(b"data: x") == 50
    assert len(set(server.peers)) == 2


async def test_an_unread_stream_pauses_the_socket_and_resumes_when_read() -> None:
    chunk = b"y" * 65_536
    async with Server(_streaming(64, 0, chunk)) as server, _session() as client:  # 4 MiB
        resp = await client.post(server.url(), b"{}")
        await asyncio.sleep(0.3)  # the reader is away: the client stops reading
        conn = resp._conn
        assert conn is not None and conn._reading_paused
        assert resp.content._size < 1 << 20
        data = await resp.content.read()
        resp.release()
    assert data == chunk * 64


async def test_a_trickling_body_times_out_on_the_gap_not_the_total() -> None:
    async with Server(_streaming(6, 0.1)) as server, _session() as client:
        resp = await client.post(server.url(), b"{}")
        resp.content.read_timeout = 0.5  # each gap 0.1 s, the whole 0.6 s: fine
        assert (await resp.content.read()).count(b"data: x") == 6
        resp.release()

    async with Server(_streaming(3, 1.0)) as server:
        transport = _transport(server.url())
        try:
            with pytest.raises(AttemptFailed) as caught:
                async with transport.open(b"{}", timeout=0.3) as resp:
                    with mapped(partial=True):
                        while await resp.content.readany():
                            pass
        finally:
            await transport.aclose()
    assert (caught.value.kind, caught.value.partial) == ("timeout", True)


async def test_the_gap_watch_replaces_the_bodys_own_timer() -> None:
    async with Server(_streaming(3, 1.0)) as server:
        transport = _transport(server.url())
        try:
            started = asyncio.get_running_loop().time()
            with pytest.raises(AttemptFailed) as caught:
                async with transport.open(b"{}", timeout=0.3) as resp:
                    gaps = ReadGapWatch(resp, 0.3)
                    assert resp.content.read_timeout is None
                    try:
                        with mapped(partial=True):
                            while True:
                                gaps.since = gaps.now()
                                if not await resp.content.readany():
                                    break
                                gaps.since = None
                    finally:
                        gaps.close()
            waited = asyncio.get_running_loop().time() - started
        finally:
            await transport.aclose()
    assert caught.value.kind == "timeout" and waited < 1.0


async def test_lines_are_split_across_reads_and_a_line_past_the_bound_fails() -> None:
    text = b"data: a\n\ndata: " + b"b" * 5000 + b"\n\ndata: c"
    async with Server(_streaming(1, 0, text)) as server, _session() as client:
        resp = await client.post(server.url(), b"{}")
        lines = [line async for line in resp.content]
        resp.release()
    assert b"".join(lines) == text and lines[0] == b"data: a\n" and lines[-1] == b"data: c"

    long_line = b"data: " + b"z" * 200_000
    async with Server(_streaming(1, 0, long_line)) as server, _session() as client:
        resp = await client.post(server.url(), b"{}")
        with pytest.raises(LineTooLong):
            async for _ in resp.content:
                pass
        resp.close()


# --- TLS ---


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ncap-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture
async def tls_server(tmp_path: Path) -> AsyncIterator[tuple[Server, Path]]:
    cert, key = _self_signed(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"secure": request.secure})

    async with Server(handler, server_context) as server:
        yield server, cert


async def test_https_with_the_servers_certificate_trusted(
    tls_server: tuple[Server, Path],
) -> None:
    server, cert = tls_server
    trusted = ssl.create_default_context(cafile=str(cert))
    async with _session(ssl_context=trusted) as client:
        for _ in range(2):
            assert await _whole(client, server.url(scheme="https")) == (200, b'{"secure": true}')
    assert len(set(server.peers)) == 1  # kept alive over TLS too


async def test_https_refuses_an_untrusted_certificate(tls_server: tuple[Server, Path]) -> None:
    server, _ = tls_server
    transport = _transport(server.url(scheme="https"))  # the default context
    try:
        with pytest.raises(AttemptFailed) as caught:
            await transport.post(b"{}", timeout=5)
    finally:
        await transport.aclose()
    assert (caught.value.kind, caught.value.dispatched) == ("connection", False)
    assert server.peers == []


async def test_the_transport_takes_an_ssl_context(tls_server: tuple[Server, Path]) -> None:
    server, cert = tls_server
    transport = _transport(
        server.url(scheme="https"), ssl_context=ssl.create_default_context(cafile=str(cert))
    )
    try:
        payload, headers, _ = await transport.post(b"{}", timeout=5)
    finally:
        await transport.aclose()
    assert payload == b'{"secure": true}'
    assert headers.get("content-type") == "application/json; charset=utf-8"
