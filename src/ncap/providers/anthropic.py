"""Provider ``anthropic``: the Anthropic Messages API (``POST {base_url}/messages``).

The adapter half of the pair: the pure translator (``providers.openai_anthropic``)
builds the Messages body from the validated chat request and turns what comes back into
OpenAI's bytes; this module does the HTTP (the shared ``HttpTransport``). Messages has
no ``n``: a route serves n > 1 only by fan-out (``candidates: emulate``), each branch
one request here.

The route's credential goes in ``x-api-key`` with the route's ``anthropic-version``;
the client's own ``Authorization`` is never sent. Errors are facts for the failure
table (``anthropic_failure``): 429 with its ``retry-after``, 529 ``overloaded_error``,
400 ``invalid_request_error`` with Anthropic's message.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import msgspec

from ncap.config import AnthropicRoute
from ncap.errors import InvalidValue
from ncap.protocol.chat import ChatCompletionRequest
from ncap.protocol.validate import CHAT_FIELDS
from ncap.providers.base import AttemptFailed, RequestKind, UpstreamResult
from ncap.providers.credentials import route_headers
from ncap.providers.openai_anthropic import (
    AnthropicStream,
    Shape,
    anthropic_failure,
    decode_message,
    summarize,
    to_anthropic_request,
    to_chat_completion,
)
from ncap.providers.transport import HttpTransport, answer_limit, bounded, mapped
from ncap.streaming.sse import StreamEvent
from ncap.streaming.sse_data import iter_data

__all__ = ["DEFAULT_BASE_URL", "AnthropicProvider"]

DEFAULT_BASE_URL = "https://api.anthropic.com/v1"
NOT_LEGACY = "Anthropic routes serve /v1/chat/completions only, not the legacy /v1/completions."
_encode = msgspec.json.Encoder().encode


class AnthropicProvider:
    """One route's Anthropic model: one transport (one pool of the route's
    ``max_connections``) for whole and streamed answers."""

    def __init__(self, route: AnthropicRoute, *, route_id: str) -> None:
        assert route.upstream_model is not None  # config.Route requires it for anthropic
        self.route_id = route_id
        self.model = route.upstream_model
        self._max_answer = route.max_answer_bytes
        headers = route_headers(route, route_id, header="x-api-key", scheme="")
        headers["anthropic-version"] = route.anthropic_version
        self._transport = HttpTransport(
            (route.base_url or DEFAULT_BASE_URL).rstrip("/") + "/messages",
            headers=headers,
            connect_timeout_s=route.connect_timeout_s,
            max_connections=route.max_connections,
            failure_of=anthropic_failure,
            request_id_header="request-id",
        )

    async def complete(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> UpstreamResult:
        data, shape = self._request(body, kind)
        limit = answer_limit(body, self._max_answer)
        payload, headers = await self._transport.post(data, timeout=timeout, limit=limit)
        rid = self._transport.request_id(headers)
        try:
            msg = decode_message(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise AttemptFailed("protocol", 200, provider_request_id=rid, detail=str(exc)) from exc
        completion = to_chat_completion(
            msg,
            completion_id=f"chatcmpl-{msg.id}",
            created=int(time.time()),
            model=self.model,
            shape=shape,
        )
        rid = rid or self._transport.scrub_id(msg.id)
        return UpstreamResult(200, _encode(completion), summarize(completion), rid)

    @asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> AsyncIterator[tuple[str | None, AsyncIterator[StreamEvent]]]:
        data, shape = self._request(body, kind)
        async with self._transport.open(data, timeout=timeout) as resp:
            rid = self._transport.request_id(resp.headers)
            translator = AnthropicStream(
                completion_id=f"chatcmpl-{rid or secrets.token_hex(12)}",
                created=int(time.time()),
                model=self.model,
                shape=shape,
            )
            limit = answer_limit(body, self._max_answer)
            transport = self._transport
            payloads = aiter(_scrubbed(iter_data(bounded(resp.content, limit)), transport))
            yield rid, _events(translator, payloads, rid, transport)

    async def aclose(self) -> None:
        await self._transport.aclose()

    def _request(self, body: Mapping[str, Any], kind: RequestKind) -> tuple[bytes, Shape]:
        """The Messages body for the OpenAI body the lifecycle routed here (the route's
        allow-listed extras have no Anthropic meaning and are not sent)."""
        if kind != "chat":
            raise InvalidValue(NOT_LEGACY, param="model")
        fields = {k: v for k, v in body.items() if k in CHAT_FIELDS}
        try:
            request = msgspec.convert(fields, ChatCompletionRequest)
        except msgspec.ValidationError as exc:  # validated at the edge; kept for safety
            raise InvalidValue(f"The request cannot be sent to Anthropic: {exc}") from None
        out, shape = to_anthropic_request(request, model=self.model)
        return _encode(out), shape


async def _scrubbed(
    payloads: AsyncIterator[bytes], transport: HttpTransport
) -> AsyncIterator[bytes]:
    """Each event's data without the route's secrets, should the upstream echo them."""
    async for payload in payloads:
        yield transport.scrub_bytes(payload)


async def _events(
    translator: AnthropicStream,
    payloads: AsyncIterator[bytes],
    rid: str | None,
    transport: HttpTransport,
) -> AsyncIterator[StreamEvent]:
    """Anthropic payloads → OpenAI events. A failure before anything was relayed is the
    attempt's (retryable per the table); after that, a cut of a partly relayed stream."""
    relayed = False
    while True:
        with mapped(partial=relayed, provider_request_id=rid):
            data = await anext(payloads, None)
        if data is None:
            break
        try:
            events = translator.events(data)
        except AttemptFailed as exc:
            exc.partial = exc.partial or relayed
            exc.provider_request_id = exc.provider_request_id or rid
            raise transport.scrub(exc) from None
        for event in events:
            relayed = True
            yield event
    for event in translator.end():
        yield event
