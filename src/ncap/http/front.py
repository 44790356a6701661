"""ncap's HTTP/1.1 front: the completion routes parsed by httptools and answered here,
every other request handed to aiohttp's server.

A completion request crosses this module twice (its head and body in, its answer out),
and aiohttp's server did that with a request object, a payload stream, a response
object, a writer and a task per connection loop: about 180,000 instructions a request,
more than the whole accounting (docs/decisions/http-front.md). Here a connection is one
``asyncio.Protocol`` with httptools' ``HttpRequestParser`` (llhttp, the parser aiohttp
and uvicorn use; no HTTP parsing is written here), a request is a ``Message`` and an
answer is written with one ``transport.write``.

What it does for the completion routes (``POST /v1/chat/completions`` and
``POST /v1/completions``), as aiohttp's server did:
- the limits: a request line or header name or value over ``max_header_bytes``, more
  than ``max_headers`` headers, a repeated singleton header (``Content-Type``, ``Host``,
  ...) or anything llhttp refuses is a 400 in OpenAI's envelope and one log line
  (the peer and the parser's error class, never the client's bytes), and the
  connection closes; the body's size and arrival are checked by the handler
  (``Message.body_now`` and ``read_body``: 413, 408, a body cut short 400);
- keep-alive (HTTP/1.1 by default, HTTP/1.0 on request), ``Connection: close``,
  idle connections closed after ``KEEPALIVE_S``, pipelined requests answered in
  order, ``Expect: 100-continue``;
- answers whole (``Content-Length``) or streamed (chunked; HTTP/1.0 until close),
  a write waiting while the socket's buffer is full (``pause_writing``), a write to a
  closed connection raising ``ConnectionResetError``, header values with control
  characters refused (as aiohttp refuses them), the same headers aiohttp wrote
  (``Date``, ``Server``, ``Content-Type`` default);
- graceful shutdown: idle connections closed, requests in flight given the runner's
  shutdown timeout, then cancelled.

Any other request goes to aiohttp, which owns the rest of the connection's life: once
the answers before it are out, the message and every later one on the connection are
handed to a fresh aiohttp ``RequestHandler``, over a transport that writes to this
connection's socket: what was parsed so far re-serialized (each head as sent, each body
as llhttp read it, chunked again if it came chunked: httptools does not say where in a
read a message began), then, from the first read that ends on a message's end, the
socket's bytes as they come (aiohttp parses them itself). So the other routes (models,
health, metrics, admin API, dashboard, OpenAPI) keep aiohttp's router, limits and
responses, with keep-alive; a completion request on such a connection is served by
aiohttp's route for it (the same handler, ``http.app.Completions``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import httptools
import msgspec
from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time  # aiohttp's, formatted once a second
from aiohttp.http import SERVER_SOFTWARE
from multidict import CIMultiDict, CIMultiDictProxy

from ncap.config import Limits
from ncap.errors import InvalidRequest
from ncap.http.limits import too_large
from ncap.logsafe import log_internal_error

if TYPE_CHECKING:
    from aiohttp.web_protocol import RequestHandler

__all__ = ["FrontRunner", "Message", "run"]

log = logging.getLogger("ncap.http.protocol")

KEEPALIVE_S = 75.0  # an idle keep-alive connection is closed after this (aiohttp's default)
_SWEEP_S = 5.0  # how often idle connections are looked for
_QUEUED_BODY = 1 << 20  # a pipelined request's body kept before reading pauses
_SINGLETONS = frozenset(
    {
        b"content-length",
        b"content-location",
        b"content-range",
        b"content-type",
        b"etag",
        b"host",
        b"max-forwards",
        b"server",
        b"transfer-encoding",
        b"user-agent",
    }
)
# the bytes an answer's header line may hold besides its ending CRLF: aiohttp's rule
# refuses every control character but the tab (and so a CR or LF inside a value)
_HEADER_SAFE = b"\t" + bytes(range(0x20, 0x7F)) + bytes(range(0x80, 0x100))
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


class _HeadRefused(Exception):
    """A head the front refuses before any handler sees it (a 400)."""


_REASONS = {status.value: status.phrase for status in HTTPStatus}


class Message:
    """One request on a front connection: its head as parsed, its body as it arrives,
    and the answer's writers (the handler's whole view of HTTP)."""

    __slots__ = (
        "_conn",
        "_discard",
        "_limit",
        "_parts",
        "_size",
        "_waiter",
        "complete",
        "error",
        "expect_continue",
        "headers",
        "keep_alive",
        "kind",
        "method",
        "path",
        "raw_headers",
        "url",
        "version",
    )

    def __init__(self, conn: FrontConnection, url: bytes, raw_headers: list[tuple[bytes, bytes]]):
        self._conn = conn
        self.url = url
        self.raw_headers = raw_headers
        self.path = ""
        self.method = ""
        self.version = "1.1"
        self.keep_alive = True
        self.kind: str | None = None
        self.headers: CIMultiDictProxy[str] = _NO_HEADERS
        self._parts: list[bytes] = []
        self._size = 0
        self._limit = 0
        self._waiter: asyncio.Future[None] | None = None
        self.complete = False
        self._discard = False  # answered before its body ended: the rest is read and dropped
        self.error: InvalidRequest | None = None
        self.expect_continue = False

    @property
    def chunked(self) -> bool:
        """Its body comes chunked (llhttp refuses any other transfer coding)."""
        return any(n.lower() == b"transfer-encoding" for n, _ in self.raw_headers)

    @property
    def transport(self) -> asyncio.Transport | None:
        """The connection's transport (a stalled stream's watch aborts it)."""
        return self._conn._transport

    # -- the body, as the handler reads it

    def body_now(self, limit: int) -> bytes | None:
        """The whole body when it has arrived (the usual case), None while more of it is
        to come. A body over ``limit`` or cut short is the client's error (413, 400)."""
        self._limit = limit
        if self.error is not None:
            raise self.error
        if self._size > limit:
            raise too_large(limit)
        if not self.complete:
            length = self.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limit:
                raise too_large(limit)
            return None
        parts = self._parts
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read_body(self, limit: int) -> bytes:
        """The whole body once it has arrived (the caller bounds the wait)."""
        while True:
            raw = self.body_now(limit)
            if raw is not None:
                return raw
            if self.expect_continue:
                self.expect_continue = False
                self._conn.write(_CONTINUE)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _add(self, part: bytes) -> None:
        self._size += len(part)
        if self._discard:
            if self._size > self._limit:
                self._conn.close()  # not worth reading to its end
            return
        if self._limit and self._size > self._limit:
            self._parts.clear()  # the answer is a 413: nothing more is kept
            self._wake()
            return
        self._parts.append(part)

    def _cut(self) -> None:
        """The connection ended before the body did."""
        if not self.complete and self.error is None:
            self.error = InvalidRequest("The request body was incomplete or malformed.")
            self._wake()

    # -- the answer

    def answer(
        self,
        status: int,
        headers: Mapping[str, str],
        body: bytes,
        *,
        close: bool = False,
    ) -> None:
        """A whole answer, written at once."""
        conn = self._conn
        keep = self.keep_alive and not close and not conn.closing and not self._unsent()
        extra = f"Content-Length: {len(body)}\r\n"
        if body and "Content-Type" not in headers and "content-type" not in headers:
            extra += "Content-Type: application/octet-stream\r\n"
        head = _head(status, headers, extra + self._connection(keep))
        conn.write(head + body if body else head)
        conn.answered(self, keep)

    def _unsent(self) -> bool:
        """Answered before a body the client holds back for ``100 Continue`` (never
        sent): whether it will send that body is its choice, so the connection ends."""
        return self.expect_continue and not self.complete

    def _connection(self, keep: bool) -> str:
        if keep:
            return "Connection: keep-alive\r\n" if self.version == "1.0" else ""
        return "Connection: close\r\n" if self.version == "1.1" else ""

    def stream(self, status: int, headers: Mapping[str, str]) -> StreamAnswer:
        """A streamed answer: its head goes out with the first write (``prepare``)."""
        return StreamAnswer(self, status, headers)


