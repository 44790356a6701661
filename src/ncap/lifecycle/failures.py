"""What a failed attempt means, in one table: its ledger outcome and the error the
client sees once retries and fallbacks are spent.

Providers normalize their upstream's errors into ``AttemptFailed`` (kind, status,
``UpstreamErrorDetail``): facts only. ``classify`` names the failure's class and
``TABLE`` alone says what it means: the ledger outcome, the client's error, whether
the same route is retried and whether a fallback route may serve. A new provider needs
no change here; it reports its upstream's errors in these terms. A provider's own
refusal raised as an ``NcapError`` (the local engine's queue full, a context overflow)
generated nothing: recorded as such (``as_failure``) and shown to the client as it is.

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
from dataclasses import dataclass
from typing import Literal

import msgspec

from ncap.domain.events import AttemptOutcome
from ncap.errors import (
    InvalidRequest,
    NcapError,
    Overloaded,
    RateLimited,
    RouteDoesNotSupportCandidates,
    SlowDown,
    UpstreamError,
    UpstreamTimeout,
)
from ncap.protocol.responses import SummaryUsage
from ncap.providers.base import AttemptFailed

__all__ = [
    "TABLE",
    "Rule",
    "as_failure",
    "classify",
    "client_error",
    "ledger_outcome",
    "may_fall_back",
    "reported_usage",
    "retryable",
    "stream_cut",
]

FailureClass = Literal[
    "timeout",
    "cancelled",
    "refused",
    "connection",
    "unreadable",
    "oversized",
    "rate_limited",
    "slow_down",
    "overloaded",
    "redirected",
    "request_rejected",
    "candidates_refused",
    "credential_refused",
    "route_misconfigured",
    "retry_4xx",
    "other_4xx",
    "error_answer",
    "other_status",
    "unexpected_status",
]

ClientError = Callable[[AttemptFailed], NcapError]


def _timeout(_: AttemptFailed) -> NcapError:
    return UpstreamTimeout("The upstream did not answer in time.")


def _failed(_: AttemptFailed) -> NcapError:
    return UpstreamError("The upstream failed to answer.")


def _oversized(f: AttemptFailed) -> NcapError:
    return UpstreamError(f"The upstream's answer was larger than the gateway reads ({f.detail}).")


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


def _redirected(f: AttemptFailed) -> NcapError:
    return UpstreamError(
        f"The upstream answered with a redirect (status {f.status}), which is never followed."
    )


def _status(f: AttemptFailed) -> NcapError:
    return UpstreamError(f"The upstream answered with status {f.status}.")


def _candidates(f: AttemptFailed) -> NcapError:
    message = f.error.message if f.error is not None else "The route refused n > 1."
    param = f.error.param if f.error is not None and f.error.param else "n"
    return RouteDoesNotSupportCandidates(message, param=param)


def _credential(_: AttemptFailed) -> NcapError:
    return UpstreamError("The upstream provider refused the gateway's credential for this route.")


def _misconfigured(f: AttemptFailed) -> NcapError:
    said = f.error.message if f.error is not None else f"status {f.status}"
    return UpstreamError(f"The route's upstream rejected its configuration ({said}).")


@dataclass(frozen=True, slots=True)
class Rule:
    """What one failure class means: its ledger row, the client's error, whether the
    same route is tried again, and whether the next route of the chain may serve once
    this one gives up (a retryable failure always moves on)."""

    outcome: AttemptOutcome
    client: ClientError
    retry: bool
    fallback: bool


TABLE: dict[FailureClass, Rule] = {
    "timeout": Rule("timeout", _timeout, retry=True, fallback=True),
    # a timeout whose provider cancelled the work and counted it (the local engine):
    # the same route would take as long again; another route may serve
    "cancelled": Rule("cancelled", _timeout, retry=False, fallback=True),
    # never left: nothing was generated or billed
    "refused": Rule("rejected", _failed, retry=True, fallback=True),
    "connection": Rule("connection_error", _failed, retry=True, fallback=True),
    "unreadable": Rule("upstream_error", _failed, retry=False, fallback=False),
    # past the route's answer bound: it generated (and may bill) what it sent
    "oversized": Rule("upstream_error", _oversized, retry=False, fallback=False),
    "rate_limited": Rule("rejected", _rate_limited, retry=True, fallback=True),
    "slow_down": Rule("rejected", _slow_down, retry=True, fallback=True),
    "overloaded": Rule("rejected", _overloaded, retry=True, fallback=True),
    # a 3xx: never followed (the credential and prompt would go to another origin); the
    # route's own retry would be redirected again, another route may serve
    "redirected": Rule("rejected", _redirected, retry=False, fallback=True),
    # the request's own fault (400/404/422): the upstream's message, no other route
    "request_rejected": Rule("rejected", _relayed, retry=False, fallback=False),
    # the route's limits, not the request's fault: another route may serve
    "candidates_refused": Rule("rejected", _candidates, retry=False, fallback=True),
    "credential_refused": Rule("rejected", _credential, retry=False, fallback=True),
    "route_misconfigured": Rule("rejected", _misconfigured, retry=False, fallback=True),
    "retry_4xx": Rule("rejected", _status, retry=True, fallback=True),  # 408, 409
    "other_4xx": Rule("rejected", _status, retry=False, fallback=False),
    # the contract: error answers are unbilled
    "error_answer": Rule("unbilled_error", _status, retry=True, fallback=True),
    "other_status": Rule("upstream_error", _status, retry=True, fallback=True),  # 5xx
    # neither an answer nor an error status (a 2xx other than 200)
    "unexpected_status": Rule("upstream_error", _status, retry=False, fallback=False),
}
"""Failure class → what it means. A refusal (3xx, 429, 503, any 4xx) is an attempt that
generated nothing, and so is an error answer on an ``unbilled`` route; anything else
may have."""


def classify(f: AttemptFailed, *, unbilled_errors: bool = False) -> FailureClass:
    """The failure's class; ``unbilled_errors`` is the route's ``error_responses ==
    "unbilled"`` (without it, an error answer is an unknown)."""
    if f.kind == "timeout":
        return "cancelled" if f.cancelled and f.usage is not None else "timeout"
    if f.kind == "connection":
        return "connection" if f.dispatched else "refused"
    if f.kind == "oversized":
        return "oversized"
    if f.kind == "protocol" or f.status is None:
        return "unreadable"
    cls = _status_class(f.status, f.error.code if f.error is not None else None)
    if cls == "other_status" and unbilled_errors and f.error is not None:
        return "error_answer"
    return cls


def _status_class(status: int, code: str | None) -> FailureClass:
    if 300 <= status < 400:
        return "redirected"
    if status == 429:
        return "rate_limited" if code == "rate_limit_exceeded" else "slow_down"
    if status in (503, 529):  # 529: Anthropic's overloaded_error
        return "overloaded"
    if code in _CODE_CLASSES and 400 <= status < 500:
        return _CODE_CLASSES[code]
    if status in (401, 403):
        return "credential_refused"
    if status in (400, 404, 422):
        return "request_rejected"
    if status in (408, 409):
        return "retry_4xx"
    if 400 <= status < 500:
        return "other_4xx"
    return "other_status" if status >= 500 else "unexpected_status"


_CODE_CLASSES: dict[str, FailureClass] = {
    "route_does_not_support_candidates": "candidates_refused",
    "invalid_api_key": "credential_refused",
    "route_misconfigured": "route_misconfigured",
}


def retryable(f: AttemptFailed) -> bool:
    """Whether the same route may be tried again: never once part of a stream was
    relayed, else as the table says."""
    return not f.partial and TABLE[classify(f)].retry


def may_fall_back(f: AttemptFailed) -> bool:
    """Whether the next route of the chain may serve after this failure."""
    return TABLE[classify(f)].fallback


def ledger_outcome(f: AttemptFailed, *, unbilled_errors: bool = False) -> AttemptOutcome:
    return TABLE[classify(f, unbilled_errors=unbilled_errors)].outcome


def reported_usage(f: AttemptFailed) -> SummaryUsage | None:
    """The usage a refusal reported (a blocked prompt's prompt tokens), or that a
    provider counted when it cancelled its own work at the timeout (the local engine),
    which its row is settled at; None for any other failure (which reports none: zero
    for a refusal, unknown otherwise, as ``TABLE`` says)."""
    if f.usage is None or ledger_outcome(f) not in ("rejected", "cancelled"):
        return None
    return msgspec.convert(msgspec.to_builtins(f.usage), SummaryUsage)


def client_error(f: AttemptFailed) -> NcapError:
    """The error the client gets once retries and fallbacks are spent."""
    return TABLE[classify(f)].client(f)


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
