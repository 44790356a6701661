"""Budget windows from config, and the admission rule every budget store applies.

``for_workload`` is where a workload's and an exception's limits become windows: each
limit is pinned to its own window here (reading the daily USD limit from the monthly
one, or dropping an exception's budget, must fail a test). ``admit`` is pinned at the
edge of every window (exactly full fits, one more does not) and in its priority order
(a budget beats a rate limit, so a client is never told to retry into a wall).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from ncap.config import ExceptionGrant, Workload
from ncap.domain.budget import (
    CONCURRENCY_RETRY_AFTER_S,
    Amounts,
    Buckets,
    BudgetWindows,
    Usage,
    admit,
)
from ncap.errors import (
    BudgetExhausted,
    ConcurrencyLimitExceeded,
    RateLimited,
    RateLimitExceeded,
)

NOW = datetime(2026, 11, 29, 10, 15, 30, 250_000, tzinfo=UTC)
BUCKETS = Buckets.at(NOW)
AMOUNTS = Amounts(tokens=100, cost_micros=1_000)


def _grant(**kw: Any) -> ExceptionGrant:
    fields: dict[str, Any] = {
        "id": "eval-q4",
        "workload": "w",
        "owner": "finops@example.com",
        "max_candidates": 4,
        "expires": "2027-01-01T00:00:00Z",
    }
    return ExceptionGrant.model_validate(fields | kw)


# -- for_workload: every limit to its own window ------------------------------------------


def test_every_workload_limit_becomes_its_own_window() -> None:
    # distinct values everywhere: a limit read from the wrong field shows up
    workload = Workload(
        tokens_per_minute=11,
        requests_per_minute=12,
        tokens_per_day=13,
        usd_per_day=1.25,
        usd_per_month=30.5,
        max_concurrency=14,
    )
    assert BudgetWindows.for_workload(workload) == BudgetWindows(
        tokens_per_minute=11,
        requests_per_minute=12,
        tokens_per_day=13,
        usd_per_day_micros=1_250_000,
        usd_per_month_micros=30_500_000,
        max_concurrency=14,
        exception_budget_micros=None,
    )


@pytest.mark.parametrize(
    ("field", "value", "window", "expected"),
    [
        ("tokens_per_minute", 7, "tokens_per_minute", 7),
        ("requests_per_minute", 7, "requests_per_minute", 7),
        ("tokens_per_day", 7, "tokens_per_day", 7),
        ("usd_per_day", 0.07, "usd_per_day_micros", 70_000),
        ("usd_per_month", 0.07, "usd_per_month_micros", 70_000),
        ("max_concurrency", 7, "max_concurrency", 7),
    ],
)
def test_a_single_limit_sets_only_its_window(
    field: str, value: float, window: str, expected: int
) -> None:
    # the others unset (max_concurrency defaults to 32: unset it explicitly)
    unset = {"max_concurrency": None}
    windows = BudgetWindows.for_workload(Workload.model_validate(unset | {field: value}))
    assert windows == BudgetWindows(**{window: expected})


def test_usd_limits_round_down_to_whole_micro_usd() -> None:
    windows = BudgetWindows.for_workload(Workload(usd_per_day=0.0000019, usd_per_month=0.1))
    assert (windows.usd_per_day_micros, windows.usd_per_month_micros) == (1, 100_000)


def test_default_workload_is_unlimited_but_for_concurrency() -> None:
    assert BudgetWindows.for_workload(Workload()) == BudgetWindows(max_concurrency=32)


def test_an_exception_budget_is_a_window() -> None:
    windows = BudgetWindows.for_workload(Workload(usd_per_day=2.0), _grant(budget_usd=25.0))
    assert windows.exception_budget_micros == 25_000_000
    assert windows.usd_per_day_micros == 2_000_000  # the workload's own still apply


def test_an_exception_without_budget_adds_no_window() -> None:
    windows = BudgetWindows.for_workload(Workload(), _grant(budget_usd=None))
    assert windows.exception_budget_micros is None


def test_a_zero_exception_budget_is_a_window_not_unlimited() -> None:
    windows = BudgetWindows.for_workload(Workload(), _grant(budget_usd=0))
    assert windows.exception_budget_micros == 0
    with pytest.raises(BudgetExhausted):
        admit("w", "eval-q4", Usage(), windows, AMOUNTS, BUCKETS)


# -- Amounts and Buckets --------------------------------------------------------------------


@pytest.mark.parametrize(("tokens", "cost"), [(-1, 0), (0, -1)])
def test_negative_amounts_are_refused(tokens: int, cost: int) -> None:
    with pytest.raises(ValueError, match="negative"):
        Amounts(tokens, cost)


def test_zero_amounts_are_allowed() -> None:
    assert Amounts(0, 0) == Amounts(tokens=0, cost_micros=0)


def test_buckets_are_fixed_utc_keys() -> None:
    paris = timezone(timedelta(hours=1))
    b = Buckets.at(datetime(2026, 12, 1, 0, 30, 5, tzinfo=paris))  # 2026-11-30T23:30 UTC
    assert (b.minute, b.day, b.month) == ("2026-11-30T23:30", "2026-11-30", "2026-11")
    assert b.now == datetime(2026, 11, 30, 23, 30, 5, tzinfo=UTC)
    assert b.now.utcoffset() == timedelta(0)


def test_naive_clocks_are_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        Buckets.at(datetime(2026, 11, 29, 10, 15))


@pytest.mark.parametrize(
    ("now", "to_minute", "to_day"),
    [
        (NOW, 29.75, 13 * 3600 + 44 * 60 + 29.75),
        (datetime(2026, 11, 30, 23, 59, 59, tzinfo=UTC), 1.0, 1.0),
        (datetime(2026, 12, 31, 0, 0, 0, tzinfo=UTC), 60.0, 86_400.0),
    ],
)
def test_seconds_to_the_next_window(now: datetime, to_minute: float, to_day: float) -> None:
    b = Buckets.at(now)
    assert b.seconds_to_next_minute() == pytest.approx(to_minute)
    assert b.seconds_to_next_day() == pytest.approx(to_day)


# -- admit: each window at its edge --------------------------------------------------------


def _admits(usage: Usage, windows: BudgetWindows, exception_id: str | None = None) -> bool:
    try:
        admit("w", exception_id, usage, windows, AMOUNTS, BUCKETS)
    except RateLimited:
        return False
    return True


# window, the usage that leaves exactly room for AMOUNTS, the usage one unit over
TPM, RPM, TPD = "tokens_per_minute", "requests_per_minute", "tokens_per_day"
EDGES: list[tuple[str, BudgetWindows, Usage, Usage]] = [
    ("tpm", BudgetWindows(**{TPM: 1_000}), Usage(tokens_minute=900), Usage(tokens_minute=901)),
    ("rpm", BudgetWindows(**{RPM: 5}), Usage(requests_minute=4), Usage(requests_minute=5)),
    ("tpd", BudgetWindows(**{TPD: 1_000}), Usage(tokens_day=900), Usage(tokens_day=901)),
    ("usd/day", BudgetWindows(usd_per_day_micros=5_000), Usage(cost_day=4_000),
     Usage(cost_day=4_001)),
    ("usd/month", BudgetWindows(usd_per_month_micros=5_000), Usage(cost_month=4_000),
     Usage(cost_month=4_001)),
    ("concurrency", BudgetWindows(max_concurrency=3), Usage(in_flight=2), Usage(in_flight=3)),
]  # fmt: skip


@pytest.mark.parametrize(("name", "windows", "room", "over"), EDGES, ids=[e[0] for e in EDGES])
def test_each_window_admits_exactly_to_its_limit(
    name: str, windows: BudgetWindows, room: Usage, over: Usage
) -> None:
    assert _admits(room, windows)
    assert not _admits(over, windows)


@pytest.mark.parametrize(("name", "windows", "room", "over"), EDGES, ids=[e[0] for e in EDGES])
def test_a_window_ignores_the_counters_of_the_others(
    name: str, windows: BudgetWindows, room: Usage, over: Usage
) -> None:
    huge = Usage(
        tokens_minute=10**9,
        requests_minute=10**9,
        tokens_day=10**9,
        cost_day=10**9,
        cost_month=10**9,
        cost_exception=10**9,
        in_flight=10**9,
    )
    # every counter is huge except the one this window reads, which has room
    own = {f: getattr(room, f) for f in Usage.__struct_fields__ if getattr(over, f)}
    mixed = Usage(**{f: own.get(f, getattr(huge, f)) for f in Usage.__struct_fields__})
    assert _admits(mixed, windows)


def test_exception_budget_edge() -> None:
    windows = BudgetWindows(exception_budget_micros=5_000)
    assert _admits(Usage(cost_exception=4_000), windows, "eval-q4")
    assert not _admits(Usage(cost_exception=4_001), windows, "eval-q4")


def test_exception_budget_applies_only_when_the_exception_is_engaged() -> None:
    windows = BudgetWindows(exception_budget_micros=5_000)
    assert _admits(Usage(cost_exception=10**9), windows, None)


def test_unlimited_windows_admit_anything() -> None:
    huge = Usage(10**9, 10**9, 10**9, 10**9, 10**9, 10**9, 10**9)
    admit("w", "x", huge, BudgetWindows(), Amounts(10**9, 10**9), BUCKETS)


# -- admit: which error, with which Retry-After ----------------------------------------------


def _error(usage: Usage, windows: BudgetWindows, exception_id: str | None = None) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        admit("w", exception_id, usage, windows, AMOUNTS, BUCKETS)
    return info.value


def test_daily_budgets_reset_at_utc_midnight() -> None:
    for windows, usage in (
        (BudgetWindows(usd_per_day_micros=0), Usage()),
        (BudgetWindows(tokens_per_day=99), Usage()),
    ):
        error = _error(usage, windows)
        assert type(error) is BudgetExhausted
        assert error.retry_after == pytest.approx(BUCKETS.seconds_to_next_day())
        assert error.should_retry is False


@pytest.mark.parametrize(
    ("windows", "label"),
    [
        (BudgetWindows(usd_per_month_micros=999), "monthly USD budget of $0.000999"),
        (BudgetWindows(exception_budget_micros=999), "exception 'eval-q4' budget of $0.000999"),
    ],
)
def test_budgets_without_a_daily_reset_give_no_retry_after(
    windows: BudgetWindows, label: str
) -> None:
    error = _error(Usage(), windows, "eval-q4")
    assert type(error) is BudgetExhausted
    assert error.retry_after is None
    assert label in error.message
    assert "reservation of $0.001000" in error.message


def test_budget_message_states_limit_reservation_and_spend() -> None:
    error = _error(Usage(cost_day=4_500), BudgetWindows(usd_per_day_micros=5_000))
    assert "daily USD budget of $0.005000" in error.message
    assert "$0.001000" in error.message and "($0.004500 already spent or held)" in error.message
    assert "Lower n or max_completion_tokens" in error.message
    tokens = _error(Usage(tokens_day=950), BudgetWindows(tokens_per_day=1_000))
    assert "daily token budget of 1000" in tokens.message
    assert "reservation of 100 tokens (950 already used or held)" in tokens.message


def test_rate_windows_retry_at_the_next_minute() -> None:
    for windows, usage in (
        (BudgetWindows(tokens_per_minute=1_000), Usage(tokens_minute=901)),
        (BudgetWindows(requests_per_minute=5), Usage(requests_minute=5)),
    ):
        error = _error(usage, windows)
        assert type(error) is RateLimitExceeded
        assert error.code == "rate_limit_exceeded"
        assert error.retry_after == pytest.approx(29.75)
    tpm = _error(Usage(tokens_minute=901), BudgetWindows(tokens_per_minute=1_000))
    assert "tokens-per-minute limit of 1000" in tpm.message
    assert "(901 used or held, 100 requested)" in tpm.message
    rpm = _error(Usage(requests_minute=5), BudgetWindows(requests_per_minute=5))
    assert "requests-per-minute limit of 5" in rpm.message


def test_a_request_larger_than_the_whole_minute_can_never_be_admitted() -> None:
    windows = BudgetWindows(tokens_per_minute=99)
    error = _error(Usage(), windows)
    assert type(error) is BudgetExhausted  # retrying cannot fix it
    assert error.retry_after is None
    assert "more than its whole per-minute limit of 99" in error.message
    # exactly the whole minute fits an empty window
    assert _admits(Usage(), BudgetWindows(tokens_per_minute=100))


def test_concurrency_retries_shortly() -> None:
    error = _error(Usage(in_flight=3), BudgetWindows(max_concurrency=3))
    assert type(error) is ConcurrencyLimitExceeded
    assert error.retry_after == CONCURRENCY_RETRY_AFTER_S == 1.0
    assert "already has 3 request(s) in flight, its limit is 3" in error.message


ALL_FULL = Usage(
    tokens_minute=1_000,
    requests_minute=5,
    tokens_day=1_000,
    cost_day=5_000,
    cost_month=5_000,
    cost_exception=5_000,
    in_flight=3,
)
ALL_WINDOWS = BudgetWindows(
    tokens_per_minute=1_000,
    requests_per_minute=5,
    tokens_per_day=1_000,
    usd_per_day_micros=5_000,
    usd_per_month_micros=5_000,
    max_concurrency=3,
    exception_budget_micros=5_000,
)


@pytest.mark.parametrize(
    ("lifted", "expected"),
    [
        ((), "exception 'eval-q4' budget"),
        (("cost_exception",), "monthly USD budget"),
        (("cost_exception", "cost_month"), "daily USD budget"),
        (("cost_exception", "cost_month", "cost_day"), "daily token budget"),
        (("cost_exception", "cost_month", "cost_day", "tokens_day"), "tokens-per-minute"),
        (
            ("cost_exception", "cost_month", "cost_day", "tokens_day", "tokens_minute"),
            "requests-per-minute",
        ),
        (
            ("cost_exception", "cost_month", "cost_day", "tokens_day", "tokens_minute",
             "requests_minute"),
            "in flight",
        ),
    ],
)  # fmt: skip
def test_budgets_win_over_rates_over_concurrency(lifted: tuple[str, ...], expected: str) -> None:
    usage = Usage(
        **{f: 0 if f in lifted else getattr(ALL_FULL, f) for f in Usage.__struct_fields__}
    )
    assert expected in _error(usage, ALL_WINDOWS, "eval-q4").message


def test_error_names_the_workload() -> None:
    for windows, usage in (
        (BudgetWindows(usd_per_day_micros=0), Usage()),
        (BudgetWindows(tokens_per_day=1), Usage()),
        (BudgetWindows(tokens_per_minute=1), Usage()),
        (BudgetWindows(tokens_per_minute=1_000), Usage(tokens_minute=1_000)),
        (BudgetWindows(requests_per_minute=1), Usage(requests_minute=1)),
        (BudgetWindows(max_concurrency=1), Usage(in_flight=1)),
    ):
        with pytest.raises(RateLimited) as info:
            admit("support-draft", None, usage, windows, AMOUNTS, BUCKETS)
        assert "Workload 'support-draft'" in info.value.message


def test_an_exhausted_exception_budget_does_not_promise_a_reset() -> None:
    """An exception's budget covers its whole life: its 429 says so, and sends no
    Retry-After; a day budget's 429 still says to wait for the reset."""
    from ncap.domain.budget import Amounts, Buckets, BudgetWindows, Usage, admit
    from ncap.errors import BudgetExhausted

    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    windows = BudgetWindows(exception_budget_micros=1_000, usd_per_day_micros=10_000)
    with pytest.raises(BudgetExhausted) as spent:
        admit("w", "eval", Usage(cost_exception=900), windows, Amounts(10, 200), Buckets.at(now))
    assert spent.value.refusal is not None and spent.value.refusal.limit == "exception"
    assert "never resets" in spent.value.message
    assert "wait for the budget period to reset" not in spent.value.message
    assert spent.value.retry_after is None
    with pytest.raises(BudgetExhausted) as day:
        admit("w", None, Usage(cost_day=9_900), windows, Amounts(10, 200), Buckets.at(now))
    assert "wait for the budget period to reset" in day.value.message
