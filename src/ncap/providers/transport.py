"""The upstream HTTP transport every HTTP provider shares: one pooled HTTP/1.1 client
(``ncap.providers.http1``, asyncio.Protocol and httptools: docs/decisions/
upstream-http-client.md), per-attempt timeouts (``ncap.providers.deadlines``: one timer
per route timeout, not one per attempt), and the client's exceptions converted
to ``AttemptFailed`` in one context manager, ``mapped``, where they enter
(``raise … from exc``).

A provider gives the URL, its headers and ``failure_of``, which turns a non-200 answer
into an ``AttemptFailed`` carrying that upstream's own error, normalized. Everything
about the upstream's wire shapes stays in the provider.

Redirects are never followed: the request carries the route's credential and the
client's prompt, and a 3xx would re-send both to whatever origin the upstream names
(a client that follows them drops at most ``Authorization`` and ``Cookie`` on a
cross-origin hop, not an ``x-goog-api-key`` or a route's own headers). A 3xx is the
attempt's failure, whatever provider, before its ``failure_of`` reads it
(``redirect_refused``).

An upstream's words are untrusted: every failure ``failure_of`` builds is scrubbed of
the route's own secrets (the credential and header values this transport sends) before
the lifecycle relays it or the ledger stores its request id (``scrub``), and request ids
are bounded in length and alphabet (``ncap.redact``).

An answer is read up to a bound (``answer_limit``: the route's ``max_answer_bytes``, else
``ANSWER_BASE_BYTES`` plus ``ANSWER_BYTES_PER_TOKEN`` for each token the request allows,
``n`` × its output ceiling), counted after decompression, whole or streamed: past it the
attempt fails (kind ``oversized``, the client's 502) instead of growing the gateway's
memory with whatever the upstream sends. An error answer is read up to 64 KiB only.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from ncap.providers.base import TRACE_HEADERS, AttemptFailed, UpstreamErrorDetail
from ncap.providers.deadlines import within
from ncap.providers.http1 import (
    Body,
    ConnectError,
    HttpClient,
    HttpClientError,
    LineTooLong,
    PayloadError,
    Response,
)
from ncap.redact import Redactor

__all__ = [
    "ANSWER_BASE_BYTES",
    "ANSWER_BYTES_PER_TOKEN",
    "FailureOf",
    "HttpTransport",
    "ReadGapWatch",
    "answer_limit",
    "bounded",
    "mapped",
    "parse_retry_after",
    "redirect_refused",
]

FailureOf = Callable[[int, Mapping[str, str], bytes], AttemptFailed]
"""(status, response headers, body) of a non-200 answer → the attempt's failure."""

_MAX_ERROR_BODY = 65536
# after a stream's last event, how much more of its body is read (and for how long) to
# reach the body's end and keep the connection (``HttpTransport._finish``)
_DRAIN_BYTES = 65536
_DRAIN_S = 5.0
# an answer's bound: the envelope, plus per token allowed (a streamed chunk with 20
# top logprobs is about 1.6 KB of JSON per token; 4 KiB leaves room for escapes)
ANSWER_BASE_BYTES = 1 << 20
ANSWER_BYTES_PER_TOKEN = 4096
_CEILING_UNKNOWN = 4096  # a body without an output ceiling (the lifecycle always sends one)


def answer_limit(body: Mapping[str, Any], fixed: int | None = None) -> int:
    """The most bytes an answer to ``body`` may have: ``fixed`` (the route's, or the
    global ``limits.max_upstream_answer_bytes``) when set, else derived from ``n`` (or
    ``best_of``) × the output ceiling the body sends."""
    if fixed is not None:
        return fixed
    n = max(_count(body.get("n")), _count(body.get("best_of")))
    ceiling = body.get("max_completion_tokens") or body.get("max_tokens")
    tokens = ceiling if isinstance(ceiling, int) and ceiling > 0 else _CEILING_UNKNOWN
    return ANSWER_BASE_BYTES + n * tokens * ANSWER_BYTES_PER_TOKEN


