"""Gemini's errors in, ncap's out: a non-200 answer, an error event or an unreadable
body becomes one normalized ``GeminiError`` (what Gemini meant, in OpenAI's terms), and
``as_attempt_failed`` states it as the facts the failure table classifies.

- a 400 refusing several candidates becomes ``route_does_not_support_candidates`` with
  the maximum the message states; the input-too-long 400 ``context_length_exceeded``;
- a credential refused, an unknown model or a billing precondition is the route's
  fault, never the client's; 429, 503 and 504 keep their meaning.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from ncap.errors import (
    ContextLengthExceeded,
    InvalidValue,
    NcapError,
    Overloaded,
    RateLimitExceeded,
    RouteDoesNotSupportCandidates,
    UpstreamError,
    UpstreamTimeout,
)
from ncap.protocol import gemini as g
from ncap.protocol.responses import Usage
from ncap.providers.base import AttemptFailed, UpstreamErrorDetail

__all__ = [
    "GeminiError",
    "GeminiErrorKind",
    "as_attempt_failed",
    "from_google",
    "gemini_failure",
    "protocol_error",
    "translate_error",
]

_decode_error = msgspec.json.Decoder(g.GoogleErrorEnvelope).decode

GeminiErrorKind = Literal[
    "invalid",  # the request is at fault: relayed as 400 invalid_value
    "context",  # the prompt is too long: 400 context_length_exceeded
    "blocked",  # the prompt was blocked by safety filters: 400 content_filter
    "candidates",  # n > 1 refused: 400 route_does_not_support_candidates
    "rate_limit",  # 429 RESOURCE_EXHAUSTED
    "overloaded",  # 503 UNAVAILABLE
    "timeout",  # 504 DEADLINE_EXCEEDED
    "auth",  # the route's credential was refused: 502, not the client's fault
    "route",  # the route is misconfigured (unknown model, billing): 502
    "upstream",  # 5xx, HTML error pages, anything else: 502
    "protocol",  # a 200 whose body is not what Gemini sends: 502
]

# kind -> (the client's error class, retryable on the same route)
_KINDS: dict[str, tuple[type[NcapError], bool]] = {
    "invalid": (InvalidValue, False),
    "context": (ContextLengthExceeded, False),
    "blocked": (InvalidValue, False),
    "candidates": (RouteDoesNotSupportCandidates, False),
    "rate_limit": (RateLimitExceeded, True),
    "overloaded": (Overloaded, True),
    "timeout": (UpstreamTimeout, True),
    "auth": (UpstreamError, False),
    "route": (UpstreamError, False),
    "upstream": (UpstreamError, True),
    "protocol": (UpstreamError, False),
}
_CLIENT_FAULTS = frozenset({"invalid", "context", "blocked"})


@dataclass(slots=True)
class GeminiError(Exception):
    """One Gemini failure, normalized: what the client is told and whether to retry.

    ``client_fault`` failures are the request's own (no retry, no fallback); the others
    are the route's (a fallback may serve). ``max_candidates`` is set on a candidates
    refusal: the most the provider says it accepts (1 unless the message states a
    range). ``upstream_message`` is the provider's own text, for logs."""

    kind: GeminiErrorKind
    upstream_status: int | None
    message: str
    param: str | None = None
    retry_after: float | None = None
    provider_request_id: str | None = None
    max_candidates: int | None = None
    upstream_message: str = ""
    usage: Usage | None = field(default=None)

    @property
    def error_class(self) -> type[NcapError]:
        return _KINDS[self.kind][0]

    @property
    def status(self) -> int:
        return self.error_class.status

    @property
    def code(self) -> str | None:
        return "content_filter" if self.kind == "blocked" else self.error_class.code

    @property
    def retryable(self) -> bool:
        return _KINDS[self.kind][1]

    @property
    def client_fault(self) -> bool:
        return self.kind in _CLIENT_FAULTS

    def as_ncap_error(self) -> NcapError:
        """The error the client receives (OpenAI's envelope via the edge handler)."""
        code = "content_filter" if self.kind == "blocked" else None
        return self.error_class(
            self.message, param=self.param, retry_after=self.retry_after, code=code
        )

    def __str__(self) -> str:
        return f"gemini {self.kind} {self.upstream_status or ''} {self.upstream_message}".strip()


_RANGE = re.compile(r"candidate_?count.*?to (\d+) \(exclusive\)", re.IGNORECASE | re.DOTALL)
_MUST_BE = re.compile(r"candidate_?count must be (\d+)", re.IGNORECASE)
_REFUSES = re.compile(
    r"multiple candidates is not enabled|only one candidate|candidate_?count", re.IGNORECASE
)
_TOO_LONG = re.compile(r"input token count.*exceeds the maximum", re.IGNORECASE | re.DOTALL)
_DELAY = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s*$")


