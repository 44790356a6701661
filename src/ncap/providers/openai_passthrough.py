"""The translator for the identity pair: OpenAI Chat Completions ↔ an upstream that
speaks OpenAI's own shapes (any OpenAI-compatible API; Azure OpenAI, whose error
envelope is its own).

Nothing is translated, and nothing is decoded that the relay does not need: the body
goes upstream as the lifecycle routed it (chat or the legacy completions endpoint), a
whole answer is relayed as its bytes with the summary read from them, and a stream is
relayed per socket read (``PassThroughStream``: ``EventSplitter`` finds the events in
each read, so ``events`` takes the body's reads rather than one event's data). Only
the error envelope is read, into the facts the failure table classifies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from ncap.protocol.responses import ErrorEnvelope, ResponseSummary
from ncap.providers.base import AttemptFailed, RequestKind, UpstreamErrorDetail
from ncap.providers.translate import Answer, Reply, Sent
from ncap.providers.transport import parse_retry_after
from ncap.streaming.sse import EventSplitter, StreamPiece

__all__ = [
    "AzureTranslator",
    "OpenAITranslator",
    "PassThroughStream",
    "azure_failure",
    "openai_failure",
]

_summary = msgspec.json.Decoder(ResponseSummary)
_error_decoder = msgspec.json.Decoder(ErrorEnvelope)
_encode = msgspec.json.Encoder().encode


class PassThroughStream(EventSplitter):
    """An OpenAI stream relayed as it came: one piece per read. A malformed event is
    not raised by ``events`` but left on ``failure`` once the events before it are
    returned, so that the adapter relays them first."""

    __slots__ = ("provider_request_id",)

    def __init__(self, provider_request_id: str | None) -> None:
        super().__init__()
        self.provider_request_id = provider_request_id

    def events(self, data: bytes) -> StreamPiece | None:
        """The body's next read in, its whole events out (``EventSplitter.feed``)."""
        return self.feed(data)


class OpenAITranslator:
    """OpenAI ↔ OpenAI; stateless."""

    def request(self, body: Mapping[str, Any], kind: RequestKind, *, model: str) -> Sent[None]:
        """The routed body as it is, for either endpoint (the model is in it)."""
        return Sent(_encode(body), None)

    def response(self, payload: bytes, reply: Reply, shape: None) -> Answer:
        """The answer's own bytes, and the summary read from them."""
        try:
            summary = _summary.decode(payload)
        except msgspec.DecodeError as exc:
            raise AttemptFailed(
                "protocol", 200, provider_request_id=reply.request_id, detail=str(exc)
            ) from exc
        return Answer(payload, summary, reply.request_id or reply.scrub_id(summary.id))

    def stream(self, reply: Reply, shape: None) -> PassThroughStream:
        return PassThroughStream(reply.request_id)

    def error(self, status: int, headers: Mapping[str, str], payload: bytes) -> AttemptFailed:
        return openai_failure(status, headers, payload)


class AzureTranslator(OpenAITranslator):
    """OpenAI ↔ Azure OpenAI: OpenAI's shapes, Azure's error envelope."""

    def error(self, status: int, headers: Mapping[str, str], payload: bytes) -> AttemptFailed:
        return azure_failure(status, headers, payload)


def openai_failure(status: int, headers: Mapping[str, str], payload: bytes) -> AttemptFailed:
    """A non-200 answer of an OpenAI-compatible upstream, its envelope read once."""
    return AttemptFailed(
        "status",
        status,
        retry_after=parse_retry_after(headers),
        error=_error_detail(payload),
        provider_request_id=headers.get("x-request-id"),
    )


def _error_detail(payload: bytes) -> UpstreamErrorDetail | None:
    try:
        err = _error_decoder.decode(payload).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return UpstreamErrorDetail(err.message, code=err.code, param=err.param)


class _AzureError(msgspec.Struct):
    message: str = ""
    code: str | None = None
    param: str | None = None


class _AzureEnvelope(msgspec.Struct):
    error: _AzureError


_decode_azure_error = msgspec.json.Decoder(_AzureEnvelope).decode


def azure_failure(status: int, headers: Mapping[str, str], payload: bytes) -> AttemptFailed:
    """A non-200 Azure answer as facts. Azure's error bodies carry no ``type`` and their
    own codes: read leniently (a prompt refused by the content filter keeps
    ``content_filter``); its 429 code (``"429"``) is a rate limit, its delay from
    ``retry-after-ms``."""
    try:
        err: _AzureError | None = _decode_azure_error(payload).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        err = None
    detail = None
    if err is not None:
        code = "rate_limit_exceeded" if status == 429 else err.code
        detail = UpstreamErrorDetail(err.message or f"status {status}", code=code, param=err.param)
    return AttemptFailed(
        "status",
        status,
        retry_after=parse_retry_after(headers),
        error=detail,
        provider_request_id=headers.get("x-request-id") or headers.get("apim-request-id"),
    )
