"""Request limits the validator's structs cannot state, as config (``limits``) with sane
defaults and OpenAI-shaped errors.

- header line size and header count: ncap's front (``http.front``) checks them for the
  completion routes, aiohttp's parser for the others (a 400 before any handler runs,
  logged as one line: ``malformed.ProtocolLog`` for aiohttp's);
- the body size: ``body_at_hand`` and ``read_limited`` (413 ``request_too_large``), which
  read until the body's end (a body that arrives in several TCP segments is read whole);
  the front's ``Message.body_now`` and ``read_body`` for the requests it parsed;
- the body's arrival: ``body_deadline`` around the body read gives a client that sends the
  headers and then stalls ``body_timeout_s`` to send the whole body, then answer 408
  ``request_timeout`` and close the connection (the admin API and the dashboard's login
  form read their bodies under the same deadline);
- the message count: ``protocol.limits.check_message_count`` (400 on ``messages``),
  called by the gateway right after validation, before anything is admitted;
- a streamed answer's wall-clock duration: ``write_stream`` ends it with an SSE error
  event, which closes the upstream stream and settles it like a client disconnect;
- a streamed answer's client that stops reading: ``StallWatch`` drops the connection
  when a write has waited ``stream_write_timeout_s`` (a full socket buffer otherwise
  blocks it for good), and the stream is settled like a client disconnect.
``n`` is bounded by the policy (``max_candidates_absolute`` and each workload's
``max_candidates``) and JSON nesting by ``protocol.validate.MAX_DEPTH``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from aiohttp.client_exceptions import ClientPayloadError
from aiohttp.http_exceptions import HttpProcessingError

from ncap.config import Limits
from ncap.errors import BodyTooLarge, InvalidRequest, RequestTimeout

__all__ = [
    "StallWatch",
    "body_at_hand",
    "body_deadline",
    "handler_limits",
    "read_limited",
    "too_large",
    "write_stream",
]

_T = TypeVar("_T")
# what a body read raises when the client's body is cut short or malformed
_CUT_SHORT = (ClientPayloadError, HttpProcessingError, ConnectionError)


def _incomplete() -> InvalidRequest:
    return InvalidRequest("The request body was incomplete or malformed.")


def handler_limits(limits: Limits) -> dict[str, Any]:
    """aiohttp request-handler arguments for the header limits."""
    return {
        "max_line_size": limits.max_header_bytes,
        "max_field_size": limits.max_header_bytes,
        "max_headers": limits.max_headers,
    }


def body_at_hand(request: web.Request, limit: int) -> bytes | None:
    """The whole body when it came with the head (the usual case), taken as it is
    without awaiting reads that cannot wait; None while more of it is to come. A body
    over ``limit`` or cut short is the client's error (413, 400)."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    content = request.content
    if not content.is_eof():
        return None
    try:
        raw = content.read_nowait(-1)
    except _CUT_SHORT:
        raise _incomplete() from None
    if len(raw) > limit:
        raise too_large(limit)
    return raw


def too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"The request body is larger than {limit} bytes.")


async def read_limited(request: web.Request, limit: int) -> bytes | None:
    """The body up to its end, or None as soon as it is longer than ``limit``.

    ``StreamReader.read(n)`` returns what has arrived so far, not ``n`` bytes: one call
    would cut a body that comes in several segments. A body cut short (a bad chunk, the
    client's side closed before its end) is the client's error."""
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            part = await request.content.read(limit + 1 - size)
        except _CUT_SHORT:
            raise _incomplete() from None
        if not part:
            return b"".join(parts)
        size += len(part)
        if size > limit:
            return None
        parts.append(part)