def _refused_maximum(message: str) -> int | None:
    """The most candidates a 400 says the model accepts, or None when the 400 is not a
    refusal of the candidate count. Known wordings: "Multiple candidates is not enabled
    for this model", "candidateCount must be 1 but the entered value was 3", "…supported
    range is from 1 (inclusive) to 9 (exclusive)", "Only one candidate can be
    specified"."""
    if not _REFUSES.search(message):
        return None
    if (match := _RANGE.search(message)) is not None:
        return max(1, int(match.group(1)) - 1)
    if (match := _MUST_BE.search(message)) is not None:
        return max(1, int(match.group(1)))
    return 1


def _retry_delay(error: g.GoogleError, header: str | None) -> float | None:
    """``RetryInfo.retryDelay`` ("17s") in the error's details, else ``Retry-After``."""
    for detail in error.details:
        if detail.retry_delay and (match := _DELAY.match(detail.retry_delay)):
            return float(match.group(1))
    if header is not None:
        try:
            return max(0.0, float(header))
        except ValueError:
            return None
    return None


def _parse_error(body: bytes) -> g.GoogleError | None:
    try:
        return _decode_error(body).error
    except msgspec.DecodeError:
        return None


def translate_error(
    status: int,
    body: bytes,
    *,
    retry_after: str | None = None,
    provider_request_id: str | None = None,
) -> GeminiError:
    """A non-200 Gemini answer as a ``GeminiError`` (``retry_after``: the raw
    ``Retry-After`` header, used only when the body has no ``RetryInfo``)."""
    error = _parse_error(body)
    if error is None:
        return GeminiError(
            "upstream",
            status,
            f"The upstream provider failed (HTTP {status}).",
            retry_after=_header_delay(retry_after),
            provider_request_id=provider_request_id,
            upstream_message=body[:200].decode("utf-8", "replace"),
        )
    return from_google(status, error, retry_after, provider_request_id)


def from_google(
    status: int, error: g.GoogleError, retry_after: str | None, provider_request_id: str | None
) -> GeminiError:
    kind, message, param, maximum = _classify(status, error)
    return GeminiError(
        kind,
        status,
        message,
        param=param,
        retry_after=_retry_delay(error, retry_after) if _KINDS[kind][1] else None,
        provider_request_id=provider_request_id,
        max_candidates=maximum,
        upstream_message=error.message,
    )


def _header_delay(header: str | None) -> float | None:
    return _retry_delay(g.GoogleError(), header)


def _classify(
    status: int, error: g.GoogleError
) -> tuple[GeminiErrorKind, str, str | None, int | None]:
    """(kind, client message, param, max candidates) for a Google error envelope."""
    upstream = error.message or error.status or f"HTTP {status}"
    reasons = {d.reason for d in error.details if d.reason}
    if status in (401, 403) or reasons & {"API_KEY_INVALID", "API_KEY_SERVICE_BLOCKED"}:
        return (
            "auth",
            "The upstream provider refused the gateway's credential for this route.",
            None,
            None,
        )
    if status == 400 and error.status in (None, "INVALID_ARGUMENT"):
        maximum = _refused_maximum(upstream)
        if maximum is not None:
            message = (
                f"The route's provider refused n > 1 (Upstream: {upstream}); it accepts at "
                f"most {maximum} candidate(s). Send n <= {maximum}."
            )
            return "candidates", message, "n", maximum
        if _TOO_LONG.search(upstream):
            return "context", f"Upstream: {upstream}", "messages", None
        return "invalid", f"Upstream: {upstream}", None, None
    return _by_status(status, upstream)


def _by_status(status: int, upstream: str) -> tuple[GeminiErrorKind, str, str | None, int | None]:
    if status == 429:
        return "rate_limit", "The upstream provider's quota is exhausted; retry later.", None, None
    if status == 503:
        return (
            "overloaded",
            "The upstream model is overloaded; retry after a brief delay.",
            None,
            None,
        )
    if status == 504:
        return "timeout", "The upstream provider timed out.", None, None
    if status in (400, 404):  # FAILED_PRECONDITION, NOT_FOUND: the route, not the request
        return "route", f"The route's upstream rejected its configuration ({upstream}).", None, None
    return "upstream", f"The upstream provider failed (HTTP {status}).", None, None


def protocol_error(
    message: str, upstream_message: str, provider_request_id: str | None = None
) -> GeminiError:
    """A 200 whose body is not what Gemini sends (``message``: the client's words)."""
    return GeminiError(
        "protocol",
        200,
        message,
        provider_request_id=provider_request_id,
        upstream_message=upstream_message,
    )


def gemini_failure(status: int, headers: Mapping[str, str], payload: bytes) -> AttemptFailed:
    """A non-200 Gemini answer, normalized once."""
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
