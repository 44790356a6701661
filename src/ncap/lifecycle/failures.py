"""What a failed attempt means, in one table: its ledger outcome and the error the
client sees once retries and fallbacks are spent (SPEC §3.2, §6).

Providers normalize their upstream's errors into ``AttemptFailed`` (kind, status,
``UpstreamErrorDetail``); ``classify`` names the failure's row and ``TABLE`` says the
rest, so a new provider needs no change here. A provider's own refusal raised as an
``NcapError`` (the local engine's queue full, a context overflow) generated nothing:
recorded as such (``as_failure``) and shown to the client as it is.

A refusal the upstream reports usage for (Gemini's blocked prompt: a 200 whose
``promptFeedback.blockReason`` refused it before any candidate, with
``usageMetadata.promptTokenCount``) is still ``rejected`` (nothing generated, no retry,
the client's 400 ``content_filter``), but ``reported_usage`` hands the settlement the
usage it reported: the row is ``settled`` at those tokens and their cost, and the hold
is settled with them rather than released. Without a report, a refusal settles at zero.

A well-formed error answer (a 5xx other than 503 whose body the provider could read
as an error envelope) is an answer, not an unknown, when the route's contract says
``error_responses: unbilled``: class ``error_answer``, settled at zero. Without the
envelope (an HTML 502, no body) or with ``unknown`` it stays ``other_status``: held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec

from ncap.domain.events import AttemptOutcome
from ncap.errors import (
    InvalidRequest,
    NcapError,
    Overloaded,
    RateLimited,
    SlowDown,
    UpstreamError,
    UpstreamTimeout,
)
from ncap.protocol.responses import SummaryUsage
from ncap.providers.base import AttemptFailed

__all__ = [
    "TABLE",
    "as_failure",
    "classify",
    "client_error",
    "ledger_outcome",
    "reported_usage",
    "stream_cut",
]

FailureClass = Literal[
    "timeout",
    "refused",
    "connection",
    "unreadable",
    "rate_limited",
    "slow_down",
    "overloaded",
    "request_rejected",
    "other_4xx",
    "error_answer",
    "other_status",
]

ClientError = Callable[[AttemptFailed], NcapError]


def _timeout(_: AttemptFailed) -> NcapError:
    return UpstreamTimeout("The upstream did not answer in time.")


def _failed(_: AttemptFailed) -> NcapError:
    return UpstreamError("The upstream failed to answer.")


def _rate_limited(f: AttemptFailed) -> NcapError:
    return RateLimited("The upstream rate limit was reached.", retry_after=f.retry_after)


def _slow_down(f: AttemptFailed) -> NcapError:
    return SlowDown(
        "Your request rate increased too quickly upstream. Please back off.",
        retry_after=f.retry_after,
    )


def _overloaded(f: AttemptFailed) -> NcapError:
    return Overloaded(
        "The model is temporarily overloaded. Please retry your request after a brief delay.",
        retry_after=f.retry_after,
    )


def _relayed(f: AttemptFailed) -> NcapError:
    """An upstream's own 4xx about the request: keep its message, code and param."""
    if f.error is None:
        return UpstreamError(f"The upstream rejected the request (status {f.status}).")
    err = f.error
    return InvalidRequest(f"Upstream: {err.message}", param=err.param, code=err.code)


def _status(f: AttemptFailed) -> NcapError:
    return UpstreamError(f"The upstream answered with status {f.status}.")


TABLE: dict[FailureClass, tuple[AttemptOutcome, ClientError]] = {
    "timeout": ("timeout", _timeout),
    "refused": ("rejected", _failed),  # never left: nothing was generated or billed
    "connection": ("connection_error", _failed),
    "unreadable": ("upstream_error", _failed),  # a malformed answer, or no status
    "rate_limited": ("rejected", _rate_limited),
    "slow_down": ("rejected", _slow_down),
    "overloaded": ("rejected", _overloaded),
    "request_rejected": ("rejected", _relayed),  # 400/404/422
    "other_4xx": ("rejected", _status),
    "error_answer": ("unbilled_error", _status),  # the contract: error answers are unbilled
    "other_status": ("upstream_error", _status),
}
"""Failure class → (ledger outcome, client error). A refusal (429, 503, any 4xx) is an
attempt that generated nothing, and so is an error answer on an ``unbilled`` route;
anything else may have."""


def classify(f: AttemptFailed, *, unbilled_errors: bool = False) -> FailureClass:
    """The failure's class; ``unbilled_errors`` is the route's ``error_responses ==
    "unbilled"`` (without it, an error answer is an unknown)."""
    if f.kind == "timeout":
        return "timeout"
    if f.kind == "connection":
        return "connection" if f.dispatched else "refused"
    if f.kind == "protocol" or f.status is None:
        return "unreadable"
    cls = _status_class(f.status, f.error.code if f.error is not None else None)
    if cls == "other_status" and unbilled_errors and f.error is not None and f.status >= 500:
        return "error_answer"
    return cls


def _status_class(status: int, code: str | None) -> FailureClass:
    if status == 429:
        return "rate_limited" if code == "rate_limit_exceeded" else "slow_down"
    if status in (503, 529):  # 529: Anthropic's overloaded_error
        return "overloaded"
    if status in (400, 404, 422):
        return "request_rejected"
    return "other_4xx" if 400 <= status < 500 else "other_status"


def ledger_outcome(f: AttemptFailed, *, unbilled_errors: bool = False) -> AttemptOutcome:
    return TABLE[classify(f, unbilled_errors=unbilled_errors)][0]


def reported_usage(f: AttemptFailed) -> SummaryUsage | None:
    """The usage a refusal reported (a blocked prompt's prompt tokens), which its row is
    settled at; None for any other failure (which reports none: zero for a refusal,
    unknown otherwise, as ``TABLE`` says)."""
    if f.usage is None or ledger_outcome(f) != "rejected":
        return None
    return msgspec.convert(msgspec.to_builtins(f.usage), SummaryUsage)


def client_error(f: AttemptFailed) -> NcapError:
    """The provider's own account of the client's error wins (it knows its upstream)."""
    return f.client if f.client is not None else TABLE[classify(f)][1](f)


def as_failure(exc: AttemptFailed | NcapError) -> AttemptFailed:
    """A provider's own refusal as the attempt's failure (the client still gets ``exc``)."""
    if isinstance(exc, AttemptFailed):
        return exc
    return AttemptFailed("status", exc.status, dispatched=False, detail=str(exc.code))


def stream_cut(exc: AttemptFailed | NcapError) -> tuple[str, NcapError]:
    """Why a relayed stream was cut mid-way, and the error event that ends it."""
    if isinstance(exc, AttemptFailed):
        cut = "upstream_reset" if exc.kind != "protocol" else "malformed_stream"
        return cut, UpstreamError("The upstream stream failed mid-way.")
    return "upstream_error", exc  # a local provider's own error mid-stream
