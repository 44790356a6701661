"""The upstream HTTP transport every HTTP provider shares: one pooled aiohttp session,
per-attempt timeouts, and aiohttp's exceptions converted to ``AttemptFailed`` in one
context manager, ``mapped``, where they enter (``raise … from exc``).

A provider gives the URL, its headers and ``failure_of``, which turns a non-200 answer
into an ``AttemptFailed`` carrying that upstream's own error, normalized. Everything
about the upstream's wire shapes stays in the provider.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager

import aiohttp

from ncap.providers.base import AttemptFailed

__all__ = ["FailureOf", "HttpTransport", "mapped", "parse_retry_after"]

FailureOf = Callable[[int, Mapping[str, str], bytes], AttemptFailed]
"""(status, response headers, body) of a non-200 answer → the attempt's failure."""

_MAX_ERROR_BODY = 65536


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
    """POST a JSON body, whole or streamed, over one session (one connection pool of
    ``max_connections``) opened lazily: to ``url``, or to another URL of the same
    upstream (Gemini's whole and streamed methods share the route's pool)."""

    def __init__(
        self,
        url: str,
        *,
        headers: Mapping[str, str],
        connect_timeout_s: float,
        max_connections: int,
        failure_of: FailureOf,
        request_id_header: str | None = None,
    ) -> None:
        self.url = url
        self._request_id_header = request_id_header
        self._headers = dict(headers)
        self._connect_timeout = connect_timeout_s
        self._limit = max_connections
        self._failure_of = failure_of
        self._session: aiohttp.ClientSession | None = None
        self._whole_timeouts: dict[float, aiohttp.ClientTimeout] = {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._limit, ttl_dns_cache=300)
            # no cookie jar: an upstream's cookies must never pass from one caller's
            # request to another's (and filtering them costs every request)
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self._headers,
                auto_decompress=True,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def post(
        self,
        data: bytes,
        *,
        timeout: float,
        url: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[bytes, Mapping[str, str]]:
        """The 200 answer's body and headers; any other status raises ``failure_of``'s."""
        client_timeout = self._whole_timeouts.get(timeout)
        if client_timeout is None:  # one per distinct attempt timeout (config values)
            client_timeout = aiohttp.ClientTimeout(
                total=timeout, connect=min(self._connect_timeout, timeout)
            )
            if len(self._whole_timeouts) < 64:
                self._whole_timeouts[timeout] = client_timeout
        # plain try/except rather than ``mapped()`` twice: the same conversion, without
        # two context-manager objects on every request
        rid = None
        try:
            target = url or self.url
            post = self._client().post(target, data=data, timeout=client_timeout, headers=headers)
            async with post as resp:
                # the head's request id is read before the body: a body cut mid-way
                # keeps it on its failure, so the held attempt can be reconciled
                rid = self.request_id(resp.headers)
                payload = await resp.read()
        except Exception as exc:
            failure = _failure_from(exc, partial=False, provider_request_id=rid)
            if failure is None or failure is exc:
                raise
            raise failure from exc
        if resp.status != 200:
            raise self._failure(resp, payload)
        return payload, resp.headers

    @asynccontextmanager
    async def open(
        self,
        data: bytes,
        *,
        timeout: float,
        url: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A 200 response whose body is still to be read; closed on leaving the context
        (client disconnect included), which cancels the upstream request."""
        # total=None: a long stream is fine; the per-attempt timeout bounds the wait for
        # the response head and every gap between chunks (sock_read).
        client_timeout = aiohttp.ClientTimeout(
            total=None, connect=min(self._connect_timeout, timeout), sock_read=timeout
        )
        with mapped():
            resp = await asyncio.wait_for(
                self._client().post(
                    url or self.url, data=data, timeout=client_timeout, headers=headers
                ),
                timeout,
            )
        try:
            if resp.status != 200:
                with mapped():
                    payload = await resp.read()
                raise self._failure(resp, payload)
            yield resp
        finally:
            resp.close()

    def request_id(self, headers: Mapping[str, str]) -> str | None:
        """The upstream's id of this request, from the header the provider named."""
        return headers.get(self._request_id_header) if self._request_id_header else None

    def _failure(self, resp: aiohttp.ClientResponse, payload: bytes) -> AttemptFailed:
        return self._failure_of(resp.status, resp.headers, payload[:_MAX_ERROR_BODY])

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


@contextmanager
def mapped(*, partial: bool = False, provider_request_id: str | None = None) -> Iterator[None]:
    """aiohttp/asyncio failures → AttemptFailed, where they enter; a request id already
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
    if isinstance(exc, TimeoutError):
        return AttemptFailed("timeout", detail="upstream timed out", partial=partial)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return AttemptFailed("connection", detail="cannot connect", dispatched=False)
    if isinstance(exc, aiohttp.ClientPayloadError):
        return AttemptFailed("connection", detail="upstream body cut", partial=True)
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return AttemptFailed("connection", detail=type(exc).__name__, partial=partial)
    if isinstance(exc, aiohttp.http_exceptions.HttpProcessingError):
        # a response the HTTP parser rejects mid-body (a line or chunk it cannot read)
        return AttemptFailed("protocol", 200, detail=type(exc).__name__, partial=partial)
    return None
