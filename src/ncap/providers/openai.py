"""Provider ``openai``: any OpenAI-compatible Chat Completions upstream.

One pooled HTTP transport per route (``ncap.providers.transport``: keep-alive, bounded
connections, the HTTP client's exceptions converted where they enter). The client's own
``Authorization`` never reaches the upstream: the route's credential (read from the
environment variable the route names) is the only one sent. The identity pair's
translator (``providers.openai_passthrough``, picked by the registry for the route's
kind) encodes the body, reads the answer's summary and the error envelope, and splits a
stream's reads into events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from ncap.config import HttpRoute
from ncap.providers.base import CLIENT_REQUEST_ID, AttemptFailed, RequestKind, UpstreamResult
from ncap.providers.credentials import route_headers
from ncap.providers.http1 import Response
from ncap.providers.kinds import translator_for
from ncap.providers.openai_passthrough import OpenAITranslator, PassThroughStream
from ncap.providers.translate import Reply, random_id
from ncap.providers.transport import (
    HttpTransport,
    ReadGapWatch,
    answer_limit,
    mapped,
    oversized,
)
from ncap.streaming.sse import MalformedEvent, StreamPiece

__all__ = ["OpenAIProvider"]

log = logging.getLogger("ncap.providers.openai")
_IN_BODY = ""  # the model: the routed body names it, and the answer the upstream's own
_PATHS: tuple[tuple[RequestKind, str], ...] = (
    ("chat", "chat/completions"),
    ("completions", "completions"),
)


class OpenAIProvider:
    """An upstream that speaks OpenAI's wire shapes: ``{base_url}/chat/completions`` and
    ``{base_url}/completions`` with a bearer credential, unless a provider of the same
    shapes (Azure OpenAI) gives its own URLs and headers (its error reading is its
    translator's)."""

    def __init__(
        self,
        route: HttpRoute,
        *,
        route_id: str,
        urls: Mapping[RequestKind, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.route_id = route_id
        self._max_answer = route.max_answer_bytes
        translator = translator_for(route.provider)
        assert isinstance(translator, OpenAITranslator)  # the registry's pass-through pairs
        self._translator = translator
        if urls is None:
            assert route.base_url is not None
            base = route.base_url.rstrip("/")
            urls = {kind: f"{base}/{path}" for kind, path in _PATHS}
        sent = headers if headers is not None else route_headers(route, route_id)
        # one transport per endpoint; a session (and its pool) opens on first use only
        self._transports: dict[RequestKind, HttpTransport] = {
            kind: HttpTransport(
                url,
                headers=sent,
                connect_timeout_s=route.connect_timeout_s,
                max_connections=route.max_connections,
                failure_of=translator.error,
                request_id_header="x-request-id",
            )
            for kind, url in urls.items()
        }

    async def complete(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> UpstreamResult:
        transport = self._transports[kind]
        limit = answer_limit(body, self._max_answer)
        data = self._translator.request(body, kind, model=_IN_BODY).data
        payload, headers, rid = await transport.post(
            data, timeout=timeout, limit=limit, headers=_attempt_headers()
        )
        answer = self._translator.response(payload, _reply(transport, headers, rid), None)
        return UpstreamResult(200, answer.body, answer.summary, answer.provider_request_id)

    @asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> AsyncIterator[tuple[str | None, AsyncIterator[StreamPiece]]]:
        transport = self._transports[kind]
        data = self._translator.request(body, kind, model=_IN_BODY).data
        async with transport.open(data, timeout=timeout, headers=_attempt_headers()) as resp:
            rid = transport.request_id(resp.headers)
            events = self._translator.stream(_reply(transport, resp.headers, rid), None)
            if _candidates(body) > 1:  # read for the candidates' evidence too
                events.read_candidates()
            limit = answer_limit(body, self._max_answer)
            yield events.provider_request_id, _events(resp, events, timeout, limit, transport)

    async def aclose(self) -> None:
        for transport in self._transports.values():
            await transport.aclose()


def _candidates(body: Mapping[str, Any]) -> int:
    """How many candidates the routed body asks for (``n``; 1 when absent or odd)."""
    n = body.get("n")
    return n if isinstance(n, int) else 1


def _reply(transport: HttpTransport, headers: Mapping[str, str], request_id: str | None) -> Reply:
    return Reply(
        headers=headers,
        request_id=request_id,
        created=int(time.time()),
        model=_IN_BODY,
        scrub_id=transport.scrub_id,
        spare_id=random_id,
    )


def _attempt_headers() -> dict[str, str] | None:
    """``X-Client-Request-Id``: ncap's id of this attempt, which OpenAI keeps with the
    request (ASCII, under its 512-character limit)."""
    client_id = CLIENT_REQUEST_ID.get()
    return {"X-Client-Request-Id": client_id} if client_id else None


async def _events(
    resp: Response,
    splitter: PassThroughStream,
    timeout: float,
    limit: int,
    transport: HttpTransport,
) -> AsyncIterator[StreamPiece]:
    """The body's events, one piece per read as the socket gave it (the splitter finds
    the events, so a long event line is no line-reader's ``LineTooLong``), at most ``limit``
    bytes in all, the route's secrets scrubbed should the upstream echo them; a failure
    carries the request id, which a stream whose first event fails would otherwise
    lose. The loop of ``iter_pieces``, inlined (one generator fewer on every read),
    with the wait for each read bounded by ``ReadGapWatch`` (one timer per stream)."""
    scrub = transport.scrub_bytes
    read = resp.content.readany
    gaps = ReadGapWatch(resp, timeout)
    clock = asyncio.get_running_loop().time
    size = 0
    try:
        with mapped(partial=True, provider_request_id=splitter.provider_request_id):
            while True:
                gaps.since = clock()
                chunk = await read()
                gaps.since = None
                if not chunk:
                    break
                size += len(chunk)
                if size > limit:
                    raise oversized(limit, partial=True)
                piece = splitter.events(chunk)
                if piece is not None:
                    # ``_scrubbed``, inlined for the common piece (no secret in it)
                    yield piece if scrub(piece.raw) is piece.raw else _scrubbed(piece, scrub)
                if splitter.failure is not None:
                    raise _malformed(splitter.failure) from splitter.failure
                if splitter.done:
                    return
            piece = splitter.end()
            if piece is not None:
                yield _scrubbed(piece, scrub)
            if splitter.failure is not None:
                raise _malformed(splitter.failure) from splitter.failure
    finally:
        gaps.close()


def _scrubbed(piece: StreamPiece, scrub: Callable[[bytes], bytes]) -> StreamPiece:
    """A piece's bytes without the route's secrets (whole events: a secret is never cut
    across pieces); the same piece when it held none, the common case."""
    raw = scrub(piece.raw)
    if raw is piece.raw:
        return piece
    return StreamPiece(raw, piece.summaries, piece.done, piece.choice_tokens)


def _malformed(exc: MalformedEvent) -> AttemptFailed:
    return AttemptFailed("protocol", 200, detail=str(exc), partial=True)
