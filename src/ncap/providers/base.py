"""The one Provider protocol every upstream adapter implements.

A provider performs exactly one attempt: retries, fallbacks and the ledger belong to
``ncap.lifecycle``, which records every attempt as its own event. Failures are raised as
``AttemptFailed`` (converted from the transport's own exceptions where they enter), and
each provider normalizes its upstream's error shape into it (``UpstreamErrorDetail``: a refusal of
n > 1 carries the code ``route_does_not_support_candidates``, a credential or route
configuration the upstream refused ``route_misconfigured``), so
``ncap.lifecycle.failures`` classifies every provider's failures with one table.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec

from ncap.protocol.responses import ResponseSummary, Usage
from ncap.streaming.sse import StreamPiece

__all__ = [
    "CLIENT_REQUEST_ID",
    "TRACE_HEADERS",
    "AttemptFailed",
    "Provider",
    "RequestKind",
    "StreamPiece",
    "UpstreamErrorDetail",
    "UpstreamResult",
]

# ncap's id of the attempt being sent (``<request id>#<attempt>``), set by the lifecycle
# around each provider call: providers send it upstream where the provider keeps it
# (OpenAI's ``X-Client-Request-Id``), so that a row the provider never named (a lost
# gateway, a timeout) can still be matched in its usage records
CLIENT_REQUEST_ID: ContextVar[str | None] = ContextVar("ncap_client_request_id", default=None)

TRACE_HEADERS: ContextVar[Mapping[str, str] | None] = ContextVar("ncap_trace_headers", default=None)
"""The trace context (``traceparent``) the current task's upstream request carries, set
per attempt when traces are on; HTTP providers add it to their request's headers."""

FailureKind = Literal["status", "timeout", "connection", "protocol", "oversized"]
RequestKind = Literal["chat", "completions"]
"""Which OpenAI endpoint the body is for: ``/chat/completions`` or the legacy
``/completions`` (a ``prompt`` instead of ``messages``, ``best_of``)."""


class UpstreamResult(msgspec.Struct, frozen=True, gc=False):
    """A complete (non-streamed) upstream answer: the bytes to relay and what they say."""

    status: int
    body: bytes
    summary: ResponseSummary
    provider_request_id: str | None = None
    # each choice's output tokens, in index order, when the provider knows them (the
    # local engine); never derived from a total
    choice_tokens: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class UpstreamErrorDetail:
    """The upstream's own account of an error, in OpenAI's terms, whatever shape the
    upstream sent it in (OpenAI's envelope, Gemini's ``{"error": {"code": 400,
    "status": "INVALID_ARGUMENT", ...}}``): what the client may be told of a 4xx."""

    message: str
    code: str | None = None
    param: str | None = None


@dataclass(slots=True)
class AttemptFailed(Exception):
    """One attempt failed: the facts, as the provider read them. ``error`` is the
    upstream's own error, normalized into OpenAI's terms (message, code, param) when it
    sent one that could be read. What the facts mean (retry, fall back, the client's
    error, the ledger outcome) is decided by one table, ``ncap.lifecycle.failures``."""

    kind: FailureKind
    status: int | None = None
    retry_after: float | None = None
    error: UpstreamErrorDetail | None = None
    provider_request_id: str | None = None
    detail: str = ""
    # set when part of a stream was already relayed: the attempt cannot be retried
    partial: bool = field(default=False)
    # False when the request provably never left (connection refused): nothing was billed
    dispatched: bool = field(default=True)
    # what the upstream reported despite failing (a blocked prompt's usage), and the most
    # candidates a refusal of n > 1 stated
    usage: Usage | None = None
    max_candidates: int | None = None
    # a timeout at which the provider stopped the work itself and counted what it had
    # used into ``usage`` (the local engine cancels its sequences): nothing is unknown
    cancelled: bool = False

    def __str__(self) -> str:
        return f"{self.kind} {self.status or ''} {self.detail}".strip()


class Provider(Protocol):
    """One route's upstream. ``body`` is the OpenAI-wire body to send (already rewritten
    for the route: upstream model, output ceiling, stream options), for the endpoint
    ``kind`` names; a provider that does not serve that endpoint raises ``InvalidValue``."""

    async def complete(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> UpstreamResult: ...

    def stream(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> AbstractAsyncContextManager[tuple[str | None, AsyncIterator[StreamPiece]]]:
        """Open a stream: yields (provider_request_id, events). Leaving the context
        (client disconnect included) cancels the upstream request."""
        ...

    async def aclose(self) -> None: ...
