"""Provider ``gemini``: the Gemini API (``generateContent`` / ``streamGenerateContent``).

The adapter half of the pair: the pure translator (``providers.openai_gemini``) builds
the Gemini body from the validated chat request and turns what comes back into OpenAI's
bytes; this module only does the HTTP (the shared ``HttpTransport``) and turns every
``GeminiError`` into the lifecycle's ``AttemptFailed``, carrying the client's error the
translator built, so the lifecycle never reads Gemini's (or OpenAI's) error shapes.

The key goes in ``x-goog-api-key``, never in the URL (``?key=`` would land in access
logs). A stream's first Gemini event is read before the stream is handed over, so a
prompt blocked at the first event fails the attempt before any byte reaches the client.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import msgspec

from ncap.config import GeminiRoute
from ncap.errors import InvalidValue
from ncap.protocol.chat import ChatCompletionRequest
from ncap.protocol.validate import CHAT_FIELDS
from ncap.providers.base import (
    AttemptFailed,
    RequestKind,
    UpstreamErrorDetail,
    UpstreamResult,
)
from ncap.providers.credentials import route_headers
from ncap.providers.openai_gemini import (
    GeminiError,
    GeminiStream,
    decode_response,
    summarize,
    to_chat_completion,
    to_gemini_request,
    translate_error,
)
from ncap.providers.transport import HttpTransport, answer_limit, bounded, mapped
from ncap.streaming.sse import StreamEvent
from ncap.streaming.sse_data import iter_data

__all__ = ["DEFAULT_BASE_URL", "GeminiProvider", "gemini_failure"]

DEFAULT_BASE_URL = "https://generativelanguage.googleapis.com/v1beta"
NOT_LEGACY = "Gemini routes serve /v1/chat/completions only, not the legacy /v1/completions."
_SKIP_SIGNATURE = "skip_thought_signature_validator"
_GEMINI_3 = re.compile(r"^gemini-3")
_encode = msgspec.json.Encoder().encode
log = logging.getLogger("ncap.providers.gemini")


class GeminiProvider:
    """One route's Gemini model: one transport (one pool of the route's
    ``max_connections``, opened on first use) for both methods, whole and streamed."""

    def __init__(self, route: GeminiRoute, *, route_id: str) -> None:
        assert route.upstream_model is not None  # config.Route requires it for gemini
        self.route_id = route_id
        self.model = route.upstream_model
        self._max_answer = route.max_answer_bytes
        base = (route.base_url or DEFAULT_BASE_URL).rstrip("/") + f"/models/{self.model}"
        self._replay = _SKIP_SIGNATURE if _GEMINI_3.match(self.model) else None
        headers = route_headers(route, route_id, header="x-goog-api-key", scheme="")
        self._transport = _transport(route, base + ":generateContent", headers)
        self._stream_url = base + ":streamGenerateContent?alt=sse"

    async def complete(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> UpstreamResult:
        data = self._request(body, kind)
        limit = answer_limit(body, self._max_answer)
        payload, headers = await self._transport.post(data, timeout=timeout, limit=limit)
        try:
            resp = decode_response(payload)
            rid = self._transport.scrub_id(resp.response_id or headers.get("x-request-id"))
            completion = to_chat_completion(
                resp,
                completion_id=_completion_id(rid),
                created=int(time.time()),
                model=self.model,  # as the stream names it, so both read the same
                provider_request_id=rid,
            )
        except GeminiError as exc:
            raise self._transport.scrub(as_attempt_failed(exc)) from exc
        return UpstreamResult(200, _encode(completion), summarize(completion), rid)

    @asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> AsyncIterator[tuple[str | None, AsyncIterator[StreamEvent]]]:
        data = self._request(body, kind)
        async with self._transport.open(data, timeout=timeout, url=self._stream_url) as resp:
            limit = answer_limit(body, self._max_answer)
            payloads = aiter(_scrubbed(iter_data(bounded(resp.content, limit)), self._transport))
            first = await _first(payloads)
            rid = self._transport.scrub_id(_response_id(first))
            translator = GeminiStream(
                completion_id=_completion_id(rid), created=int(time.time()), model=self.model
            )
            yield rid, _events(translator, first, payloads, self._transport)

    async def aclose(self) -> None:
        await self._transport.aclose()

    def _request(self, body: Mapping[str, Any], kind: RequestKind) -> bytes:
        """The Gemini body for the OpenAI body the lifecycle routed here: the route's
        allow-listed extras have no Gemini meaning and are not sent."""
        if kind != "chat":
            raise InvalidValue(NOT_LEGACY, param="model")
        fields = {k: v for k, v in body.items() if k in CHAT_FIELDS}
        try:
            request = msgspec.convert(fields, ChatCompletionRequest)
        except msgspec.ValidationError as exc:  # validated at the edge; kept for safety
            raise InvalidValue(f"The request cannot be sent to Gemini: {exc}") from None
        return _encode(to_gemini_request(request, replay_signature=self._replay))


def _transport(route: GeminiRoute, url: str, headers: Mapping[str, str]) -> HttpTransport:
    return HttpTransport(
        url,
        headers=headers,
        connect_timeout_s=route.connect_timeout_s,
        max_connections=route.max_connections,
        failure_of=gemini_failure,
    )


def _completion_id(provider_request_id: str | None) -> str:
    return f"chatcmpl-{provider_request_id or secrets.token_hex(12)}"


def _response_id(data: bytes | None) -> str | None:
    """The ``responseId`` of a raw event, read without translating it (that happens once,
    in ``_events``); None when absent or unreadable (the translator then reports it)."""
    if data is None:
        return None
    try:
        value = msgspec.json.decode(data, type=dict[str, Any]).get("responseId")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return value if isinstance(value, str) else None


async def _scrubbed(
    payloads: AsyncIterator[bytes], transport: HttpTransport
) -> AsyncIterator[bytes]:
    """Each event's payload without the route's secrets, should the upstream echo them."""
    async for payload in payloads:
        yield transport.scrub_bytes(payload)


async def _first(payloads: AsyncIterator[bytes]) -> bytes | None:
    with mapped():
        return await anext(payloads, None)


async def _events(
    translator: GeminiStream,
    first: bytes | None,
    payloads: AsyncIterator[bytes],
    transport: HttpTransport,
) -> AsyncIterator[StreamEvent]:
    """Gemini payloads → OpenAI events. A failure before anything was yielded is the
    attempt's (retryable, unrelayed); after that, a cut of a partly relayed stream."""
    relayed = False
    data = first
    while data is not None:
        try:
            events = translator.events(data)
        except GeminiError as exc:
            raise transport.scrub(as_attempt_failed(exc, partial=relayed)) from exc
        for event in events:
            relayed = True
            yield event
        with mapped(partial=relayed):
            data = await anext(payloads, None)
    for event in translator.end():
        yield event


