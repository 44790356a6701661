"""The BudgetStore contract (what every budget backend must do), run against every backend."""

from __future__ import annotations

import asyncio
import random
from datetime import timedelta
from typing import Any

import pytest

from ncap.domain.budget import Amounts, BudgetWindows, Usage
from ncap.errors import (
    BudgetExhausted,
    ConcurrencyLimitExceeded,
    RateLimited,
    RateLimitExceeded,
)
from ncap.stores import BudgetStore, Hold

W = "support-eval"
AMOUNTS = Amounts(tokens=1_000, cost_micros=10_000)
ROOMY = BudgetWindows(
    tokens_per_minute=100_000,
    requests_per_minute=100,
    tokens_per_day=1_000_000,
    usd_per_day_micros=10_000_000,
    usd_per_month_micros=100_000_000,
    max_concurrency=10,
    exception_budget_micros=5_000_000,
)


async def reserve(store: BudgetStore, windows: BudgetWindows = ROOMY, **kw: Any) -> Hold:
    args: dict[str, Any] = {"exception_id": "eval-q4"} | kw
    amounts = args.pop("amounts", AMOUNTS)
    return await store.reserve(W, windows, amounts, **args)


async def usage(store: BudgetStore, **kw: Any) -> Usage:
    return await store.usage(W, exception_id="eval-q4", **kw)


def tight(**kw: Any) -> BudgetWindows:
    fields = {
        "tokens_per_minute": ROOMY.tokens_per_minute,
        "requests_per_minute": ROOMY.requests_per_minute,
        "tokens_per_day": ROOMY.tokens_per_day,
        "usd_per_day_micros": ROOMY.usd_per_day_micros,
        "usd_per_month_micros": ROOMY.usd_per_month_micros,
        "max_concurrency": ROOMY.max_concurrency,
        "exception_budget_micros": ROOMY.exception_budget_micros,
    }
    return BudgetWindows(**(fields | kw))


async def test_reserve_charges_every_window(budgets: BudgetStore, clock: Any) -> None:
    hold = await reserve(budgets)
    assert (hold.tokens, hold.cost_micros, hold.state) == (1_000, 10_000, "active")
    assert (hold.workload_id, hold.exception_id, hold.gateway_instance) == (W, "eval-q4", "g1")
    assert await usage(budgets) == Usage(1_000, 1, 1_000, 10_000, 10_000, 10_000, 1)
    assert [h.hold_id for h in await budgets.outstanding()] == [hold.hold_id]
    assert await budgets.outstanding("someone-else") == []


# one window too small for the second reservation, the others roomy
FAILING_WINDOW = [
    ("tokens_per_minute", {"tokens_per_minute": 1_500}, RateLimitExceeded),
    ("requests_per_minute", {"requests_per_minute": 1}, RateLimitExceeded),
    ("tokens_per_day", {"tokens_per_day": 1_999}, BudgetExhausted),
    ("usd_per_day", {"usd_per_day_micros": 19_999}, BudgetExhausted),
    ("usd_per_month", {"usd_per_month_micros": 15_000}, BudgetExhausted),
    ("exception budget_usd", {"exception_budget_micros": 10_000}, BudgetExhausted),
    ("max_concurrency", {"max_concurrency": 1}, ConcurrencyLimitExceeded),
]


@pytest.mark.parametrize(
    ("case", "limits", "error"), FAILING_WINDOW, ids=[c[0] for c in FAILING_WINDOW]
)
async def test_admission_is_all_or_nothing(
    budgets: BudgetStore, case: str, limits: dict[str, int], error: type[RateLimited]
) -> None:
    windows = tight(**limits)
    await reserve(budgets, windows)
    before = await usage(budgets)
    with pytest.raises(error) as info:
        await reserve(budgets, windows)
    assert type(info.value) is error, case
    assert await usage(budgets) == before, "a refused reservation must not touch any window"
    assert len(await budgets.outstanding()) == 1


