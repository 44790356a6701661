"""One table: a failed attempt → its ledger outcome and the client's error."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from ncap.errors import NcapError, Overloaded
from ncap.lifecycle.failures import (
    TABLE,
    as_failure,
    classify,
    client_error,
    ledger_outcome,
    reported_usage,
    retryable,
    stream_cut,
)
from ncap.protocol.responses import SummaryUsage, Usage
from ncap.providers.base import AttemptFailed, UpstreamErrorDetail
from ncap.providers.openai_passthrough import openai_failure

RATE = UpstreamErrorDetail("Rate limit reached", code="rate_limit_exceeded")
BAD = UpstreamErrorDetail("Invalid 'messages'", code="invalid_value", param="messages")
REFUSED_N = UpstreamErrorDetail("at most 1", code="route_does_not_support_candidates", param="n")
MISCONFIGURED = UpstreamErrorDetail("model not found", code="route_misconfigured")

CASES: list[tuple[AttemptFailed, str, str, int, str | None]] = [
    # failure, class, ledger outcome, client status, client code
    (AttemptFailed("timeout"), "timeout", "timeout", 504, "upstream_timeout"),
    # a provider that cancelled its own work at the timeout and counted it (local engine)
    (
        AttemptFailed("timeout", usage=Usage(3, 5, 8), cancelled=True),
        "cancelled",
        "cancelled",
        504,
        "upstream_timeout",
    ),
    (AttemptFailed("connection", dispatched=False), "refused", "rejected", 502, "upstream_error"),
    (AttemptFailed("connection"), "connection", "connection_error", 502, "upstream_error"),
    (AttemptFailed("protocol", 200), "unreadable", "upstream_error", 502, "upstream_error"),
    (AttemptFailed("status"), "unreadable", "upstream_error", 502, "upstream_error"),
    (
        AttemptFailed("status", 429, error=RATE),
        "rate_limited",
        "rejected",
        429,
        "rate_limit_exceeded",
    ),
    (AttemptFailed("status", 429), "slow_down", "rejected", 429, "slow_down"),
    (AttemptFailed("status", 503), "overloaded", "rejected", 503, "server_is_overloaded"),
    (AttemptFailed("status", 400, error=BAD), "request_rejected", "rejected", 400, "invalid_value"),
    (AttemptFailed("status", 422), "request_rejected", "rejected", 502, "upstream_error"),
    (AttemptFailed("status", 403), "credential_refused", "rejected", 502, "upstream_error"),
    (AttemptFailed("status", 413), "other_4xx", "rejected", 502, "upstream_error"),
    (AttemptFailed("status", 408), "retry_4xx", "rejected", 502, "upstream_error"),
    (AttemptFailed("status", 529), "overloaded", "rejected", 503, "server_is_overloaded"),
    (
        AttemptFailed("status", 400, error=REFUSED_N),
        "candidates_refused",
        "rejected",
        400,
        "route_does_not_support_candidates",
    ),
    (
        AttemptFailed("status", 404, error=MISCONFIGURED),
        "route_misconfigured",
        "rejected",
        502,
        "upstream_error",
    ),
    (AttemptFailed("status", 500), "other_status", "upstream_error", 502, "upstream_error"),
    (AttemptFailed("status", 204), "unexpected_status", "upstream_error", 502, "upstream_error"),
    # a redirect is never followed; an answer past its bound is not read on
    (AttemptFailed("status", 307), "redirected", "rejected", 502, "upstream_error"),
    (AttemptFailed("status", 301), "redirected", "rejected", 502, "upstream_error"),
    (AttemptFailed("oversized", 200), "oversized", "upstream_error", 502, "upstream_error"),
]


@pytest.mark.parametrize(("failure", "cls", "outcome", "status", "code"), CASES)
def test_one_table_maps_each_failure(
    failure: AttemptFailed, cls: str, outcome: str, status: int, code: str | None
) -> None:
    assert classify(failure) == cls
    assert ledger_outcome(failure) == outcome
    error = client_error(failure)
    assert (error.status, error.code) == (status, code)


ENVELOPE = UpstreamErrorDetail("The server had an error", code=None)

UNBILLED_CASES: list[tuple[AttemptFailed, str, str]] = [
    # on a route whose contract says error_responses: unbilled
    (AttemptFailed("status", 500, error=ENVELOPE), "error_answer", "unbilled_error"),
    (AttemptFailed("status", 502, error=ENVELOPE), "error_answer", "unbilled_error"),
    # no envelope (an HTML 502, an empty body): nobody said nothing was generated
    (AttemptFailed("status", 502), "other_status", "upstream_error"),
    # still ambiguous whatever the contract says
    (AttemptFailed("timeout"), "timeout", "timeout"),
    (AttemptFailed("connection"), "connection", "connection_error"),
    (AttemptFailed("protocol", 200), "unreadable", "upstream_error"),
    # the other classes do not change
    (AttemptFailed("status", 503, error=ENVELOPE), "overloaded", "rejected"),
    (AttemptFailed("status", 400, error=BAD), "request_rejected", "rejected"),
]


@pytest.mark.parametrize(("failure", "cls", "outcome"), UNBILLED_CASES)
def test_an_error_answer_on_an_unbilled_route_is_an_answer(
    failure: AttemptFailed, cls: str, outcome: str
) -> None:
    assert classify(failure, unbilled_errors=True) == cls
    assert ledger_outcome(failure, unbilled_errors=True) == outcome
    # the client's error does not depend on the contract
    shown, table = client_error(failure), TABLE[cls].client(failure)
    assert (shown.status, shown.code, shown.message) == (table.status, table.code, table.message)


def test_an_error_answer_on_an_unknown_route_stays_an_unknown() -> None:
    failure = AttemptFailed("status", 500, error=ENVELOPE)
    assert classify(failure) == "other_status"
    assert ledger_outcome(failure, unbilled_errors=False) == "upstream_error"


def test_every_class_has_a_row() -> None:
    classes = {c for _, c, *_ in CASES} | {c for _, c, _ in UNBILLED_CASES}
    assert classes == set(TABLE)


def test_a_relayed_400_keeps_message_and_param() -> None:
    error = client_error(AttemptFailed("status", 400, error=BAD))
    assert error.envelope()["error"] == {
        "message": "Upstream: Invalid 'messages'",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "invalid_value",
    }


def _gemini_failure(status: int, payload: bytes) -> AttemptFailed:
    """How a provider with Gemini's error shape normalizes it (no OpenAI decoding)."""
    err: dict[str, Any] = msgspec.json.decode(payload)["error"]
    detail = UpstreamErrorDetail(err["message"], code=str(err["status"]).lower())
    return AttemptFailed("status", status, error=detail)


