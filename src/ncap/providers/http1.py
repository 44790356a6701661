"""A pooled HTTP/1.1 client for the upstream transport: ``asyncio.Protocol`` connections
parsed by ``httptools`` (llhttp, the parser uvicorn's server uses), no more than what
``HttpTransport`` asks of a client. Measured against aiohttp's client under callgrind
(docs/decisions/upstream-http-client.md), it costs the proxied request fewer
instructions: one protocol object and one parser per connection, a request written in
one ``write``, and a whole answer handed over in one wake-up when it arrived in one read.

What it does:

- One ``Pool`` per origin (scheme, host, port) with at most ``max_connections`` open;
  an acquirer past the limit waits in a FIFO queue for a connection or a free slot.
- Keep-alive: a connection goes back to the pool when its response was read to the end
  and the answer allows it (no ``Connection: close``, HTTP/1.1); otherwise it is closed.
  An idle connection older than ``IDLE_S`` is closed rather than reused.
- A stale pooled connection (an idle one the server had closed) is retried once on a
  fresh connection when it failed before any byte of the response arrived; never once a
  response byte was read (the upstream may have started on the request).
- Bodies with ``Content-Length``, chunked (httptools decodes the chunks) or read to the
  connection's close; ``Content-Encoding`` gzip and deflate decoded by zlib as the body
  is read, at most ``_DECODE_STEP`` bytes of output per read (a small compressed body
  cannot become a large buffer at once). Brotli and zstd are not advertised: no decoder
  for them is installed, as aiohttp did not send them either.
- TLS for ``https`` URLs (the default context, or the one given, with SNI).
- Timeouts: ``connect_timeout`` per connection; the caller bounds the whole exchange
  (``asyncio.timeout``); a streamed body's reads wait ``Body.read_timeout`` at most
  (None: unbounded, for a caller that watches the gaps itself).
- Flow control: a body's unread bytes past ``_HIGH_WATER`` pause the socket's reads,
  which resume when the reader takes them.
- Redirects are answers like any other (a 3xx is returned, never followed); no cookies.

A response that is abandoned (its reader cancelled, or leaving on an error) is closed
with its connection: a half-read connection never returns to the pool.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import sys
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any, cast
from urllib.parse import quote, urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = [
    "ACCEPT_ENCODING",
    "USER_AGENT",
    "Body",
    "ConnectError",
    "ConnectTimeout",
    "HttpClient",
    "HttpClientError",
    "LineTooLong",
    "PayloadError",
    "Pool",
    "ProtocolError",
    "Response",
    "ServerDisconnected",
]

ACCEPT_ENCODING = "gzip, deflate"
USER_AGENT = f"ncap Python/{sys.version_info[0]}.{sys.version_info[1]}"
IDLE_S = 15.0  # an idle connection older than this is closed, not reused (aiohttp's)
_HIGH_WATER = 1 << 18  # unread body bytes that pause the socket's reads
_DECODE_STEP = 1 << 18  # decoded bytes per read of a compressed body
_MAX_LINE = 1 << 17  # a line of a body read by lines (aiohttp's 128 KiB)


class HttpClientError(Exception):
    """Every failure of this client that is not a timeout."""


class ConnectError(HttpClientError):
    """The connection could not be made (refused, unreachable, DNS, TLS handshake):
    nothing of the request was sent."""


class ConnectTimeout(TimeoutError):
    """The connection was not made within the connect timeout."""


class ServerDisconnected(HttpClientError):
    """The connection closed before the response's head was read."""


class PayloadError(HttpClientError):
    """The response's body was cut (the connection closed before its end), could not
    be parsed (a malformed chunk) or its encoding could not be decoded."""


class ProtocolError(HttpClientError):
    """The upstream's answer is not an HTTP/1.1 response head the parser accepts (past
    the head, a body the parser rejects is a ``PayloadError``)."""


class LineTooLong(HttpClientError):
    """A body read by lines has a line past the bound (``_MAX_LINE``)."""


class _Stale(Exception):
    """A reused connection closed before any byte of its response (retried once)."""


def _headers(raw: list[tuple[str, str]]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(raw))


