"""Budget windows and the admission rule every budget backend applies.

Two-phase budgets: the caller estimates conservatively (``reservation.py``), a store
reserves atomically against *every* window or none (``admit`` below, run inside the
store's critical section), and the attempt later settles with actual usage.

Windows are fixed UTC buckets: the minute (``2026-11-29T10:15``), the day
(``2026-11-29``) and the calendar month (``2026-11``); an exception's ``budget_usd``
spans its whole life; concurrency counts held slots. Fixed buckets are what a Redis
script can keep exactly, at the price of allowing up to twice a per-minute limit
across a minute boundary. When several windows refuse, the error that retrying
cannot fix wins (budgets first), so a client is never told to retry into a wall.
Each refusal names its window (``Refusal``: the window, its limit, the amount that did
not fit, in the window's unit) for the denial row and ``ncap_budget_exhausted_total``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import msgspec

from ncap.config import ExceptionGrant, Workload
from ncap.domain.instants import bucket_keys
from ncap.domain.money import format_usd, micros_from_usd
from ncap.errors import (
    BudgetExhausted,
    ConcurrencyLimitExceeded,
    RateLimited,
    RateLimitExceeded,
    Refusal,
)

__all__ = [
    "CONCURRENCY_RETRY_AFTER_S",
    "Amounts",
    "Buckets",
    "BudgetWindows",
    "Usage",
    "admit",
]

CONCURRENCY_RETRY_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class BudgetWindows:
    """A workload's limits (None: unlimited), USD already in micro-USD."""

    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    tokens_per_day: int | None = None
    usd_per_day_micros: int | None = None
    usd_per_month_micros: int | None = None
    max_concurrency: int | None = None
    exception_budget_micros: int | None = None
    # no window counts tokens, requests or spend (only concurrency may be limited):
    # such a reservation is admitted on its in-flight count alone (the default workload)
    counts_nothing: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "counts_nothing",
            self.tokens_per_minute is None
            and self.requests_per_minute is None
            and self.tokens_per_day is None
            and self.usd_per_day_micros is None
            and self.usd_per_month_micros is None
            and self.exception_budget_micros is None,
        )

    @classmethod
    def for_workload(
        cls, workload: Workload, exception: ExceptionGrant | None = None
    ) -> BudgetWindows:
        """The windows in force; pass the *engaged* exception (``Decision.exception_id``)."""
        return cls(
            tokens_per_minute=workload.tokens_per_minute,
            requests_per_minute=workload.requests_per_minute,
            tokens_per_day=workload.tokens_per_day,
            usd_per_day_micros=micros_from_usd(workload.usd_per_day),
            usd_per_month_micros=micros_from_usd(workload.usd_per_month),
            max_concurrency=workload.max_concurrency,
            exception_budget_micros=micros_from_usd(exception.budget_usd) if exception else None,
        )


class Amounts(msgspec.Struct, frozen=True, gc=False):
    """What one attempt holds: tokens (input + output) and micro-USD; one request."""

    tokens: int
    cost_micros: int

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.cost_micros < 0:
            raise ValueError("reserved amounts cannot be negative")


class Buckets(msgspec.Struct, frozen=True, gc=False):
    """The fixed window keys an instant falls in, and when each window rolls over."""

    minute: str
    day: str
    month: str
    now: datetime

    @classmethod
    def at(cls, now: datetime) -> Buckets:
        if now.tzinfo is None:
            raise ValueError("budget clocks must be timezone-aware")
        utc = now.astimezone(UTC)
        minute, day, month = bucket_keys(utc)  # formatted once per minute
        return cls(minute=minute, day=day, month=month, now=utc)

    def seconds_to_next_minute(self) -> float:
        nxt = self.now.replace(second=0, microsecond=0) + timedelta(minutes=1)
        return (nxt - self.now).total_seconds()

    def seconds_to_next_day(self) -> float:
        nxt = self.now.replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1)
        return (nxt - self.now).total_seconds()


class Usage(msgspec.Struct, frozen=True, gc=False):
    """Current counters of one workload (and its engaged exception) in the live buckets."""

    tokens_minute: int = 0
    requests_minute: int = 0
    tokens_day: int = 0
    cost_day: int = 0
    cost_month: int = 0
    cost_exception: int = 0
    in_flight: int = 0


