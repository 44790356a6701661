"""The adapter of every translated pair: an HTTP upstream whose API is not OpenAI's
(Anthropic, Gemini), served through the translator the registry picks for the route's
kind (``providers.kinds.translator_for``).

This module only does the HTTP (the shared ``HttpTransport``): it sends what the
translator's request makes, hands it the answer, the stream's events (SSE data, split
here) or the error, and scrubs the route's secrets from whatever is relayed. A stream's
first event is read before the stream is handed over, so a prompt refused at the first
event fails the attempt before any byte reaches the client (and Gemini's request id,
which comes in that event, is known when the stream opens). A provider module gives
only its ``Endpoint``: where to post, its headers, where its request id is.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from ncap.config import HttpRoute
from ncap.providers.base import AttemptFailed, RequestKind, UpstreamResult
from ncap.providers.kinds import translator_for
from ncap.providers.translate import Reply, StreamTranslator, random_id
from ncap.providers.transport import HttpTransport, answer_limit, bounded, mapped
from ncap.streaming.sse import StreamPiece
from ncap.streaming.sse_data import iter_data

__all__ = ["Endpoint", "TranslatedProvider"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a route's requests go: the URL of whole answers, of streams (when it is
    another), the headers (the route's credential among them), and the response
    header that names the upstream's id of the request, if one does."""

    url: str
    headers: Mapping[str, str]
    stream_url: str | None = None
    request_id_header: str | None = None


class TranslatedProvider:
    """One route's model behind a translator: one transport (one pool of the route's
    ``max_connections``, opened on first use) for whole and streamed answers."""

    def __init__(self, route: HttpRoute, *, route_id: str, endpoint: Endpoint) -> None:
        assert route.upstream_model is not None  # config requires it for these kinds
        self.route_id = route_id
        self.model = route.upstream_model
        self._max_answer = route.max_answer_bytes
        self._translator = translator_for(route.provider)
        self._stream_url = endpoint.stream_url
        self._transport = HttpTransport(
            endpoint.url,
            headers=endpoint.headers,
            connect_timeout_s=route.connect_timeout_s,
            max_connections=route.max_connections,
            failure_of=self._translator.error,
            request_id_header=endpoint.request_id_header,
        )

    async def complete(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> UpstreamResult:
        sent = self._translator.request(body, kind, model=self.model)
        limit = answer_limit(body, self._max_answer)
        payload, headers, rid = await self._transport.post(sent.data, timeout=timeout, limit=limit)
        try:
            answer = self._translator.response(payload, self._reply(headers, rid), sent.shape)
        except AttemptFailed as exc:
            raise self._transport.scrub(exc) from exc
        return UpstreamResult(200, answer.body, answer.summary, answer.provider_request_id)

    @asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> AsyncIterator[tuple[str | None, AsyncIterator[StreamPiece]]]:
        sent = self._translator.request(body, kind, model=self.model)
        transport = self._transport
        async with transport.open(sent.data, timeout=timeout, url=self._stream_url) as resp:
            head_id = transport.request_id(resp.headers)
            limit = answer_limit(body, self._max_answer)
            payloads = aiter(_scrubbed(iter_data(bounded(resp.content, limit)), transport))
            with mapped(provider_request_id=head_id):
                first = await anext(payloads, None)
            events = self._translator.stream(self._reply(resp.headers, head_id, first), sent.shape)
            pieces = _pieces(events, first, payloads, head_id, transport)
            yield events.provider_request_id, pieces

    async def aclose(self) -> None:
        await self._transport.aclose()

    def _reply(
        self, headers: Mapping[str, str], request_id: str | None, first: bytes | None = None
    ) -> Reply:
        return Reply(
            headers=headers,
            request_id=request_id,
            created=int(time.time()),
            model=self.model,
            scrub_id=self._transport.scrub_id,
            spare_id=random_id,
            first_event=first,
        )


async def _scrubbed(
    payloads: AsyncIterator[bytes], transport: HttpTransport
) -> AsyncIterator[bytes]:
    """Each event's data without the route's secrets, should the upstream echo them."""
    async for payload in payloads:
        yield transport.scrub_bytes(payload)


async def _pieces(
    events: StreamTranslator,
    first: bytes | None,
    payloads: AsyncIterator[bytes],
    head_id: str | None,
    transport: HttpTransport,
) -> AsyncIterator[StreamPiece]:
    """The upstream's events → OpenAI's, one piece per upstream event. A failure before
    anything was relayed is the attempt's (retryable per the failure table); after
    that, a cut of a partly relayed stream."""
    relayed = False
    data = first
    while data is not None:
        try:
            piece = events.events(data)
        except AttemptFailed as exc:
            exc.partial = exc.partial or relayed
            exc.provider_request_id = exc.provider_request_id or head_id
            raise transport.scrub(exc) from exc
        if piece is not None:
            relayed = True
            yield piece
        with mapped(partial=relayed, provider_request_id=head_id):
            data = await anext(payloads, None)
    last = events.end()
    if last is not None:
        yield last