@pytest.mark.parametrize(
    ("limits", "retry_after", "should_retry"),
    [
        ({"tokens_per_minute": 1_500}, 30.0, None),  # clock is at 10:15:30
        ({"requests_per_minute": 1}, 30.0, None),
        ({"max_concurrency": 1}, 1.0, None),
        ({"usd_per_day_micros": 15_000}, 13.75 * 3600 - 30, False),
        ({"exception_budget_micros": 15_000}, None, False),
    ],
)
async def test_retry_hints(
    budgets: BudgetStore, limits: dict[str, int], retry_after: float | None, should_retry: Any
) -> None:
    windows = tight(**limits)
    await reserve(budgets, windows)
    with pytest.raises(RateLimited) as info:
        await reserve(budgets, windows)
    assert info.value.retry_after == retry_after
    assert info.value.should_retry is should_retry


async def test_budget_errors_win_over_retryable_ones(budgets: BudgetStore) -> None:
    windows = tight(max_concurrency=1, tokens_per_minute=1_500, usd_per_day_micros=15_000)
    await reserve(budgets, windows)
    with pytest.raises(BudgetExhausted):
        await reserve(budgets, windows)


async def test_a_reservation_is_never_shrunk_to_fit(budgets: BudgetStore) -> None:
    windows = tight(usd_per_day_micros=25_000)
    await reserve(budgets, windows, amounts=Amounts(1_000, 20_000))  # 5_000 left
    with pytest.raises(BudgetExhausted) as info:
        await reserve(budgets, windows, amounts=Amounts(1_000, 6_000))
    assert "$0.006000" in info.value.message
    hold = await reserve(budgets, windows, amounts=Amounts(1_000, 5_000))  # exactly fits
    assert hold.cost_micros == 5_000
    assert (await usage(budgets)).cost_day == 25_000


async def test_a_reservation_larger_than_a_whole_minute_is_not_retryable(
    budgets: BudgetStore,
) -> None:
    with pytest.raises(BudgetExhausted) as info:
        await reserve(budgets, tight(tokens_per_minute=999))
    assert info.value.should_retry is False and "never be admitted" in info.value.message


async def test_exception_budget_applies_only_when_the_exception_is_engaged(
    budgets: BudgetStore,
) -> None:
    windows = tight(exception_budget_micros=10_000)
    await reserve(budgets, windows)
    with pytest.raises(BudgetExhausted):
        await reserve(budgets, windows)
    await reserve(budgets, windows, exception_id=None)
    assert (await usage(budgets)).cost_exception == 10_000


FIFTY = {
    "usd_per_day": BudgetWindows(usd_per_day_micros=50 * AMOUNTS.cost_micros),
    "max_concurrency": BudgetWindows(max_concurrency=50),
    "tokens_per_minute": BudgetWindows(tokens_per_minute=50 * AMOUNTS.tokens),
}


@pytest.mark.parametrize("window", sorted(FIFTY))
async def test_200_concurrent_reservations_admit_exactly_50(
    budgets: BudgetStore, window: str
) -> None:
    results = await asyncio.gather(
        *(reserve(budgets, FIFTY[window]) for _ in range(200)), return_exceptions=True
    )
    admitted = [r for r in results if isinstance(r, Hold)]
    refused = [r for r in results if isinstance(r, RateLimited)]
    assert len(admitted) == 50 and len(refused) == 150
    assert len(await budgets.outstanding()) == 50