def gemini_failure(status: int, headers: Mapping[str, str], payload: bytes) -> AttemptFailed:
    """A non-200 Gemini answer, normalized once by the translator."""
    error = translate_error(
        status,
        payload,
        retry_after=headers.get("retry-after"),
        provider_request_id=headers.get("x-request-id"),
    )
    return as_attempt_failed(error)


# what each kind of Gemini failure is, in OpenAI's terms: the code the failure table
# reads (None: the status says it) and whether the client hears Gemini's own words
_FACTS: dict[str, tuple[str | None, bool]] = {
    "invalid": (None, True),
    "context": ("context_length_exceeded", True),
    "blocked": ("content_filter", False),
    "candidates": ("route_does_not_support_candidates", False),
    "rate_limit": ("rate_limit_exceeded", False),
    "auth": ("invalid_api_key", False),
    "route": ("route_misconfigured", True),
}


def as_attempt_failed(error: GeminiError, *, partial: bool = False) -> AttemptFailed:
    """The facts of a ``GeminiError`` for the failure table: the status (a blocked
    prompt came as a 200, but it is a refusal of the request: 400), the OpenAI code of
    what Gemini said, its message, and what it reported (usage, the most candidates)."""
    status = 400 if error.kind == "blocked" else error.upstream_status
    code, own_words = _FACTS.get(error.kind, (None, False))
    message = error.upstream_message if own_words and error.upstream_message else error.message
    return AttemptFailed(
        "protocol" if error.kind == "protocol" else "status",
        status,
        retry_after=error.retry_after,
        error=UpstreamErrorDetail(message, code=code, param=error.param),
        provider_request_id=error.provider_request_id,
        detail=str(error),
        partial=partial,
        usage=error.usage,
        max_candidates=error.max_candidates,
    )
