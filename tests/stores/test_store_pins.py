"""Pins found by mutation testing (docs/mutation.md) for the in-process stores: the
errors' exact words, a settlement or release for a bucket that already rolled over, a
replayed hold's instance, the Idempotency-Key records' expiry and eviction, the SQLite
ledger's timestamps and export boundary. Memory and SQLite, no server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from ncap.domain.budget import Amounts, BudgetWindows
from ncap.domain.events import LedgerEvent
from ncap.errors import ConfigError
from ncap.stores import (
    BudgetStore,
    MemoryBudgetStore,
    MemoryLedgerStore,
    SQLiteBudgetStore,
    SQLiteLedgerStore,
    StoreOptions,
    hold_id_for,
    open_budget_side,
)
from ncap.stores._common import decode_per_choice, spent_totals
from ncap.stores.memory.idempotency import MemoryIdempotency
from ncap.stores.ports import DuplicateAttempt
from ncap.stores.sqlite.connection import sqlite_version
from ncap.stores.sqlite.ledger import _ts
from tests.stores.conftest import Clock

NOW = datetime(2026, 11, 29, 10, 15, 30, tzinfo=UTC)
WINDOWS = BudgetWindows(max_concurrency=100)


def _row(request_id: str = "req-1", **kw: Any) -> LedgerEvent:
    base: dict[str, Any] = {
        "timestamp": NOW,
        "request_id": request_id,
        "attempt": 1,
        "workload_id": "w",
        "environment": "production",
        "reserved_input_tokens": 40,
        "reserved_output_tokens": 60,
        "reserved_cost_micros": 500,
        "state": "reserved",
    }
    return LedgerEvent(**(base | kw))


@pytest.fixture(params=["memory", "sqlite"])
async def budgets(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    clock = Clock(NOW)
    store: BudgetStore = (
        MemoryBudgetStore(clock=clock)
        if request.param == "memory"
        else SQLiteBudgetStore(tmp_path / "b.db", clock=clock)
    )
    yield store, clock
    await store.close()


@pytest.fixture(params=["memory", "sqlite"])
async def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    store = (
        MemoryLedgerStore() if request.param == "memory" else SQLiteLedgerStore(tmp_path / "l.db")
    )
    yield store
    await store.close()


# -- budgets ----------------------------------------------------------------------------


@pytest.mark.parametrize("end", ["settle", "release"])
async def test_ending_a_hold_of_a_rolled_over_minute_leaves_the_new_minute_alone(
    budgets: Any, end: str
) -> None:
    store, clock = budgets
    old = await store.reserve("w", WINDOWS, Amounts(100, 500), now=NOW, hold_id="old")
    clock.now = NOW + timedelta(minutes=1)
    await store.reserve("w", WINDOWS, Amounts(7, 30), now=clock.now, hold_id="new")
    if end == "settle":
        await store.settle(old, 10, 50)
    else:
        await store.release(old)
    usage = await store.usage("w", now=clock.now)
    assert (usage.tokens_minute, usage.requests_minute) == (7, 1)


async def test_negative_actuals_are_refused_word_for_word(budgets: Any) -> None:
    store, _ = budgets
    hold = await store.reserve("w", WINDOWS, Amounts(100, 500), now=NOW, hold_id="h")
    with pytest.raises(ValueError, match=r"^actual usage cannot be negative$"):
        await store.settle(hold, -1, 0)


async def test_a_hold_reads_back_whole(budgets: Any) -> None:
    store, _ = budgets
    hold = await store.reserve("w", WINDOWS, Amounts(100, 500), now=NOW, hold_id="h")
    assert await store.outstanding() == [hold]
    assert (hold.minute, hold.day, hold.month) == ("2026-11-29T10:15", "2026-11-29", "2026-11")


async def test_a_memory_stores_holds_are_local_by_default() -> None:
    hold = await MemoryBudgetStore().reserve("w", WINDOWS, Amounts(1, 1), hold_id="h")
    assert hold.gateway_instance == "local"


async def test_a_replayed_hold_keeps_its_rows_gateway_instance() -> None:
    history = MemoryLedgerStore()
    await history.append(_row(gateway_instance="g7", state="usage_reconciliation_required"))
    rebuilt = MemoryBudgetStore(clock=Clock(NOW), history=history)
    assert await rebuilt.recover_lost() == 1
    (hold,) = await rebuilt.outstanding()
    assert (hold.hold_id, hold.gateway_instance) == (hold_id_for("req-1", 1), "g7")


# -- ledgers ----------------------------------------------------------------------------


async def test_the_ledgers_errors_word_for_word(ledger: Any) -> None:
    await ledger.append(_row())
    with pytest.raises(DuplicateAttempt, match=r"^ledger already has request 'req-1' attempt 1$"):
        await ledger.append(_row())
    with pytest.raises(KeyError, match=r"no ledger row for request 'req-2' attempt 1"):
        await ledger.update("req-2", 1, state="settled")
    with pytest.raises(ValueError, match=r"^unknown ledger columns: \['bogus', 'other'\]$"):
        await ledger.update("req-1", 1, bogus=1, other=2)
    message = "^request_id and attempt identify a row and cannot be updated$"
    with pytest.raises(ValueError, match=message):
        await ledger.update("req-1", 1, request_id="x")


async def test_a_closed_memory_ledger_says_so() -> None:
    store = MemoryLedgerStore()
    await store.close()
    with pytest.raises(RuntimeError, match=r"^memory ledger is closed$"):
        await store.append(_row())


async def test_a_memory_ledger_append_gives_the_loop_a_turn_with_the_row_in_place() -> None:
    store = MemoryLedgerStore()
    seen: list[list[str]] = []

    def meanwhile() -> None:  # ready when append starts: runs before append returns
        seen.append([e.state for e in store._rows.values()])

    asyncio.get_running_loop().call_soon(meanwhile)
    await store.append(_row("a"))
    assert seen == [["reserved"]]  # the loop ran once the row was stored, not before


def test_a_memory_ledger_holds_at_least_one_row() -> None:
    assert MemoryLedgerStore(max_rows=1).max_rows == 1
    with pytest.raises(ValueError, match=r"^max_rows must be at least 1$"):
        MemoryLedgerStore(max_rows=0)


async def test_a_memory_ledger_of_one_row_evicts_the_older_request() -> None:
    store = MemoryLedgerStore(max_rows=1)
    await store.append(_row("a"))
    await store.update("a", 1, state="settled")
    await store.append(_row("b"))
    assert (await store.get("a"), [e.request_id for e in await store.get("b")]) == ([], ["b"])
    assert store.evicted == 1
    await store.append(_row("a"))  # its update was evicted with it
    assert [e.state for e in await store.get("a")] == ["reserved"]


@pytest.fixture
def tokyo() -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    yield
    mp.undo()
    time.tzset()


def test_ledger_timestamps_are_fixed_width_utc(tokyo: None) -> None:
    at = datetime(2026, 11, 29, 19, 15, 30, 5, tzinfo=timezone(timedelta(hours=9)))
    assert _ts(at) == "2026-11-29T10:15:30.000005Z"
    with pytest.raises(ValueError, match=r"^ledger timestamps must be timezone-aware$"):
        _ts(datetime(2026, 11, 29))


async def test_an_export_from_an_instant_includes_every_row_at_it(tmp_path: Path) -> None:
    store = SQLiteLedgerStore(tmp_path / "l.db")
    for rid in ("AAA", "req-1"):
        await store.append(_row(rid))
    await store.append(_row("before", timestamp=NOW - timedelta(microseconds=1)))
    got = [e.request_id async for e in store.export(since=NOW)]
    await store.close()
    assert sorted(got) == ["AAA", "req-1"]


def test_spent_totals_count_a_zero_usage_row_as_zero() -> None:
    row = _row(
        state="settled",
        usage_source="provider_response",
        total_tokens=0,
        cost_micros=0,
        policy_result="allow",
    )
    (total,) = spent_totals([row], NOW - timedelta(hours=1))
    assert (total.tokens, total.cost_micros, total.requests) == (0, 0, 1)


def test_an_empty_per_choice_column_is_none() -> None:
    assert decode_per_choice("") is None
    assert decode_per_choice("3,4") == (3, 4)


def test_a_database_never_migrated_is_at_version_zero(tmp_path: Path) -> None:
    import sqlite3

    sqlite3.connect(tmp_path / "empty.db").close()
    assert sqlite_version(tmp_path / "empty.db") == 0


# -- Idempotency-Key records ------------------------------------------------------------


class Seconds:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_record_expires_exactly_at_its_ttl() -> None:
    clock = Seconds()
    records = MemoryIdempotency(clock=clock)
    assert await records.claim("k", b"r", 10) is None
    clock.now = 109.999
    assert await records.get("k") == b"r"
    clock.now = 110.0
    assert await records.get("k") is None


async def test_the_oldest_record_is_evicted_first_and_a_rewrite_is_new() -> None:
    records = MemoryIdempotency(max_keys=2, clock=Seconds())
    await records.claim("a", b"1", 60)
    await records.claim("b", b"2", 60)
    assert await records.get("a") == b"1" and await records.get("b") == b"2"  # two fit
    assert await records.swap("a", b"1", b"1+", 60)  # rewritten: now the newest
    await records.claim("c", b"3", 60)
    assert (await records.get("a"), await records.get("b"), await records.get("c")) == (
        b"1+",
        None,
        b"3",
    )


def test_no_records_for_a_backend_without_budgets() -> None:
    with pytest.raises(
        ConfigError, match=r"^stores\.budgets: postgresql:// is not a budgets store$"
    ):
        open_budget_side("postgresql://h/db", StoreOptions(), None)


async def test_a_request_with_attempts_left_keeps_them_after_an_eviction() -> None:
    store = MemoryLedgerStore(max_rows=2)
    await store.append(_row("a", state="settled"))
    await store.append(_row("a", attempt=2, state="settled"))
    await store.append(_row("b", state="settled"))  # evicts a#1 (no pending update)
    assert [e.attempt for e in await store.get("a")] == [2]
    await store.append(_row("c", state="settled"))  # evicts a#2: request a is gone
    assert await store.get("a") == []


async def test_a_hold_id_is_never_reserved_twice(budgets: Any) -> None:
    store, _ = budgets
    await store.reserve("w", WINDOWS, Amounts(1, 1), now=NOW, hold_id="h")
    with pytest.raises(ValueError, match=r"^hold 'h' already exists$"):
        await store.reserve("w", WINDOWS, Amounts(1, 1), now=NOW, hold_id="h")


async def test_a_stores_refusal_names_the_workload(budgets: Any) -> None:
    store, _ = budgets
    with pytest.raises(Exception, match=r"^Workload 'w': the daily token budget of 5 ") as info:
        await store.reserve("w", BudgetWindows(tokens_per_day=5), Amounts(6, 0), now=NOW)
    assert type(info.value).__name__ == "BudgetExhausted"


async def test_an_sqlite_budget_stores_holds_are_local_by_default(tmp_path: Path) -> None:
    store = SQLiteBudgetStore(tmp_path / "b.db")
    hold = await store.reserve("w", WINDOWS, Amounts(1, 1), hold_id="h")
    await store.close()
    assert hold.gateway_instance == "local"


async def test_sqlite_stores_commit_at_their_synchronous_levels(tmp_path: Path) -> None:
    def level(conn: Any) -> int:
        return int(conn.execute("PRAGMA synchronous").fetchone()[0])

    default = SQLiteLedgerStore(tmp_path / "a.db")
    full = SQLiteLedgerStore(tmp_path / "b.db", synchronous="FULL")
    budgets = SQLiteBudgetStore(tmp_path / "c.db")  # budgets: FULL by default
    levels = [await s._writer.run(level) for s in (default, full, budgets)]
    assert levels == [1, 2, 2]
    for store in (default, full, budgets):
        await store.close()


@pytest.mark.parametrize("end", ["settle", "release"])
async def test_sqlite_prunes_past_minutes_and_never_revives_them(tmp_path: Path, end: str) -> None:
    import sqlite3

    clock = Clock(NOW)
    store = SQLiteBudgetStore(tmp_path / "b.db", clock=clock)
    old = await store.reserve("w", WINDOWS, Amounts(100, 500), now=NOW, hold_id="old")
    await store.reserve("x", WINDOWS, Amounts(3, 3), now=NOW, hold_id="other")
    clock.now = NOW + timedelta(minutes=1)
    await store.reserve("w", WINDOWS, Amounts(7, 30), now=clock.now, hold_id="new")
    if end == "settle":
        await store.settle(old, 10, 50)
    else:
        await store.release(old)
    await store.close()
    with sqlite3.connect(tmp_path / "b.db") as conn:
        minutes = conn.execute(
            "SELECT subject, kind, bucket FROM budget_counters"
            " WHERE kind IN ('tokens_minute', 'requests_minute') ORDER BY subject, kind"
        ).fetchall()
    assert minutes == [
        ("w", "requests_minute", "2026-11-29T10:16"),
        ("w", "tokens_minute", "2026-11-29T10:16"),
        ("x", "requests_minute", "2026-11-29T10:15"),  # another workload's: pruned by its own
        ("x", "tokens_minute", "2026-11-29T10:15"),
    ]
