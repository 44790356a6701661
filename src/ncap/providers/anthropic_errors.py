"""Anthropic's errors in, ncap's out: a non-200 answer or a stream's ``error`` event as
the facts the one failure table classifies (its status: 529 ``overloaded_error`` stays
529; the retry delay; Anthropic's message with the OpenAI code it amounts to). Nothing
here decides retry, fallback or the client's error."""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from ncap.protocol import anthropic as a
from ncap.providers.base import AttemptFailed, UpstreamErrorDetail
from ncap.providers.transport import parse_retry_after

__all__ = ["ERROR_STATUS", "anthropic_failure", "stream_failure"]

_decode_error = msgspec.json.Decoder(a.AnthropicErrorEnvelope).decode
_CONTEXT = re.compile(r"prompt is too long|context window|too many tokens", re.IGNORECASE)

ERROR_STATUS: dict[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}
"""Anthropic's error ``type`` → the HTTP status it comes with (a stream's ``error``
event has no status of its own)."""


def anthropic_failure(status: int, headers: Mapping[str, str], payload: bytes) -> AttemptFailed:
    """A non-200 answer, as facts: its status (529 ``overloaded_error`` stays 529), the
    retry delay, and Anthropic's message with the OpenAI code it amounts to."""
    body = _error_body(payload)
    return AttemptFailed(
        "status",
        status,
        retry_after=parse_retry_after(headers),
        error=_detail(status, body) if body is not None else None,
        provider_request_id=headers.get("request-id"),
        detail=body.type if body is not None else "",
    )


def stream_failure(error: a.AnthropicErrorBody | None) -> AttemptFailed:
    """A stream's ``error`` event: the status its type comes with, the same facts."""
    body = error or a.AnthropicErrorBody()
    status = ERROR_STATUS.get(body.type, 500)
    return AttemptFailed("status", status, error=_detail(status, body), detail=body.type)


def _error_body(payload: bytes) -> a.AnthropicErrorBody | None:
    try:
        return _decode_error(payload).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _detail(status: int, body: a.AnthropicErrorBody) -> UpstreamErrorDetail:
    """OpenAI's code for what Anthropic said: a rate limit, a prompt over the context
    window, or none (the message says it)."""
    code: str | None = None
    if status == 429 or body.type == "rate_limit_error":
        code = "rate_limit_exceeded"
    elif status == 400 and _CONTEXT.search(body.message):
        code = "context_length_exceeded"
    return UpstreamErrorDetail(body.message or body.type, code=code)