class Body:
    """A response's body as it arrives: ``readany`` (the bytes buffered, waiting for
    some when none are), ``read`` (all of it), ``at_eof``, line iteration, and
    ``set_exception`` (the next wait raises it: how a caller's timer fails a read)."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_decoder",
        "_eof",
        "_exc",
        "_paused",
        "_size",
        "_timer",
        "_waiter",
        "read_timeout",
    )

    def __init__(self, conn: _Connection | None, decoder: Any = None) -> None:
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._decoder = decoder
        self._paused = False
        self._timer: asyncio.TimerHandle | None = None
        self.read_timeout: float | None = None

    # --- the connection's side ---

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        self._wake()
        conn = self._conn
        if self._size > _HIGH_WATER and not self._paused and conn is not None and conn.streaming:
            self._paused = True
            conn.pause()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        """The next read (or the one waiting) raises ``exc``."""
        self._exc = exc
        self._wake()  # a waiting read finds it first thing

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # --- the reader's side ---

    def at_eof(self) -> bool:
        """The body was read to its end (nothing buffered, nothing more to come)."""
        return self._eof and not self._chunks

    def whole(self) -> bytes | None:
        """The whole body when it has all arrived undecoded and unread (a ``whole``
        request's answer, usually): taken at once, no read awaited; else None."""
        if not self._eof or self._exc is not None or self._decoder is not None or self._paused:
            return None
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        return data

    async def readany(self) -> bytes:
        """The next bytes of the body (decoded), ``b""`` at its end."""
        while True:
            if self._exc is not None:
                raise self._exc
            if self._chunks:
                chunks = self._chunks
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._size = 0
                if self._paused and self._conn is not None:
                    self._paused = False
                    self._conn.resume()
                if self._decoder is None:
                    return data
                out = self._decode(data)
                if out:
                    return out
                continue
            if self._eof:
                return self._decode_end() if self._decoder is not None else b""
            await self._wait()

    def _decode(self, data: bytes) -> bytes:
        decoder = self._decoder
        try:
            out: bytes = decoder.decompress(data, _DECODE_STEP)
        except zlib.error as exc:
            raise PayloadError(f"cannot decode the body: {exc}") from exc
        tail = decoder.unconsumed_tail
        if tail:  # the rest is decoded on the next read
            self._chunks.appendleft(tail)
            self._size += len(tail)
        return out

    def _decode_end(self) -> bytes:
        decoder = self._decoder
        self._decoder = None
        try:
            out: bytes = decoder.flush()
        except zlib.error as exc:
            raise PayloadError(f"cannot decode the body: {exc}") from exc
        if not decoder.eof:
            raise PayloadError("the compressed body ends before its end")
        return out

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timeout = self.read_timeout
        timer = None
        if timeout is not None:
            timer = loop.call_later(timeout, self._timed_out, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _timed_out(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            self.set_exception(TimeoutError("upstream read timed out"))

    async def read(self) -> bytes:
        """The whole body (decoded)."""
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    async def iter_any(self) -> AsyncIterator[bytes]:
        while data := await self.readany():
            yield data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        """The body's lines, each with its ``\\n`` (the last one may have none)."""
        buf = b""
        while data := await self.readany():
            buf += data
            if b"\n" not in data:
                if len(buf) > _MAX_LINE:
                    raise LineTooLong(f"a line over {_MAX_LINE} bytes")
                continue
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line + b"\n"
            if len(buf) > _MAX_LINE:
                raise LineTooLong(f"a line over {_MAX_LINE} bytes")
        if buf:
            yield buf


class Response:
    """A response whose head was read: ``status``, ``headers`` (case-insensitive),
    ``content`` (the ``Body``). ``release`` gives the connection back to the pool when
    the body was read to its end (closes it otherwise); ``close`` always closes it."""

    __slots__ = ("_conn", "content", "content_length", "headers", "reason", "status")

    def __init__(
        self,
        conn: _Connection,
        status: int,
        headers: CIMultiDictProxy[str],
        content: Body,
    ) -> None:
        self._conn: _Connection | None = conn
        self.status = status
        self.headers = headers
        self.content = content
        self.reason = ""
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None

    def release(self) -> None:
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        conn.done(self)

    def close(self) -> None:
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        conn.close()

    async def read(self) -> bytes:
        """The whole body, then the connection released."""
        try:
            data = await self.content.read()
        except BaseException:
            self.close()
            raise
        self.release()
        return data

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.release()
        else:
            self.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection: writes a request, parses its response into a
    ``Response`` (handed over at the head, or at the end for ``whole`` requests that
    fit ``cap``) and its ``Body``."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self.streaming = True
        self._reading_paused = False
        self._busy = False
        self._got_bytes = False
        self._complete = False
        self._keep_alive = False
        self._whole = False
        self._cap = 0
        self._raw: list[tuple[str, str]] = []
        self._status = 0
        self._head: asyncio.Future[Response] | None = None
        self._response: Response | None = None
        self._body: Body | None = None

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if not self._busy:  # bytes nobody asked for: the connection is not HTTP any more
            self.close()
            return
        self._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ProtocolError("the upstream switched protocols"))
        except httptools.HttpParserError as exc:
            if self._response is None:
                self._fail(ProtocolError(f"cannot parse the upstream's answer: {exc}"))
            else:  # past the head: the body cannot be read to its end
                self._fail(PayloadError(f"cannot parse the upstream's body: {exc}"))

    def eof_received(self) -> bool | None:
        return None  # close the transport; ``connection_lost`` follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._lost(self)
        if not self._busy:
            return
        if self._response is not None:  # the head was read
            if not self._complete:
                if not self._has_length():
                    self.on_message_complete()  # a body read to the connection's close
                else:
                    self._fail(PayloadError("the upstream's body was cut"))
        elif not self._got_bytes and self.reused:
            self._fail(_Stale())
        else:
            self._fail(ServerDisconnected("the upstream closed the connection"))

    def pause_writing(self) -> None:  # a request body is one write: nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # --- httptools callbacks ---

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        self._status = self.parser.get_status_code()
        if 100 <= self._status < 200:  # an interim answer: the final one follows
            self._raw = []
            return
        headers = _headers(self._raw)
        decoder: Any = None
        encoding = headers.get("Content-Encoding")
        if encoding is not None:
            encoding = encoding.strip().lower()
            if encoding == "gzip" or encoding == "x-gzip":
                decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
            elif encoding == "deflate":
                decoder = _Deflate()
        body = self._body = Body(self, decoder)
        resp = self._response = Response(self, self._status, headers, body)
        if not self._whole or (resp.content_length or 0) > self._cap:
            # a body said to be over the bound is not waited for (nor, likely, read)
            self._whole = False
            self.streaming = True
            self._hand_over()

    def on_body(self, data: bytes) -> None:
        body = self._body
        if body is None:
            return
        body.feed(data)
        if self._whole and body._size > self._cap:
            self._whole = False  # too big to wait for: the reader reads it as a stream
            self.streaming = True
            self._hand_over()

    def on_message_complete(self) -> None:
        if self._body is None:  # an interim (1xx) answer's end
            return
        self._complete = True
        # read here: once the message is done, the parser no longer says
        self._keep_alive = self.parser.should_keep_alive() and not self.closed
        self._body.feed_eof()
        if self._whole:
            self._hand_over()

    # --- the pool's side ---

    def _has_length(self) -> bool:
        headers = self._response.headers if self._response is not None else None
        if headers is None:
            return True
        return (
            "Content-Length" in headers or "chunked" in headers.get("Transfer-Encoding", "").lower()
        )

    def _hand_over(self) -> None:
        head = self._head
        if head is not None and not head.done():
            assert self._response is not None
            head.set_result(self._response)

    def _fail(self, exc: BaseException) -> None:
        """The exchange failed: before the head, its waiter gets ``exc``; after it, the
        body's next read does (a ``whole`` request's waiter gets the head first, so its
        reader knows the answer's request id). The connection is closed."""
        self._busy = False
        if self._response is not None:
            if not self._complete:
                assert self._body is not None
                self._body.set_exception(exc)
                self._hand_over()
        else:
            head = self._head
            if head is not None and not head.done():
                head.set_exception(exc)
        self.close()

    def send(self, data: bytes, *, whole: bool, cap: int) -> asyncio.Future[Response]:
        """Writes one request; the future is its response (at its head, or at its end
        for a ``whole`` one that fits ``cap`` bytes)."""
        assert self.transport is not None
        self._busy = True
        self._got_bytes = False
        self._complete = False
        self._keep_alive = False
        self._whole = whole
        self.streaming = not whole
        self._cap = cap
        self._raw = []
        self._body = None
        self._response = None
        head = self._head = self.loop.create_future()
        self.transport.write(data)
        return head

    def pause(self) -> None:
        if self.transport is not None and not self._reading_paused and not self.closed:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and self._reading_paused and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()

    def done(self, resp: Response) -> None:
        """The response's reader is done with it: back to the pool when it was read to
        its end and the connection may be kept, closed otherwise."""
        if self.closed:
            return
        if not self._keep_alive or self._response is not resp:
            self.close()
            return
        self._busy = False
        self._head = None
        self._response = None
        self._body = None
        if self._reading_paused:
            self.resume()
        self.pool._put(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self.pool._lost(self)


class _Deflate:
    """``Content-Encoding: deflate``: zlib's wrapped stream as the standard says, or the
    raw one that some servers send instead (told apart by the first byte, as aiohttp
    and browsers do)."""

    __slots__ = ("_obj",)

    def __init__(self) -> None:
        self._obj: Any = None

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if self._obj is None:
            wbits = zlib.MAX_WBITS if data[:1] and data[0] & 0x0F == 8 else -zlib.MAX_WBITS
            self._obj = zlib.decompressobj(wbits)
        out: bytes = self._obj.decompress(data, max_length)
        return out

    @property
    def unconsumed_tail(self) -> bytes:
        return self._obj.unconsumed_tail if self._obj is not None else b""

    @property
    def eof(self) -> bool:
        return self._obj is None or bool(self._obj.eof)

    def flush(self) -> bytes:
        return self._obj.flush() if self._obj is not None else b""


class Pool:
    """The connections to one origin: at most ``limit`` open, idle ones reused newest
    first, acquirers past the limit served in arrival order."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None,
        *,
        limit: int,
        connect_timeout: float,
    ) -> None:
        self.loop = loop
        self.host = host
        self.port = port
        self.ssl = ssl_context
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.open: set[_Connection] = set()
        self._idle: list[_Connection] = []
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    async def request(self, data: bytes, *, whole: bool = False, cap: int = 0) -> Response:
        """Sends ``data`` (a whole request) on a pooled connection and returns the
        response (at its head; at its end for ``whole`` when it fits ``cap`` bytes).
        A reused connection that closes before any byte of the response is replaced
        by a fresh one, once."""
        # an idle connection is taken without a coroutine of its own (the common case)
        conn = self._idle_one() or await self._acquire()
        try:
            return await conn.send(data, whole=whole, cap=cap)
        except _Stale:
            pass
        except BaseException:
            conn.close()
            raise
        conn = await self._acquire(fresh=True)
        try:
            return await conn.send(data, whole=whole, cap=cap)
        except _Stale as exc:  # a fresh connection is never stale; keep the type plain
            raise ServerDisconnected("the upstream closed the connection") from exc
        except BaseException:
            conn.close()
            raise

    async def _acquire(self, *, fresh: bool = False) -> _Connection:
        if self._closed:
            raise ConnectError("the client is closed")
        while True:
            if not fresh:
                idle = self._idle_one()
                if idle is not None:
                    return idle
            if len(self.open) < self.limit:
                return await self._connect()
            if fresh and self._idle:  # a slot is held by an idle connection: free it
                self._idle.pop(0).close()
                continue
            waiter = self.loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._wake()  # the turn given to this acquirer passes on
                raise

    def _idle_one(self) -> _Connection | None:
        """The most recently idle connection still open and young enough to reuse (the
        others are dropped), or None."""
        idle = self._idle
        if not idle:
            return None
        now = self.loop.time()
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if now - conn.idle_since > IDLE_S:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self) -> _Connection:
        conn = _Connection(self)
        self.open.add(conn)
        ssl_context = self.ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                await self.loop.create_connection(
                    lambda: conn,
                    self.host,
                    self.port,
                    ssl=ssl_context,
                    server_hostname=self.host if ssl_context is not None else None,
                )
        except TimeoutError as exc:
            self._lost(conn)
            conn.close()
            raise ConnectTimeout(f"cannot connect to {self.host}:{self.port} in time") from exc
        except OSError as exc:  # ssl.SSLError and socket.gaierror are OSErrors too
            self._lost(conn)
            conn.close()
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        except BaseException:
            self._lost(conn)
            conn.close()
            raise
        return conn

    def _put(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        conn.reused = True
        conn.idle_since = self.loop.time()
        self._idle.append(conn)
        self._wake()

    def _lost(self, conn: _Connection) -> None:
        if conn in self.open:
            self.open.discard(conn)
            if conn in self._idle:
                self._idle.remove(conn)
            self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        self._closed = True
        for conn in list(self.open):
            conn.close()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(ConnectError("the client is closed"))
        self._waiters.clear()


class _Target:
    """A URL's parts a request needs: its pool's key and the request's first lines."""

    __slots__ = ("key", "prefix")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        host = parts.hostname
        try:
            host.encode("ascii")
        except UnicodeEncodeError:
            host = host.encode("idna").decode("ascii")
        default = 443 if scheme == "https" else 80
        port = parts.port or default
        authority = f"[{host}]" if ":" in host else host
        if port != default:
            authority = f"{authority}:{port}"
        path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
        if parts.query:
            path += "?" + quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
        self.key = (scheme, host, port)
        self.prefix = f"POST {path} HTTP/1.1\r\nHost: {authority}\r\n".encode("ascii")


# what a header's name, or its value, may not hold
_BAD_NAME = re.compile("[\r\n:\0 ]").search
_BAD_VALUE = re.compile("[\r\n\0]").search


def _header_lines(headers: Mapping[str, str]) -> bytes:
    lines = []
    for name, value in headers.items():
        if not name or _BAD_NAME(name) or _BAD_VALUE(value):
            raise ValueError(f"a header that cannot be sent: {name!r}")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("utf-8")


class HttpClient:
    """POSTs to one upstream's URLs over one ``Pool`` per origin: the given headers on
    every request (with ``Accept``, ``Accept-Encoding`` and ``User-Agent`` unless they
    name their own), a request's own headers after them (replacing any of the same
    name)."""

    def __init__(
        self,
        headers: Mapping[str, str],
        *,
        max_connections: int,
        connect_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        sent = {"Accept": "*/*", "Accept-Encoding": ACCEPT_ENCODING, "User-Agent": USER_AGENT}
        lower = {name.lower() for name in headers}
        self._headers = {
            **dict(headers),
            **{k: v for k, v in sent.items() if k.lower() not in lower},
        }
        self._names = {name.lower() for name in self._headers}
        # request header names known not to be among the client's own (any case)
        self._apart: set[str] = set()
        self._head = _header_lines(self._headers)
        self._limit = max_connections
        self._connect_timeout = connect_timeout
        self._ssl = ssl_context
        self._pools: dict[tuple[str, str, int], Pool] = {}
        self._targets: dict[str, _Target] = {}
        self.closed = False

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            target = _Target(url)
            if len(self._targets) < 64:
                self._targets[url] = target
        return target

    def _pool(self, key: tuple[str, str, int]) -> Pool:
        pool = self._pools.get(key)
        if pool is None:
            if self.closed:
                raise ConnectError("the client is closed")
            context = None
            if key[0] == "https":
                if self._ssl is None:
                    self._ssl = ssl.create_default_context()
                context = self._ssl
            pool = Pool(
                asyncio.get_running_loop(),
                key[1],
                key[2],
                context,
                limit=self._limit,
                connect_timeout=self._connect_timeout,
            )
            self._pools[key] = pool
        return pool

    def pool(self, url: str) -> Pool:
        """The pool of ``url``'s origin."""
        return self._pool(self._target(url).key)

    def encode(self, url: str, data: bytes, headers: Mapping[str, str] | None) -> bytes:
        """The request's bytes: the request line, the headers, the body."""
        return self._encoded(self._target(url), data, headers)

    def _encoded(self, target: _Target, data: bytes, headers: Mapping[str, str] | None) -> bytes:
        if not headers:
            head = self._head
        elif headers.keys() <= self._apart:
            # none of the client's own headers is replaced (``_apart``: names seen so
            # before, the attempt's own ``X-Client-Request-Id`` every time)
            head = self._head + _header_lines(headers)
        elif self._names.isdisjoint(name.lower() for name in headers):
            if len(self._apart) < 64:
                self._apart.update(headers.keys())
            head = self._head + _header_lines(headers)
        else:
            merged = {k: v for k, v in self._headers.items()}
            for name, value in headers.items():
                for old in [k for k in merged if k.lower() == name.lower()]:
                    del merged[old]
                merged[name] = value
            head = _header_lines(merged)
        return b"%s%sContent-Length: %d\r\n\r\n%s" % (target.prefix, head, len(data), data)

    def post(
        self,
        url: str,
        data: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        whole: bool = False,
        cap: int = 0,
    ) -> Awaitable[Response]:
        """The response to POSTing ``data`` to ``url``: at its head, or (``whole``) at
        its end when the body is at most ``cap`` bytes as sent (at the point it passed
        ``cap`` otherwise, to be read as a stream). The pool's coroutine itself is
        returned (one coroutine fewer per request); a closed client or a bad URL
        raises here, when called."""
        target = self._target(url)
        request = self._encoded(target, data, headers)
        return self._pool(target.key).request(request, whole=whole, cap=cap)

    async def close(self) -> None:
        self.closed = True
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        await asyncio.sleep(0)  # the transports' close callbacks run
