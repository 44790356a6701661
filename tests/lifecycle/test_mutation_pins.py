"""Pins found by mutation testing (docs/mutation.md): what each failure class tells the
client, word for word, with its retry delay; the lifecycle's fast, socket-free killers
of mutants the wider lifecycle tests let through."""

from __future__ import annotations

from typing import Any

import pytest

from ncap.domain.reservation import Reservation
from ncap.errors import InvalidRequest, Overloaded, RateLimited, SlowDown, UpstreamError
from ncap.lifecycle.failures import client_error
from ncap.lifecycle.reports import summed_usage
from ncap.lifecycle.settle import _whole_need
from ncap.protocol.responses import SummaryUsage, SummaryUsageDetails
from ncap.providers.base import AttemptFailed, UpstreamErrorDetail

RATE = UpstreamErrorDetail("Rate limit reached", code="rate_limit_exceeded")

EXACT: list[tuple[AttemptFailed, type, str, float | None]] = [
    (AttemptFailed("status", 429, retry_after=3.0, error=RATE), RateLimited,
     "The upstream rate limit was reached.", 3.0),
    (AttemptFailed("status", 429, retry_after=2.5), SlowDown,
     "Your request rate increased too quickly upstream. Please back off.", 2.5),
    (AttemptFailed("status", 503, retry_after=1.5), Overloaded,
     "The model is temporarily overloaded. Please retry your request after a brief delay.",
     1.5),
    (AttemptFailed("status", 404), UpstreamError,
     "The upstream rejected the request (status 404).", None),
    (AttemptFailed("status", 403), UpstreamError, "The upstream answered with status 403.", None),
    (AttemptFailed("timeout"), UpstreamError, "The upstream did not answer in time.", None),
    (AttemptFailed("connection"), UpstreamError, "The upstream failed to answer.", None),
]  # fmt: skip


@pytest.mark.parametrize(("failure", "kind", "message", "retry_after"), EXACT)
def test_each_client_error_word_for_word(
    failure: AttemptFailed, kind: type, message: str, retry_after: float | None
) -> None:
    error = client_error(failure)
    assert isinstance(error, kind)
    assert (error.message, error.retry_after) == (message, retry_after)


def test_a_relayed_400_without_param_or_code() -> None:
    error = client_error(AttemptFailed("status", 422, error=UpstreamErrorDetail("Nope")))
    assert isinstance(error, InvalidRequest)
    assert (error.message, error.param, error.code) == ("Upstream: Nope", None, "invalid_value")


def _usage(prompt: int | None, completion: int | None, cached: int | None = None) -> SummaryUsage:
    details = SummaryUsageDetails(cached_tokens=cached) if cached is not None else None
    return SummaryUsage(prompt, completion, prompt_tokens_details=details)


SUMS: list[tuple[list[SummaryUsage | None], dict[str, Any] | None]] = [
    ([_usage(3, 4), _usage(3, 5)],
     {"prompt_tokens": 6, "completion_tokens": 9, "total_tokens": 15}),
    ([_usage(3, 4, cached=2), _usage(3, 5), _usage(3, 1, cached=3)],
     {"prompt_tokens": 9, "completion_tokens": 10, "total_tokens": 19,
      "prompt_tokens_details": {"cached_tokens": 5}}),
    ([_usage(3, 4), _usage(3, None)], None),  # one count missing: the total is unknown
    ([_usage(None, 4), _usage(3, 4)], None),
    ([_usage(3, 4), None], None),
]  # fmt: skip


@pytest.mark.parametrize(("usages", "expected"), SUMS)
def test_summed_usage(usages: list[SummaryUsage | None], expected: dict[str, Any] | None) -> None:
    assert summed_usage(usages) == expected


WHOLE = Reservation(input_tokens=10, output_tokens=30, cost_micros=777)


@pytest.mark.parametrize(
    ("window", "need"),
    [("tokens_per_day", 40), ("tokens_per_minute", 40), ("usd_per_day", 777),
     ("usd_per_month", 777), ("exception", 777), ("requests_per_minute", 3),
     ("concurrency", 3)],
)  # fmt: skip
def test_a_denied_emulated_request_names_what_the_whole_fan_out_needed(
    window: str, need: int
) -> None:
    assert _whole_need(window, WHOLE, 3) == need