def admit(
    workload_id: str,
    exception_id: str | None,
    usage: Usage,
    windows: BudgetWindows,
    amounts: Amounts,
    buckets: Buckets,
) -> None:
    """Raise the error of the first window (budgets first) the reservation does not fit.

    The amounts are never reduced to fit: a reservation fits whole or not at all.
    """
    error = _budget_error(workload_id, exception_id, usage, windows, amounts, buckets) or (
        _rate_error(workload_id, usage, windows, amounts, buckets)
    )
    if error is not None:
        raise error
    if windows.max_concurrency is not None and usage.in_flight + 1 > windows.max_concurrency:
        raise ConcurrencyLimitExceeded(
            f"Workload '{workload_id}' already has {usage.in_flight} request(s) in flight, "
            f"its limit is {windows.max_concurrency}. Retry shortly.",
            retry_after=CONCURRENCY_RETRY_AFTER_S,
            refusal=Refusal("concurrency", windows.max_concurrency, 1),
        )


def _budget_error(
    workload_id: str,
    exception_id: str | None,
    usage: Usage,
    windows: BudgetWindows,
    amounts: Amounts,
    buckets: Buckets,
) -> RateLimited | None:
    exception_budget = windows.exception_budget_micros if exception_id else None
    checks = (
        ("exception", exception_budget, usage.cost_exception),
        ("usd_micros_month", windows.usd_per_month_micros, usage.cost_month),
        ("usd_micros_day", windows.usd_per_day_micros, usage.cost_day),
    )
    for window, limit, used in checks:
        if limit is not None and used + amounts.cost_micros > limit:
            label = _LABELS.get(window) or f"exception '{exception_id}' budget"
            return _exhausted(
                f"Workload '{workload_id}': the {label} of {format_usd(limit)} cannot cover "
                f"this request's reservation of {format_usd(amounts.cost_micros)} "
                f"({format_usd(used)} already spent or held).",
                buckets if window == "usd_micros_day" else None,
                Refusal(window, limit, amounts.cost_micros),
            )
    limit = windows.tokens_per_day
    if limit is not None and usage.tokens_day + amounts.tokens > limit:
        return _exhausted(
            f"Workload '{workload_id}': the daily token budget of {limit} cannot cover this "
            f"request's reservation of {amounts.tokens} tokens ({usage.tokens_day} already "
            "used or held).",
            buckets,
            Refusal("tokens_day", limit, amounts.tokens),
        )
    return None


_LABELS = {"usd_micros_month": "monthly USD budget", "usd_micros_day": "daily USD budget"}


def _exhausted(message: str, resets: Buckets | None, refusal: Refusal) -> BudgetExhausted:
    hint = " Lower n or max_completion_tokens, or wait for the budget period to reset."
    if refusal.limit == "exception":  # an exception's budget is for its whole life
        hint = (
            " An exception's budget covers its whole life and never resets: lower n or"
            " max_completion_tokens, or ask the exception's owner for a new one."
        )
    retry = resets.seconds_to_next_day() if resets else None
    return BudgetExhausted(message + hint, retry_after=retry, refusal=refusal)


def _rate_error(
    workload_id: str,
    usage: Usage,
    windows: BudgetWindows,
    amounts: Amounts,
    buckets: Buckets,
) -> RateLimited | None:
    tpm, rpm = windows.tokens_per_minute, windows.requests_per_minute
    if tpm is not None and amounts.tokens > tpm:
        return BudgetExhausted(
            f"Workload '{workload_id}': this request reserves {amounts.tokens} tokens, more "
            f"than its whole per-minute limit of {tpm}; it can never be admitted. Lower n or "
            "max_completion_tokens.",
            refusal=Refusal("tokens_minute", tpm, amounts.tokens),
        )
    if tpm is not None and usage.tokens_minute + amounts.tokens > tpm:
        return RateLimitExceeded(
            f"Workload '{workload_id}': the tokens-per-minute limit of {tpm} is reached "
            f"({usage.tokens_minute} used or held, {amounts.tokens} requested).",
            retry_after=buckets.seconds_to_next_minute(),
            refusal=Refusal("tokens_minute", tpm, amounts.tokens),
        )
    if rpm is not None and usage.requests_minute + 1 > rpm:
        return RateLimitExceeded(
            f"Workload '{workload_id}': the requests-per-minute limit of {rpm} is reached.",
            retry_after=buckets.seconds_to_next_minute(),
            refusal=Refusal("requests_minute", rpm, 1),
        )
    return None
