"""In-process budgets rebuilt from the ledger equal the counters the live process had,
and the memory ledger stays bounded and indexed by request."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import ncap.stores.sqlite.connection as plumbing
from ncap.domain.budget import Amounts, BudgetWindows
from ncap.domain.events import LedgerEvent
from ncap.stores import (
    LedgerStore,
    MemoryBudgetStore,
    MemoryLedgerStore,
    SQLiteLedgerStore,
    hold_id_for,
    ledger_from_url,
)
from tests.stores.conftest import Clock

WINDOWS = BudgetWindows(max_concurrency=100, exception_budget_micros=10**9)
NOW = datetime(2026, 11, 29, 10, 15, 30, tzinfo=UTC)


def _row(request_id: str, at: datetime, **kw: Any) -> LedgerEvent:
    base: dict[str, Any] = {
        "timestamp": at,
        "request_id": request_id,
        "attempt": 1,
        "workload_id": "w",
        "environment": "production",
        "reserved_input_tokens": 40,
        "reserved_output_tokens": 60,
        "reserved_cost_micros": 500,
        "state": "reserved",
    }
    base.update(kw)
    return LedgerEvent(**base)


async def _attempt(
    live: MemoryBudgetStore,
    ledger: LedgerStore,
    request_id: str,
    at: datetime,
    end: str,
    exception_id: str | None = None,
) -> None:
    """One attempt as the lifecycle runs it: hold, reserved row, then its end on both."""
    await live.reserve(
        "w",
        WINDOWS,
        Amounts(100, 500),
        exception_id=exception_id,
        now=at,
        hold_id=hold_id_for(request_id, 1),
    )
    await ledger.append(_row(request_id, at, exception_id=exception_id))
    hold = hold_id_for(request_id, 1)
    if end == "settled":
        await live.settle(hold, 30, 120)
        await ledger.update(
            request_id,
            1,
            state="settled",
            total_tokens=30,
            cost_micros=120,
            usage_source="provider_response",
        )
    elif end == "kept":
        await live.keep(hold)
        await ledger.update(
            request_id, 1, state="usage_reconciliation_required", reconciliation_reason="x"
        )
    elif end == "rejected":
        await live.release(hold)
        await ledger.update(request_id, 1, state="settled", total_tokens=0, cost_micros=0)


@pytest.fixture(params=["memory", "sqlite"])
async def history(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    store: LedgerStore = MemoryLedgerStore()
    if request.param == "sqlite":
        store = SQLiteLedgerStore(tmp_path / "l.db")
    yield store
    await store.close()


async def test_rebuilt_counters_equal_the_live_ones(history: LedgerStore) -> None:
    clock = Clock(NOW)
    live = MemoryBudgetStore(clock=clock)
    plan = [
        ("old-month", NOW - timedelta(days=40), "settled", None),  # outside every window
        ("old-exc", NOW - timedelta(days=40), "settled", "exc"),  # counts for the exception
        ("old-held", NOW - timedelta(days=40), "kept", "exc"),  # still held
        ("yesterday", NOW - timedelta(days=1), "settled", None),  # month only
        ("minute-ago", NOW - timedelta(minutes=1), "settled", None),
        ("refused", NOW - timedelta(seconds=5), "rejected", None),
        ("lost", NOW - timedelta(seconds=4), "in-flight", None),
        ("pending", NOW - timedelta(seconds=3), "kept", None),
        ("now", NOW, "settled", "exc"),
    ]
    for request_id, at, end, exc in plan:
        await _attempt(live, history, request_id, at, end, exc)
    await history.append(_row("denied", NOW, state="denied", policy_result="deny"))
    # the crash: the in-flight attempt's row becomes gateway_lost, its hold kept
    assert await history.mark_lost() == 1
    await live.keep(hold_id_for("lost", 1))

    rebuilt = MemoryBudgetStore(clock=clock, history=history)
    assert await rebuilt.recover_lost() == 3
    assert await rebuilt.recover_lost() == 0  # once: a second call changes nothing
    for exc in (None, "exc"):
        assert await rebuilt.usage("w", exception_id=exc) == await live.usage("w", exception_id=exc)
    got = sorted((h.hold_id, h.tokens, h.cost_micros, h.state) for h in await rebuilt.outstanding())
    want = sorted((h.hold_id, h.tokens, h.cost_micros, h.state) for h in await live.outstanding())
    assert got == want and len(got) == 3
    usage = await rebuilt.usage("w", exception_id="exc")
    assert usage.cost_exception == 120 + 500 + 120  # old-exc, old-held, now
    assert usage.in_flight == 0
    # a kept hold found again is settled by id when its usage is reconciled
    assert await rebuilt.settle(hold_id_for("pending", 1), 10, 10)
    assert (await rebuilt.usage("w")).cost_day == (await live.usage("w")).cost_day - 490


async def test_memory_ledger_is_bounded_and_keeps_unsettled_rows() -> None:
    ledger = MemoryLedgerStore(max_rows=100)
    await ledger.append(_row("held", NOW))  # stays reserved: never evicted
    for i in range(1000):
        await ledger.append(_row(f"r{i}", NOW))
        await ledger.update(f"r{i}", 1, state="settled")
    rows = [e async for e in ledger.export()]
    assert len(rows) == 100 and ledger.evicted == 901
    assert (await ledger.get("held"))[0].state == "reserved"
    assert (await ledger.get("r999"))[0].state == "settled"
    assert await ledger.get("r0") == []


def test_memory_url_sets_the_bound() -> None:
    ledger = ledger_from_url("memory://?max_rows=7")
    assert isinstance(ledger, MemoryLedgerStore) and ledger.max_rows == 7


@pytest.mark.parametrize(("durability", "level"), [("normal", 1), ("full", 2)])
async def test_ledger_durability_sets_synchronous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: Any, level: int
) -> None:
    monkeypatch.chdir(tmp_path)
    ledger = ledger_from_url("sqlite:///l.db", durability=durability)
    seen: list[int] = []
    assert isinstance(ledger, SQLiteLedgerStore)
    try:
        await ledger._writer.run(
            lambda conn: seen.append(conn.execute("PRAGMA synchronous").fetchone()[0])
        )
    finally:
        await ledger.close()
    assert seen == [level]
    with sqlite3.connect(tmp_path / "l.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_writes_of_one_loop_tick_reach_the_writer_as_one_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []
    commit = plumbing._commit

    def counting(conn: sqlite3.Connection, batch: list[Any], **kw: Any) -> None:
        sizes.append(len(batch))
        commit(conn, batch, **kw)

    monkeypatch.setattr(plumbing, "_commit", counting)
    ledger = SQLiteLedgerStore(tmp_path / "l.db")
    try:
        await asyncio.gather(*(ledger.append(_row(f"r{i}", NOW)) for i in range(200)))
        await asyncio.gather(*(ledger.update(f"r{i}", 1, state="settled") for i in range(200)))
        rows = [e async for e in ledger.export()]
    finally:
        await ledger.close()
    assert sizes == [200, 200]
    assert len(rows) == 200 and {e.state for e in rows} == {"settled"}