_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


def _head(status: int, headers: Mapping[str, str], extra: str) -> bytes:
    lines = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    # what is left once the safe bytes are deleted: each line's CRLF, and any control
    # character of a name or value (one C pass, where a regular expression's character
    # class costs tens of instructions a character)
    if len(lines.encode().translate(None, _HEADER_SAFE)) != 2 * len(headers):
        raise ValueError("A control character in an answer's header.")
    return (
        f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n{lines}{extra}"
        f"Date: {rfc822_formatted_time()}\r\nServer: {SERVER_SOFTWARE}\r\n\r\n"
    ).encode()


class StreamAnswer:
    """A streamed answer, with the methods of aiohttp's ``StreamResponse`` the stream
    writer calls (``prepare``, ``write``, ``write_eof``): chunked on HTTP/1.1, the
    body until the connection closes on HTTP/1.0."""

    __slots__ = ("_chunked", "_conn", "_headers", "_keep", "_message", "_status", "prepared")

    def __init__(self, message: Message, status: int, headers: Mapping[str, str]) -> None:
        self._message = message
        self._conn = message._conn
        self._status = status
        self._headers = headers
        self._chunked = message.version == "1.1"
        self._keep = False
        self.prepared = False

    async def prepare(self, _request: Any = None) -> None:
        if self.prepared:
            return
        self.prepared = True
        message = self._message
        keep = message.keep_alive and self._chunked and not self._conn.closing
        keep = keep and not message._unsent()
        extra = "Transfer-Encoding: chunked\r\n" if self._chunked else ""
        if "Content-Type" not in self._headers and "content-type" not in self._headers:
            extra += "Content-Type: application/octet-stream\r\n"
        self._keep = keep
        await self._conn.send(_head(self._status, self._headers, extra + message._connection(keep)))

    async def write(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self._chunked:
            chunk = b"%x\r\n%b\r\n" % (len(chunk), chunk)
        await self._conn.send(chunk)

    async def write_eof(self) -> None:
        if not self.prepared:
            await self.prepare()
        if self._chunked:
            self._conn.write(_LAST_CHUNK)
        self._conn.answered(self._message, self._keep)


Serve = Callable[[Message], Any]  # a coroutine function answering one completion message


class FrontServer:
    """The protocol factory sites listen with: one ``FrontConnection`` per socket."""

    def __init__(
        self,
        aiohttp_server: web.Server,
        serve: dict[str, Serve],
        limits: Limits,
    ) -> None:
        self.aiohttp = aiohttp_server
        self.serve = serve
        self.limits = limits
        self.keepalive_s = KEEPALIVE_S
        self.connections: set[FrontConnection] = set()
        self.closing = False
        self._sweep: asyncio.TimerHandle | None = None
        # the most bytes a head may take before it is refused (memory, not the limits)
        self.head_bound = limits.max_headers * 2 * (limits.max_header_bytes + 4) + 2 * (
            limits.max_header_bytes + 16
        )

    def __call__(self) -> FrontConnection:
        return FrontConnection(self)

    def serve_kind(self, method: str, path: str) -> str | None:
        """The path of the front's own handler for a request, None for aiohttp's."""
        return path if method == "POST" and path in self.serve else None

    def opened(self, conn: FrontConnection) -> None:
        self.connections.add(conn)
        if self._sweep is None:
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_later(_SWEEP_S, self._close_idle)

    def closed(self, conn: FrontConnection) -> None:
        self.connections.discard(conn)

    def _close_idle(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for conn in list(self.connections):
            if conn.idle_since is not None and now - conn.idle_since >= self.keepalive_s:
                conn.close()
        self._sweep = loop.call_later(_SWEEP_S, self._close_idle) if self.connections else None

    async def shutdown(self, timeout: float) -> None:
        """Idle connections closed now; those answering get ``timeout`` seconds to end
        (each closes after its answer), then their handlers are cancelled."""
        self.closing = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self.connections):
            if conn.task is None and not conn.handed_over:  # aiohttp's: its own shutdown
                conn.close()
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for conn in list(self.connections):
            if not conn.handed_over:
                conn.close()


class FrontConnection(asyncio.Protocol):
    """One client connection (``FrontServer``'s docstring: what it does)."""

    def __init__(self, server: FrontServer) -> None:
        self._server = server
        self._limits = server.limits
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._raw: list[tuple[bytes, bytes]] = []
        self._head_size = 0
        self._in_head = False
        self._incoming: Message | None = None  # the message being parsed
        self._queue: deque[Message] = deque()  # complete heads waiting for their turn
        self._current: Message | None = None  # the message being answered
        self._refused: str | None = None  # a 400 to answer once the current one is done
        self._paused = False  # the socket's buffer is full: writes wait
        self._drain: asyncio.Future[None] | None = None
        self._handler: RequestHandler | None = None
        self._done_reading = False
        self._relaying = False  # aiohttp reads the socket's bytes as they come
        self._reading_paused = False
        self._last: Message | None = None  # the last message whose head was parsed
        self.task: asyncio.Task[None] | None = None  # the handler of ``_serving``
        self._serving: Message | None = None
        self.delegated = False
        self.idle_since: float | None = None
        self._lost = False
        self._eof = False  # the client half-closed

    @property
    def handed_over(self) -> bool:
        """aiohttp owns this connection (its shutdown waits for its answers)."""
        return self._handler is not None

    @property
    def closing(self) -> bool:
        """The server is shutting down: this connection closes after its answer."""
        return self._server.closing

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self.idle_since = self._loop.time()
        self._server.opened(self)

    def data_received(self, data: bytes) -> None:
        if self._relaying:
            self._handler.data_received(data)  # type: ignore[union-attr]
            return
        if self._done_reading:
            return  # being refused or upgraded: nothing more is read
        if self._in_head or self._incoming is None:
            self._head_size += len(data)
            if self._head_size > self._server.head_bound:
                self._refuse("HeadTooLarge")
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgrade()
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            self._refuse(str(cause) if isinstance(cause, _HeadRefused) else type(exc).__name__)
        else:
            if self._current is None and self._queue:
                self._next()
            self._relay_at_boundary()

    def _relay_at_boundary(self) -> None:
        """Once aiohttp has the connection and every byte read so far belongs to a
        message it was given, the bytes that follow go to it as they come."""
        if self._handler is not None and not self._in_head and self._incoming is None:
            self._relaying = True

    def eof_received(self) -> bool:
        if self._relaying:
            return bool(self._handler.eof_received())  # type: ignore[union-attr]
        if self._handler is not None:
            if self._incoming is not None:  # the body aiohttp waits for will not come
                self.close()
                return False
            return True  # half-closed: aiohttp's answer can still be written
        incoming = self._incoming
        if incoming is not None:
            incoming._cut()
        if self._current is not None or self._queue:
            self._eof = True  # closed after the answer
            return True  # half-closed: the answer can still be written
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._server.closed(self)
        handler = self._handler
        if handler is not None:
            handler.connection_lost(exc)
        for message in (self._incoming, self._current, *self._queue):
            if message is not None:
                message._cut()
        self._wake_writer()

    def pause_writing(self) -> None:
        self._paused = True
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._paused = False
        if self._handler is not None:
            self._handler.resume_writing()
        self._wake_writer()

    def _wake_writer(self) -> None:
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self._in_head = True
        self._url = b""
        self._raw = []

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self._limits.max_header_bytes:
            raise _HeadRefused("LineTooLong")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw.append((name, value))  # checked once the head is whole (``_checked``)

    def _checked(self, raw: list[tuple[bytes, bytes]]) -> CIMultiDictProxy[str]:
        """A completion request's headers, once its head passed the limits aiohttp's
        parser kept (a delegated request's head is aiohttp's to check): at most
        ``max_headers``, no name or value over ``max_header_bytes`` (looked at only
        when the bytes read for the head are more than that), no singleton twice."""
        limits = self._limits
        if len(raw) > limits.max_headers:
            raise _HeadRefused("TooManyHeaders")
        limit = limits.max_header_bytes
        if self._head_size > limit:
            for name, value in raw:
                if len(name) > limit or len(value) > limit:
                    raise _HeadRefused("LineTooLong")
        lowered = {name.lower() for name, _ in raw}
        if len(lowered) < len(raw):  # a name twice: allowed unless it is a singleton
            seen: set[bytes] = set()
            for name, _ in raw:
                name = name.lower()
                if name in seen and name in _SINGLETONS:
                    raise _HeadRefused("DuplicateHeader")
                seen.add(name)
        return CIMultiDictProxy(
            CIMultiDict(
                [(k.decode("latin-1"), v.decode("utf-8", "surrogateescape")) for k, v in raw]
            )
        )

    def on_headers_complete(self) -> None:
        parser = self._parser
        self._in_head = False
        message = Message(self, self._url, self._raw)
        message.method = method = parser.get_method().decode()
        message.version = parser.get_http_version()
        message.keep_alive = parser.should_keep_alive()
        url = self._url
        path = url.partition(b"?")[0].decode("utf-8", "surrogateescape")
        message.path = path
        handler = self._handler
        if handler is not None:  # aiohttp owns the connection: the head goes on as sent
            self._incoming = self._last = message
            handler.data_received(_request_bytes(message))
            return
        message.kind = self._server.serve_kind(method, path) if not self.delegated else None
        if message.kind is None:
            self.delegated = True  # aiohttp answers it, and owns the connection after it
        else:
            message._limit = self._limits.max_body_bytes
            message.headers = headers = self._checked(self._raw)
            expect = headers.get("Expect")
            message.expect_continue = expect is not None and expect.lower() == "100-continue"
        self._head_size = 0
        self._incoming = message
        self._last = message
        self._queue.append(message)
        self.idle_since = None

    def on_body(self, body: bytes) -> None:
        message = self._incoming
        if message is None:
            return
        handler = self._handler
        if handler is not None:  # aiohttp reads it as it comes
            handler.data_received(_frame(body) if message.chunked else body)
            return
        message._add(body)
        if message is not self._current and message._size > _QUEUED_BODY:
            self._pause_reading()  # read again when its turn comes

    def on_message_complete(self) -> None:
        message = self._incoming
        if message is None:
            return
        self._incoming = None
        message.complete = True
        message._wake()
        if message._discard and self._current is None and not self._queue:
            self.idle_since = self._loop.time()
        handler = self._handler
        if handler is not None and message.chunked:
            handler.data_received(_LAST_CHUNK)

    # -- serving

    def _next(self) -> None:
        """The next message's turn (one at a time: answers go out in order)."""
        message = self._queue.popleft()
        self._current = message
        if self._reading_paused:
            self._reading_paused = False
            if self._transport is not None:
                self._transport.resume_reading()
        if message.kind is None:
            self._delegate(message)
            return
        self._serving = message
        self.task = self._loop.create_task(self._serve(message))

    async def _serve(self, message: Message) -> None:
        try:
            await self._server.serve[message.kind](message)  # type: ignore[index]
        except (ConnectionError, OSError):
            pass  # the client went away while its answer was written
        except Exception as exc:  # the handler answers its errors: this is a bug
            log_internal_error(log, f"internal error on {message.method} {message.path}", exc)
        finally:
            if self._serving is message:  # not the next message's task already
                self._serving = None
                self.task = None
            if self._current is message:  # the handler ended without a whole answer
                self._current = None
                self.close()

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def answered(self, message: Message, keep: bool) -> None:
        """``message``'s answer is all written: the next message's turn, or the end."""
        if self._current is not message:
            return
        self._current = None
        if not keep or self.closing or self._lost or self._eof:
            self.close()
            return
        if not message.complete:  # the client is still sending its body: read, then drop
            message._discard = True
            message._parts = []
            self.idle_since = self._loop.time()  # a body that stalls is closed as idle
            return
        if self._refused is not None:
            self._write_refusal()
            return
        if self._queue:
            self._next()
        elif self._incoming is None:
            self.idle_since = self._loop.time()

    def write(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        transport.write(data)

    async def send(self, data: bytes) -> None:
        """``data`` written; waits while the socket's buffer is full."""
        self.write(data)
        if self._paused:
            self._drain = self._loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None
            if self._lost:
                raise ConnectionResetError("Connection lost")

    def close(self) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.close()

    # -- refusals, upgrades and aiohttp

    def _refuse(self, what: str) -> None:
        """A head or framing the parser refused: a 400 after the answer in progress."""
        peer = self._transport.get_extra_info("peername") if self._transport else None
        log.warning("Error handling request from %s: %s (400)", _peer(peer), what)
        self._refused = what
        self._done_reading = True
        self._incoming = None
        if self._handler is not None:  # aiohttp is reading that message: it ends here
            self.close()
        elif self._current is None:
            self._write_refusal()

    def _write_refusal(self) -> None:
        body = _REFUSAL
        extra = f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        head = _head(400, {"Content-Type": "application/json"}, extra)
        with contextlib.suppress(ConnectionResetError):
            self.write(head + body)
        self.close()

    def _upgrade(self) -> None:
        """llhttp stopped at a protocol upgrade (``Upgrade`` with ``Connection:
        upgrade``). ncap speaks only HTTP/1.1: a request without a body is answered as
        if the upgrade were not asked for (as aiohttp does for protocols it lacks), and
        the connection closes after it; one with a body (llhttp does not read it) is a
        400."""
        self._done_reading = True  # what follows is the other protocol's
        message = self._last
        if message is None or not message.complete or _has_body(message.raw_headers):
            self._queue.clear()
            self._refuse("UnsupportedUpgrade")
            return
        message.keep_alive = False
        if self._current is None and self._queue:
            self._next()

    def _delegate(self, message: Message) -> None:
        """``message`` and every one after it handed to a fresh aiohttp handler, which
        owns the connection from now on: what arrived so far now, the rest as it
        arrives (``on_headers_complete``, ``on_body``, ``on_message_complete``)."""
        handler = self._server.aiohttp()
        self._handler = handler
        self._current = None
        pending = [message, *self._queue]
        self._queue.clear()
        handler.connection_made(_Relay(self._transport, self))  # type: ignore[arg-type]
        if self._paused:
            handler.pause_writing()
        for waiting in pending:
            if waiting._size > sum(len(p) for p in waiting._parts):  # a body over the limit
                self.close()  # was not kept whole: aiohttp could not read it
                return
            handler.data_received(_request_bytes(waiting))
        if self._reading_paused:
            self._reading_paused = False
            if self._transport is not None:
                self._transport.resume_reading()
        self._relay_at_boundary()


_REFUSAL = msgspec.json.encode(
    {
        "error": {
            "message": "The request could not be read as HTTP/1.1.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_request",
        }
    }
)


def _peer(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer) if peer else "unknown"


def _frame(part: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(part), part)


def _has_body(raw: list[tuple[bytes, bytes]]) -> bool:
    for name, value in raw:
        lowered = name.lower()
        if lowered == b"transfer-encoding" or (
            lowered == b"content-length" and value.strip() != b"0"
        ):
            return True
    return False


def _request_bytes(message: Message) -> bytes:
    """The message as aiohttp reads it: its head as sent (``Connection: close`` if it
    is not kept alive), and the body that arrived so far (chunked again if it came
    chunked: llhttp hands over a chunk's data only)."""
    version = message.version.encode()
    lines = [b"%s %s HTTP/%s\r\n" % (message.method.encode(), message.url, version)]
    if message.keep_alive:
        lines += [b"%s: %s\r\n" % (n, v) for n, v in message.raw_headers]
        lines.append(b"\r\n")
    else:  # closed after its answer (as asked, or an upgrade the front does not take)
        lines += [
            b"%s: %s\r\n" % (n, v) for n, v in message.raw_headers if n.lower() != b"connection"
        ]
        lines.append(b"Connection: close\r\n\r\n")
    chunked = message.chunked
    lines += [_frame(part) if chunked else part for part in message._parts]
    if chunked and message.complete:
        lines.append(_LAST_CHUNK)
    message._parts = []
    return b"".join(lines)


class _Relay(asyncio.Transport):
    """The transport an aiohttp handler writes to: the front connection's socket."""

    def __init__(self, transport: asyncio.Transport, conn: FrontConnection) -> None:
        super().__init__()
        self._transport = transport
        self._conn = conn

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._transport.write(data)

    def writelines(self, list_of_data: Any) -> None:
        self._transport.writelines(list_of_data)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._transport.close()

    def abort(self) -> None:
        self._transport.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def write_eof(self) -> None:
        self._transport.write_eof()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        pass  # the front connection stays the socket's protocol and forwards to aiohttp

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._conn


class FrontRunner(web.AppRunner):
    """aiohttp's ``AppRunner`` whose sites listen with the front: the completion
    routes ``serve_front`` gives are answered by ``FrontServer``, the rest by aiohttp.
    An app without them (``serve_front`` None) is served by aiohttp alone."""

    __slots__ = ("_front", "_serve_front")

    def __init__(
        self,
        app: web.Application,
        serve_front: Callable[[], tuple[dict[str, Serve], Limits]] | None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self._serve_front = serve_front
        self._front: FrontServer | None = None

    async def setup(self) -> None:
        await super().setup()
        if self._serve_front is not None:
            serve, limits = self._serve_front()
            server = super().server
            assert server is not None
            self._front = FrontServer(server, serve, limits)

    @property
    def server(self) -> Any:  # the sites' protocol factory
        return self._front if self._front is not None else super().server

    async def shutdown(self) -> None:
        if self._front is not None:
            await self._front.shutdown(self._shutdown_timeout)
        await super().shutdown()


def run(
    app: web.Application,
    serve_front: Callable[[], tuple[dict[str, Serve], Limits]] | None,
    *,
    host: str,
    port: int,
    reuse_port: bool | None = None,
    on_listening: Callable[[], None] | None = None,
    shutdown_timeout: float = 60.0,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, as ``aiohttp.web.run_app`` does, with the
    front in front of it."""

    async def main() -> None:
        runner = FrontRunner(
            app,
            serve_front,
            handle_signals=True,
            access_log=None,
            shutdown_timeout=shutdown_timeout,
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port, reuse_port=reuse_port).start()
            if on_listening is not None:
                on_listening()
            await asyncio.Event().wait()  # until SIGINT or SIGTERM (``GracefulExit``)
        finally:
            await runner.cleanup()

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    task = loop.create_task(main())
    try:
        loop.run_until_complete(task)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        _cancel_all(loop)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
        asyncio.set_event_loop(None)
        loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