def _count(value: object) -> int:
    return value if isinstance(value, int) and value > 0 else 1


def oversized(limit: int, *, partial: bool = False) -> AttemptFailed:
    return AttemptFailed("oversized", 200, detail=f"more than {limit} bytes", partial=partial)


async def bounded(chunks: AsyncIterable[bytes], limit: int) -> AsyncIterator[bytes]:
    """``chunks`` (a streamed body's lines or pieces) until ``limit`` bytes were read;
    past it the attempt fails (``partial``: something was read, maybe relayed)."""
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise oversized(limit, partial=True)
        yield chunk


async def _read(resp: Response, limit: int, *, cut: bool = False) -> bytes:
    """The body, at most ``limit`` bytes: past it, ``cut`` keeps the first ``limit``
    (an error body, only ever read in part), else the attempt fails."""
    if not cut and resp.content_length is not None and resp.content_length > limit:
        raise oversized(limit)  # said so up front (before decompression): not read at all
    parts: list[bytes] = []
    size = 0
    read = resp.content.readany
    while chunk := await read():
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            if cut:
                break
            raise oversized(limit)
    return b"".join(parts)[:limit] if cut else b"".join(parts)


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """``retry-after-ms`` (OpenAI's) wins over ``retry-after`` in seconds; dates ignored."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return max(0.0, float(value) * scale)
        except ValueError:
            continue
    return None


class HttpTransport:
    """POST a JSON body, whole or streamed, over one client (one connection pool of
    ``max_connections``) opened lazily: to ``url``, or to another URL of the same
    upstream (Gemini's whole and streamed methods share the route's pool). TLS uses
    the default context unless ``ssl_context`` is given."""

    def __init__(
        self,
        url: str,
        *,
        headers: Mapping[str, str],
        connect_timeout_s: float,
        max_connections: int,
        failure_of: FailureOf,
        request_id_header: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.url = url
        self._request_id_header = request_id_header
        self._headers = dict(headers)
        self._connect_timeout = connect_timeout_s
        self._limit = max_connections
        self._failure_of = failure_of
        self._redactor = Redactor(
            v for k, v in self._headers.items() if k.lower() != "content-type"
        )
        self._ssl = ssl_context
        self._http: HttpClient | None = None
        self._draining: set[asyncio.Task[None]] = set()

    def _client(self) -> HttpClient:
        # no cookies kept: an upstream's cookies never pass from one caller's request
        # to another's; redirects are answers, never followed
        if self._http is None or self._http.closed:
            self._http = HttpClient(
                self._headers,
                max_connections=self._limit,
                connect_timeout=self._connect_timeout,
                ssl_context=self._ssl,
            )
        return self._http

    async def post(
        self,
        data: bytes,
        *,
        timeout: float,
        url: str | None = None,
        limit: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[bytes, Mapping[str, str], str | None]:
        """The 200 answer's body (at most ``limit`` bytes), headers and request id (as
        ``request_id`` reads it); any other status raises ``failure_of``'s. ``timeout``
        bounds the whole exchange, the connection included (its own timeout is the
        route's ``connect_timeout_s``)."""
        limit = limit or ANSWER_BASE_BYTES
        # plain try/except rather than ``mapped()`` twice: the same conversion, without
        # two context-manager objects on every request
        rid = None
        resp = None
        try:
            with within(timeout):
                # ``whole``: handed over once the body arrived (one wake-up, not one per
                # read), unless it passes ``limit`` first
                resp = await self._client().post(
                    url or self.url, data, headers=_with_trace(headers), whole=True, cap=limit
                )
                # the head's request id is read before the body: a body cut mid-way
                # keeps it on its failure, so the held attempt can be reconciled
                rid = self.request_id(resp.headers)
                if resp.status == 200:
                    payload = resp.content.whole()
                    if payload is None:
                        payload = await _read(resp, limit)
                    elif len(payload) > limit:
                        raise oversized(limit)
                else:
                    payload = await _read(resp, _MAX_ERROR_BODY, cut=True)
        except BaseException as exc:
            if resp is not None:
                resp.close()
            if not isinstance(exc, Exception):
                raise
            failure = _failure_from(exc, partial=False, provider_request_id=rid)
            if failure is None or failure is exc:
                raise
            raise failure from exc
        resp.release()
        if resp.status != 200:
            raise self._failure(resp, payload)
        return self._redactor.bytes(payload), resp.headers, rid

    @asynccontextmanager
    async def open(
        self,
        data: bytes,
        *,
        timeout: float,
        url: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[Response]:
        """A 200 response whose body is still to be read; closed on leaving the context
        (client disconnect included), which cancels the upstream request."""
        # no total bound: a long stream is fine; the per-attempt timeout bounds the wait
        # for the response head and every wait for the body's next bytes (a provider may
        # hand the gaps to one ``ReadGapWatch`` per stream instead, as OpenAI's does)
        with mapped(), within(timeout):
            resp = await self._client().post(url or self.url, data, headers=_with_trace(headers))
        resp.content.read_timeout = timeout
        try:
            if resp.status != 200:
                with mapped():
                    payload = await _read(resp, _MAX_ERROR_BODY, cut=True)
                raise self._failure(resp, payload)
            yield resp
        except BaseException:
            resp.close()
            raise
        self._finish(resp)

    def _finish(self, resp: Response) -> None:
        """A stream its reader left without an error (it read the last event): the
        connection goes back to the pool once the body's own end is read. That end (a
        chunked body's last, empty chunk) often comes in the read after the last
        event, and a connection closed before it is a new connection (a TCP, and on
        the Internet a TLS, handshake) for the next stream; it is read in the
        background (``_drain``), so the stream's end is not delayed."""
        if resp.content.at_eof():
            resp.release()
            return
        task = asyncio.get_running_loop().create_task(_drain(resp))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    def request_id(self, headers: Mapping[str, str]) -> str | None:
        """The upstream's id of this request, from the header the provider named
        (bounded, and never one that names the route's secrets)."""
        if not self._request_id_header:
            return None
        return self._redactor.request_id(headers.get(self._request_id_header))

    def scrub_bytes(self, data: bytes) -> bytes:
        """An answer's bytes (whole, or one streamed event) without the route's secrets."""
        return self._redactor.bytes(data)

    def scrub_id(self, value: str | None) -> str | None:
        """Any id the upstream sent (a body's ``id``, Gemini's ``responseId``), bounded."""
        return self._redactor.request_id(value)

    def scrub(self, failure: AttemptFailed) -> AttemptFailed:
        """``failure`` without the route's secrets in anything relayed or stored."""
        red = self._redactor
        if failure.error is not None:
            err = failure.error
            failure.error = UpstreamErrorDetail(
                red.text(err.message), code=red.optional(err.code), param=red.optional(err.param)
            )
        failure.detail = red.text(failure.detail)
        failure.provider_request_id = red.request_id(failure.provider_request_id)
        return failure

    def _failure(self, resp: Response, payload: bytes) -> AttemptFailed:
        if 300 <= resp.status < 400:
            return redirect_refused(resp.status, self.request_id(resp.headers))
        return self.scrub(self._failure_of(resp.status, resp.headers, payload))

    async def aclose(self) -> None:
        for task in list(self._draining):
            task.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)
        if self._http is not None:
            await self._http.close()


async def _drain(resp: Response) -> None:
    """The rest of a finished stream's body read (at most ``_DRAIN_BYTES``, within
    ``_DRAIN_S``: what follows the last event is the body's end, or a few bytes), then
    the connection released to the pool; closed instead if the end did not come."""
    try:
        async with asyncio.timeout(_DRAIN_S):
            left = _DRAIN_BYTES
            while left > 0 and not resp.content.at_eof():
                data = await resp.content.readany()
                if not data:
                    break
                left -= len(data)
    except (TimeoutError, HttpClientError, OSError):
        pass
    finally:
        if resp.content.at_eof():
            resp.release()
        else:
            resp.close()


class ReadGapWatch:
    """The per-attempt timeout on every wait for the next read of a streamed body, with
    one timer per stream: the body's own ``read_timeout`` arms a timer on every wait
    (a new timer and its cancel each time, about as much CPU as relaying the read
    itself), and a streamed answer is hundreds of reads. The reader marks when it
    starts waiting (``since``) and clears it when the read arrives; a check every half
    ``timeout_s`` fails a wait that has lasted ``timeout_s`` (caught after one to one and
    a half times it) the way the body's own timer does, with a ``TimeoutError`` on the
    body, which ``mapped`` turns into the attempt's timeout. Time the reader spends elsewhere (the
    client being written to) is not counted: that is not the upstream's gap."""

    __slots__ = ("_handle", "_loop", "_resp", "_timeout", "since")

    def __init__(self, resp: Response, timeout_s: float) -> None:
        if isinstance(resp.content, Body):
            resp.content.read_timeout = None  # this watch bounds the gaps instead
        self._resp = resp
        self._timeout = timeout_s
        self._loop = asyncio.get_running_loop()
        self.since: float | None = None
        self._handle = self._loop.call_later(timeout_s / 2, self._check)

    def now(self) -> float:
        return self._loop.time()

    def _check(self) -> None:
        since = self.since
        if since is not None and self._loop.time() - since >= self._timeout:
            self._resp.content.set_exception(TimeoutError("upstream read timed out"))
            return
        self._handle = self._loop.call_later(self._timeout / 2, self._check)

    def close(self) -> None:
        self._handle.cancel()


def redirect_refused(status: int, provider_request_id: str | None = None) -> AttemptFailed:
    """A 3xx answer, not followed: the upstream generated nothing here (the failure
    table says the route's own retry would be redirected again, and another route of
    the chain may serve)."""
    return AttemptFailed(
        "status", status, provider_request_id=provider_request_id, detail="redirect not followed"
    )


@contextmanager
def mapped(*, partial: bool = False, provider_request_id: str | None = None) -> Iterator[None]:
    """The HTTP client's and asyncio's failures → AttemptFailed, where they enter; a
    request id already
    known (the response head arrived) goes on every failure raised inside."""
    try:
        yield
    except Exception as exc:
        failure = _failure_from(exc, partial=partial, provider_request_id=provider_request_id)
        if failure is None or failure is exc:
            raise
        raise failure from exc


def _failure_from(
    exc: Exception, *, partial: bool, provider_request_id: str | None
) -> AttemptFailed | None:
    """``exc`` as the attempt's failure (an ``AttemptFailed`` itself, given the request id
    when it has none), or None for an exception that is not the transport's."""
    if isinstance(exc, AttemptFailed):
        if exc.provider_request_id is None:
            exc.provider_request_id = provider_request_id
        return exc
    failure = _converted(exc, partial)
    if failure is not None:
        failure.provider_request_id = provider_request_id
    return failure


def _converted(exc: Exception, partial: bool) -> AttemptFailed | None:
    """The transport's exception as the attempt's failure; None for anything else."""
    if isinstance(exc, TimeoutError):  # the connect timeout included
        return AttemptFailed("timeout", detail="upstream timed out", partial=partial)
    if isinstance(exc, ConnectError):
        return AttemptFailed("connection", detail="cannot connect", dispatched=False)
    if isinstance(exc, PayloadError):
        return AttemptFailed("connection", detail="upstream body cut", partial=True)
    if isinstance(exc, LineTooLong):
        # a line-read body (a translated stream) with a line past the client's bound
        return AttemptFailed("protocol", 200, detail=str(exc), partial=partial)
    if isinstance(exc, (HttpClientError, OSError)):
        # the connection closed before the answer's head, or a head that is not HTTP
        return AttemptFailed("connection", detail=type(exc).__name__, partial=partial)
    return None


def _with_trace(headers: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """The attempt's own headers (``X-Client-Request-Id``) and the trace context."""
    trace = TRACE_HEADERS.get()
    if trace is None or headers is None:
        return headers if trace is None else trace
    return {**trace, **headers}