def test_a_non_openai_error_shape_is_relayed_as_a_400() -> None:
    gemini = b'{"error": {"code": 400, "status": "INVALID_ARGUMENT", "message": "bad role"}}'
    error = client_error(_gemini_failure(400, gemini))
    assert (error.status, error.code, str(error)) == (400, "invalid_argument", "Upstream: bad role")
    # the same body read as OpenAI's envelope does not decode: a generic 502
    assert client_error(openai_failure(400, {}, gemini)).status == 502


def test_openai_failure_reads_the_envelope_once() -> None:
    payload = (
        b'{"error": {"message": "slow", "type": "x", "param": null, "code": "rate_limit_exceeded"}}'
    )
    failure = openai_failure(429, {"retry-after-ms": "250", "x-request-id": "up-9"}, payload)
    assert failure.error == UpstreamErrorDetail("slow", code="rate_limit_exceeded")
    assert (failure.retry_after, failure.provider_request_id, retryable(failure)) == (
        0.25,
        "up-9",
        True,
    )


def test_a_providers_own_refusal_is_recorded_as_rejected_and_shown_as_is() -> None:
    own = Overloaded("queue full")
    assert ledger_outcome(as_failure(own)) == "rejected"
    assert stream_cut(own) == ("upstream_error", own)


@pytest.mark.parametrize(
    ("failure", "cut"),
    [
        (AttemptFailed("connection", partial=True), "upstream_reset"),
        (AttemptFailed("protocol", 200), "malformed_stream"),
    ],
)
def test_mid_stream_failures(failure: AttemptFailed, cut: str) -> None:
    reason, error = stream_cut(failure)
    assert reason == cut and isinstance(error, NcapError) and error.status == 502


# -- what a refusal reported (Gemini's blocked prompt), pinned for mutation testing ------

BLOCKED_USAGE = Usage(completion_tokens=0, prompt_tokens=12, total_tokens=12)


def test_a_refusal_that_reported_usage_hands_it_over_as_is() -> None:
    blocked = AttemptFailed("status", 400, error=BAD, usage=BLOCKED_USAGE)
    assert ledger_outcome(blocked) == "rejected"
    assert reported_usage(blocked) == SummaryUsage(
        prompt_tokens=12, completion_tokens=0, total_tokens=12
    )


@pytest.mark.parametrize(
    "failure",
    [
        AttemptFailed("status", 400, error=BAD),  # a refusal that reported nothing
        AttemptFailed("timeout", usage=BLOCKED_USAGE),  # not a refusal: its usage is unknown
        AttemptFailed("status", 500, usage=BLOCKED_USAGE),
    ],
)
def test_no_other_failure_reports_usage(failure: AttemptFailed) -> None:
    assert reported_usage(failure) is None


def test_a_timeout_the_provider_cancelled_hands_over_what_it_counted() -> None:
    cancelled = AttemptFailed("timeout", usage=BLOCKED_USAGE, cancelled=True)
    assert ledger_outcome(cancelled) == "cancelled"
    assert reported_usage(cancelled) == SummaryUsage(
        prompt_tokens=12, completion_tokens=0, total_tokens=12
    )
    assert ledger_outcome(AttemptFailed("timeout", cancelled=True)) == "timeout"  # no count