async def test_concurrent_admission_across_store_instances(
    budget_factory: Any,
) -> None:
    """Four gateways, 50 calls each, one budget of 50: a host-scoped store (separate
    SQLite connections to one file) or a global one (Redis) admits 50 in all;
    instance-scoped ones 50 each."""
    stores = [budget_factory(f"g{i}") for i in range(4)]
    windows = BudgetWindows(usd_per_day_micros=50 * AMOUNTS.cost_micros)
    calls = [reserve(stores[i % 4], windows, exception_id=None) for i in range(200)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    admitted = sum(isinstance(r, Hold) for r in results)
    assert admitted == (200 if stores[0].quota_scope == "instance" else 50)
    assert all(isinstance(r, Hold | BudgetExhausted) for r in results), [
        r for r in results if not isinstance(r, Hold | BudgetExhausted)
    ][:2]


async def test_settle_replaces_the_reservation_with_actuals(budgets: BudgetStore) -> None:
    hold = await reserve(budgets)
    assert await budgets.settle(hold, actual_tokens=600, actual_cost_micros=4_000)
    assert await usage(budgets) == Usage(600, 1, 600, 4_000, 4_000, 4_000, 0)
    assert await budgets.outstanding() == []
    assert not await budgets.settle(hold, 1, 1), "a hold settles once"
    assert (await usage(budgets)).tokens_day == 600


async def test_settle_many_settles_each_as_settle_would(budgets: BudgetStore) -> None:
    first, second, third = [await reserve(budgets) for _ in range(3)]
    await budgets.settle_many([(first, 600, 4_000), (second, 100, 1_000)])
    assert await usage(budgets) == Usage(1_700, 3, 1_700, 15_000, 15_000, 15_000, 1)
    assert await budgets.outstanding() == [third]
    # applied again (a batch retried hold by hold): a settled hold is not settled twice
    await budgets.settle_many([(first, 600, 4_000), (third, 1, 1)])
    assert await usage(budgets) == Usage(701, 3, 701, 5_001, 5_001, 5_001, 0)
    assert await budgets.outstanding() == []
    await budgets.settle_many([(third, 5, 5)])  # alone: the same
    assert (await usage(budgets)).tokens_day == 701
    with pytest.raises(ValueError):
        await budgets.settle_many([(await reserve(budgets), -1, 0)])


async def test_settle_may_exceed_the_reservation_when_the_provider_says_so(
    budgets: BudgetStore,
) -> None:
    hold = await reserve(budgets)
    await budgets.settle(hold.hold_id, actual_tokens=1_200, actual_cost_micros=12_000)
    assert (await usage(budgets)).cost_day == 12_000


async def test_keep_holds_the_amounts_and_frees_the_slot(budgets: BudgetStore) -> None:
    windows = tight(max_concurrency=1)
    hold = await reserve(budgets, windows)
    assert await budgets.keep(hold)
    assert not await budgets.keep(hold)
    u = await usage(budgets)
    assert (u.tokens_day, u.cost_day, u.in_flight) == (1_000, 10_000, 0)
    assert [h.state for h in await budgets.outstanding()] == ["kept"]
    await reserve(budgets, windows)  # the slot is free again
    # reconciliation later settles the kept hold by id
    assert await budgets.settle(hold.hold_id, 300, 3_000)
    assert (await usage(budgets)).cost_day == 3_000 + 10_000


async def test_release_gives_everything_back(budgets: BudgetStore) -> None:
    hold = await reserve(budgets)
    assert await budgets.release(hold)
    assert await usage(budgets) == Usage()
    assert not await budgets.release(hold)
    assert await budgets.outstanding() == []


async def test_settled_spend_never_exceeds_the_budget(budgets: BudgetStore) -> None:
    budget = 1_000_000
    windows = BudgetWindows(usd_per_day_micros=budget, max_concurrency=20)
    rng = random.Random(7)
    spent = 0

    async def one() -> None:
        nonlocal spent
        cost = rng.randint(10_000, 80_000)
        try:
            hold = await reserve(budgets, windows, amounts=Amounts(100, cost), exception_id=None)
        except RateLimited:
            return
        await asyncio.sleep(0)
        actual = rng.randint(0, hold.cost_micros)
        spent += actual
        await budgets.settle(hold, 50, actual)

    for _ in range(10):
        await asyncio.gather(*(one() for _ in range(40)))
    u = await budgets.usage(W)
    assert u.cost_day == spent <= budget
    assert u.in_flight == 0


async def test_windows_roll_over(budgets: BudgetStore, clock: Any) -> None:
    windows = tight(tokens_per_minute=1_000, tokens_per_day=2_000)
    await reserve(budgets, windows)
    with pytest.raises(RateLimitExceeded):
        await reserve(budgets, windows)
    clock.now += timedelta(seconds=30)  # 10:16:00, next minute
    await reserve(budgets, windows)
    clock.now += timedelta(minutes=1)
    with pytest.raises(BudgetExhausted):  # the day's 2,000 tokens are held
        await reserve(budgets, windows)
    clock.now += timedelta(days=1)
    await reserve(budgets, windows)
    u = await usage(budgets)
    assert (u.tokens_minute, u.tokens_day, u.cost_month, u.cost_exception) == (
        1_000,
        1_000,
        30_000,
        30_000,
    )


async def test_explicit_now_overrides_the_clock(budgets: BudgetStore, clock: Any) -> None:
    later = clock.now + timedelta(days=40)
    await reserve(budgets, now=later)
    assert (await usage(budgets)).tokens_day == 0
    assert (await usage(budgets, now=later)).cost_month == 10_000


async def test_settling_after_the_minute_rolled_over_touches_only_its_own_buckets(
    budgets: BudgetStore, clock: Any
) -> None:
    hold = await reserve(budgets)
    clock.now += timedelta(minutes=2)
    await reserve(budgets)
    await budgets.settle(hold, 0, 0)
    u = await usage(budgets)
    assert (u.tokens_minute, u.requests_minute, u.tokens_day, u.cost_day) == (
        1_000,
        1,
        1_000,
        10_000,
    )


async def test_exception_budget_spans_days(budgets: BudgetStore, clock: Any) -> None:
    windows = tight(exception_budget_micros=25_000)
    await reserve(budgets, windows)
    clock.now += timedelta(days=1)
    await reserve(budgets, windows)
    clock.now += timedelta(days=40)
    with pytest.raises(BudgetExhausted):
        await reserve(budgets, windows)


async def test_hold_ids(budgets: BudgetStore) -> None:
    hold = await reserve(budgets, hold_id="req-1#0")
    assert hold.hold_id == "req-1#0"
    with pytest.raises(ValueError):
        await reserve(budgets, hold_id="req-1#0")
    assert len(await budgets.outstanding()) == 1
    other = await reserve(budgets)
    assert other.hold_id not in ("", "req-1#0")


async def test_naive_times_and_negative_amounts_are_refused(
    budgets: BudgetStore, clock: Any
) -> None:
    with pytest.raises(ValueError):
        await reserve(budgets, now=clock.now.replace(tzinfo=None))
    with pytest.raises(ValueError):
        Amounts(-1, 0)
    hold = await reserve(budgets)
    with pytest.raises(ValueError):
        await budgets.settle(hold, -1, 0)


async def test_a_cancelled_reservation_holds_nothing_the_caller_cannot_see(
    budget_factory: Any,
) -> None:
    """Either the caller got its hold, or nothing stays held (no leaked reservation)."""
    store = budget_factory()
    task = asyncio.ensure_future(reserve(store))
    await asyncio.sleep(0)
    task.cancel()
    try:
        expected = [(await task).hold_id]
    except asyncio.CancelledError:
        expected = []
    for _ in range(100):
        held = [h.hold_id for h in await store.outstanding()]
        if held == expected:
            break
        await asyncio.sleep(0.01)
    assert held == expected


async def test_quota_scope(budgets: BudgetStore) -> None:
    expected = {"Memory": "instance", "SQLite": "host", "Redis": "global"}
    assert budgets.quota_scope == next(
        scope for prefix, scope in expected.items() if type(budgets).__name__.startswith(prefix)
    )


async def test_a_restarted_gateway_recovers_what_a_dead_one_held(budget_factory: Any) -> None:
    """SQLite: holds are rows, so a new process finds them; memory: they died with it."""
    dead = budget_factory("g1")
    kept = await reserve(dead, hold_id="req-9#0")
    await reserve(dead, hold_id="req-9#1")
    await dead.keep(kept)
    restarted = budget_factory("g2")
    if restarted.quota_scope == "instance":
        assert await restarted.recover_lost("g1") == 0
        assert await restarted.outstanding() == []
        return
    assert await restarted.recover_lost("g1") == 1  # the active one; the kept one stays kept
    assert await restarted.recover_lost("g1") == 0
    held = await restarted.outstanding()
    assert [(h.hold_id, h.state, h.gateway_instance) for h in held] == [
        ("req-9#0", "kept", "g1"),
        ("req-9#1", "kept", "g1"),
    ]
    assert held[0].created_at.tzinfo is not None
    u = await usage(restarted)
    assert (u.in_flight, u.tokens_day, u.cost_day) == (0, 2_000, 20_000)
    assert await restarted.settle("req-9#0", 100, 1_000)  # reconciliation settles by id
    assert (await usage(restarted)).cost_day == 11_000