@asynccontextmanager
async def body_deadline(timeout_s: float) -> AsyncIterator[None]:
    """The body read inside must finish within ``timeout_s``, else 408 ``request_timeout``
    (the route guard then closes the connection)."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        raise RequestTimeout(
            f"The request body did not arrive within {_seconds(timeout_s)} seconds."
        ) from None


class StallWatch:
    """Drops the connection of a streamed answer whose client has not taken a write for
    ``timeout_s``: a client that stops reading fills the socket buffers, and the write
    then blocks for good (holding the upstream stream and the attempt's reservation).

    One timer per stream, checked every half ``timeout_s`` (a stall is caught after one
    to one and a half times it), so a write costs two attribute stores, not a timer.
    Aborting the transport wakes the blocked write; the next one raises
    ``ConnectionResetError``, which the writer treats as the client's disconnect."""

    def __init__(self, request: web.Request, timeout_s: float) -> None:
        self._transport = request.transport
        self._timeout = timeout_s
        self._loop = asyncio.get_running_loop()
        self.writing_since: float | None = None
        self.stalled = False
        self._handle = self._loop.call_later(timeout_s / 2, self._check)

    def now(self) -> float:
        return self._loop.time()

    async def write(self, write: Awaitable[_T]) -> _T:
        self.writing_since = self._loop.time()
        try:
            return await write
        finally:
            self.writing_since = None

    def _check(self) -> None:
        since = self.writing_since
        if since is not None and self._loop.time() - since >= self._timeout:
            self.stalled = True
            if self._transport is not None:
                self._transport.abort()
            return
        self._handle = self._loop.call_later(self._timeout / 2, self._check)

    def close(self) -> None:
        self._handle.cancel()


def _seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


_TIMEOUT_EVENT = (
    b"data: "
    + msgspec.json.encode(
        {
            "error": {
                "message": "The stream exceeded this gateway's maximum duration.",
                "type": "invalid_request_error",
                "param": None,
                "code": "stream_timeout",
            }
        }
    )
    + b"\n\n"
)


async def write_stream(
    request: web.Request,
    response: web.StreamResponse,
    stream: AsyncIterator[bytes],
    limits: Limits,
    first_written: Callable[[], None],
) -> None:
    """The stream's chunks written to the client as they come, one write each, in one
    loop (no generator between the stream and the writes: this runs for every upstream
    read). The response is prepared once the first chunk came (or the stream ended).

    Two timers for the whole stream, none per chunk: ``StallWatch`` drops a client that
    has not taken a write for ``stream_write_timeout_s``; at ``max_stream_s`` a wait for
    the next chunk is cancelled (as a timeout would cancel it), and a deadline that
    passes while the client is being written to ends the stream before the next wait;
    either way one error event goes out last. The caller closes ``stream`` (which
    cancels the upstream and settles it)."""
    loop = asyncio.get_running_loop()
    watch = StallWatch(request, limits.stream_write_timeout_s)
    deadline = _Deadline(watch, limits.max_stream_s)
    next_chunk = stream.__anext__
    try:
        chunk = await deadline.first(next_chunk)
        await watch.write(response.prepare(request))
        if chunk is None:
            return
        await watch.write(response.write(chunk))
        first_written()
        if chunk is _TIMEOUT_EVENT:
            return
        while not deadline.passed:
            try:
                chunk = await next_chunk()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not deadline.expired():
                    raise  # not (only) the deadline's cancellation
                break
            watch.writing_since = loop.time()  # StallWatch.write, inlined
            await response.write(chunk)
            watch.writing_since = None
        await watch.write(response.write(_TIMEOUT_EVENT))
    finally:
        deadline.close()
        watch.close()


class _Deadline:
    """``max_s`` from now: ``passed`` set, and a wait for the next chunk (the task not
    writing: ``StallWatch.writing_since`` unset) cancelled."""

    __slots__ = ("_handle", "_task", "_watch", "cancelled", "passed")

    def __init__(self, watch: StallWatch, max_s: float) -> None:
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._watch = watch
        self.passed = self.cancelled = False
        self._handle = loop.call_at(loop.time() + max_s, self._expire)

    def _expire(self) -> None:
        self.passed = True
        if self._watch.writing_since is None and self._task is not None:
            self.cancelled = True
            self._task.cancel()

    def expired(self) -> bool:
        """Whether the cancellation just caught was the deadline's alone (then taken
        back: the stream ends with its error event instead)."""
        return self.cancelled and self._task is not None and self._task.uncancel() == 0

    async def first(self, next_chunk: Callable[[], Awaitable[bytes]]) -> bytes | None:
        """The first chunk, None when the stream ended without one; the error event
        when the deadline passed first."""
        try:
            return await next_chunk()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            if not self.expired():
                raise
            return _TIMEOUT_EVENT

    def close(self) -> None:
        self._handle.cancel()
