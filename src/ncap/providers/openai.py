"""Provider ``openai``: any OpenAI-compatible Chat Completions upstream.

One pooled aiohttp session per route (keep-alive, bounded connections). The client's
own ``Authorization`` never reaches the upstream: the route's credential (read from
the environment variable the route names) is the only one sent. aiohttp's exceptions
are converted to ``AttemptFailed`` in one place, ``_mapped``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import aiohttp
import msgspec

from ncap.config import Route
from ncap.protocol.responses import ResponseSummary
from ncap.providers.base import AttemptFailed, UpstreamResult
from ncap.streaming.sse import MalformedEvent, StreamEvent, iter_events

__all__ = ["OpenAIProvider", "parse_retry_after"]

log = logging.getLogger("ncap.providers.openai")
_summary = msgspec.json.Decoder(ResponseSummary)
_encode = msgspec.json.Encoder().encode


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


class OpenAIProvider:
    def __init__(self, route: Route, *, route_id: str) -> None:
        assert route.base_url is not None
        self.route_id = route_id
        self._url = route.base_url.rstrip("/") + "/chat/completions"
        self._connect_timeout = route.connect_timeout_s
        self._limit = route.max_connections
        self._headers = {**route.headers, "Content-Type": "application/json"}
        key = os.environ.get(route.api_key_env) if route.api_key_env else None
        if key:
            self._headers["Authorization"] = f"Bearer {key}"
        elif route.api_key_env:
            log.warning(
                "route %s: %s is not set; requests go upstream without a credential",
                route_id,
                route.api_key_env,
            )
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._limit, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, auto_decompress=True
            )
        return self._session

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, connect=min(self._connect_timeout, total))

    async def complete(self, body: Mapping[str, Any], *, timeout: float) -> UpstreamResult:
        with _mapped():
            async with self._client().post(
                self._url, data=_encode(body), timeout=self._timeout(timeout)
            ) as resp:
                payload = await resp.read()
                request_id = resp.headers.get("x-request-id")
                if resp.status != 200:
                    raise _status_failure(resp, payload)
        try:
            summary = _summary.decode(payload)
        except msgspec.DecodeError as exc:
            raise AttemptFailed(
                "protocol", 200, body=b"", provider_request_id=request_id, detail=str(exc)
            ) from exc
        return UpstreamResult(200, payload, summary, request_id or summary.id)

    @asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, timeout: float
    ) -> AsyncIterator[tuple[str | None, AsyncIterator[StreamEvent]]]:
        # total=None: a long stream is fine; the per-attempt timeout bounds the wait for
        # the response head and every gap between chunks (sock_read).
        client_timeout = aiohttp.ClientTimeout(
            total=None, connect=min(self._connect_timeout, timeout), sock_read=timeout
        )
        with _mapped():
            resp = await asyncio.wait_for(
                self._client().post(self._url, data=_encode(body), timeout=client_timeout),
                timeout,
            )
        try:
            if resp.status != 200:
                with _mapped():
                    payload = await resp.read()
                raise _status_failure(resp, payload)
            yield resp.headers.get("x-request-id"), _events(resp)
        finally:
            resp.close()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _events(resp: aiohttp.ClientResponse) -> AsyncIterator[StreamEvent]:
    with _mapped(partial=True):
        try:
            async for event in iter_events(resp.content):
                yield event
        except MalformedEvent as exc:
            raise AttemptFailed("protocol", 200, detail=str(exc), partial=True) from exc


def _status_failure(resp: aiohttp.ClientResponse, payload: bytes) -> AttemptFailed:
    return AttemptFailed(
        "status",
        resp.status,
        retry_after=parse_retry_after(resp.headers),
        body=payload[:65536],
        provider_request_id=resp.headers.get("x-request-id"),
    )


@contextmanager
def _mapped(*, partial: bool = False) -> Iterator[None]:
    """aiohttp/asyncio failures → AttemptFailed, where they enter."""
    try:
        yield
    except AttemptFailed:
        raise
    except TimeoutError as exc:
        raise AttemptFailed("timeout", detail="upstream timed out", partial=partial) from exc
    except aiohttp.ClientConnectorError as exc:
        raise AttemptFailed("connection", detail="cannot connect", dispatched=False) from exc
    except aiohttp.ClientPayloadError as exc:
        raise AttemptFailed("connection", detail="upstream body cut", partial=True) from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise AttemptFailed("connection", detail=type(exc).__name__, partial=partial) from exc
