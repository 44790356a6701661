"""Recovery that knows its peers (SQLite files, and PostgreSQL + Redis): a live peer is
left alone; a peer that stopped beating is swept, its holds still counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ncap.domain.budget import Amounts, BudgetWindows
from ncap.errors import ConcurrencyLimitExceeded
from ncap.lifecycle.peers import PeerWatch
from ncap.stores import (
    BudgetStore,
    Identity,
    LedgerStore,
    StoreOptions,
    hold_id_for,
    open_budget_side,
    open_ledger_side,
)
from tests.services import pg_schema, redis_prefix
from tests.stores.test_sqlite_ledger import event

W = "support-eval"
ONE_AT_A_TIME = BudgetWindows(max_concurrency=1, usd_per_day_micros=1_000_000)

Gateway = tuple[PeerWatch, LedgerStore, BudgetStore]


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("shared", marks=[pytest.mark.postgresql, pytest.mark.redis]),
    ]
)
async def make_gateway(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Callable[..., Gateway]]:
    async with AsyncExitStack() as stack:
        if request.param == "sqlite":
            urls = (f"sqlite:///{tmp_path}/l.db", f"sqlite:///{tmp_path}/b.db")
        else:
            urls = (
                await stack.enter_async_context(pg_schema()),
                await stack.enter_async_context(redis_prefix()),
            )
        made: list[Gateway] = []

        def make(instance: str, pid: int = 0, timeout_s: float = 30.0) -> Gateway:
            ledger_side = open_ledger_side(urls[0], StoreOptions())
            ledger = ledger_side.ledger
            # as the gateway builds them: Redis counters rebuilt from the ledger
            options = StoreOptions(gateway_instance=instance)
            budgets = open_budget_side(urls[1], options, ledger_side.history).budgets
            me = Identity.current(instance)
            me = replace(me, pid=pid or me.pid, host=me.host if not pid else "elsewhere")
            peers = PeerWatch(
                ledger_side.instances, ledger, budgets, me, interval_s=0.1, timeout_s=timeout_s
            )
            made.append((peers, ledger, budgets))
            return peers, ledger, budgets

        yield make
        for peers, ledger, budgets in made:
            await peers.stop()
            await ledger.close()
            await budgets.close()


async def _in_flight(ledger: LedgerStore, budgets: BudgetStore, instance: str, rid: str) -> None:
    await budgets.reserve(W, ONE_AT_A_TIME, Amounts(100, 1_000), hold_id=hold_id_for(rid, 1))
    now = datetime.now(UTC)
    await ledger.append(event(rid, 1, timestamp=now, gateway_instance=instance))


async def test_a_second_gateway_leaves_a_live_ones_requests_alone(
    make_gateway: Callable[..., Gateway],
) -> None:
    first, ledger1, budgets1 = make_gateway("gw-1")
    await first.start()
    await _in_flight(ledger1, budgets1, "gw-1", "req-a")
    second, ledger2, budgets2 = make_gateway("gw-2")
    assert await second.start() == []
    assert [(e.state, e.reconciliation_reason) for e in await ledger2.get("req-a")] == [
        ("reserved", None)
    ]
    assert [h.state for h in await budgets2.outstanding(W)] == ["active"]
    with pytest.raises(ConcurrencyLimitExceeded):  # the first's slot is still taken
        await budgets2.reserve(W, ONE_AT_A_TIME, Amounts(100, 1_000))


async def test_a_peer_that_stops_beating_is_swept_and_still_counted(
    make_gateway: Callable[..., Gateway],
) -> None:
    # on another host: only its expired heartbeat can tell that it died
    dying, ledger1, budgets1 = make_gateway("gw-dying", pid=4242, timeout_s=0.5)
    await dying.start()
    await _in_flight(ledger1, budgets1, "gw-dying", "req-b")
    assert dying._task is not None
    dying._task.cancel()  # it stops beating, as if killed
    survivor, ledger2, budgets2 = make_gateway("gw-survivor", timeout_s=5)
    assert await survivor.start() == []  # not expired yet: left alone
    before = await budgets2.usage(W)
    for _ in range(100):
        if any(r.instance == "gw-dying" for r in survivor.recovered):
            break
        await asyncio.sleep(0.05)
    assert [(r.instance, r.rows, r.holds) for r in survivor.recovered] == [("gw-dying", 1, 1)]
    [row] = await ledger2.get("req-b")
    assert (row.state, row.reconciliation_reason) == (
        "usage_reconciliation_required",
        "gateway_lost",
    )
    [hold] = await budgets2.outstanding(W)
    after = await budgets2.usage(W)
    assert hold.state == "kept" and after.in_flight == 0
    assert after.cost_day == before.cost_day == 1_000  # still counted, never zero
    assert [row.request_id for row in await ledger2.pending()] == ["req-b"]


async def test_a_restart_with_the_same_id_recovers_its_own_earlier_rows_at_once(
    make_gateway: Callable[..., Gateway],
) -> None:
    earlier, ledger1, budgets1 = make_gateway("gw-fixed", pid=999_999)
    await earlier.start()
    await _in_flight(ledger1, budgets1, "gw-fixed", "req-c")
    assert earlier._task is not None
    earlier._task.cancel()
    restarted, ledger2, _ = make_gateway("gw-fixed")
    [done] = await restarted.start()
    assert (done.instance, done.rows, done.holds) == ("gw-fixed", 1, 1)
    assert (await ledger2.get("req-c"))[0].reconciliation_reason == "gateway_lost"
