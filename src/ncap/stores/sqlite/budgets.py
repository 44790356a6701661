"""Budgets persisted in SQLite: ``quota_scope=host``.

Every process on this host that points at the same file shares the counters: each
reservation reads, checks and writes all its windows inside one ``BEGIN IMMEDIATE``
transaction (SQLite's single write lock), so admission is atomic across windows and
across processes. In this process reservations go through the group-commit writer,
so many admissions share one commit while still being decided one after another.
(The file lock is not trustworthy on network filesystems, hence ``host``, not
``global``; Redis is the global store.)

Holds are rows, so a restart finds the ones a dead gateway left behind
(``recover_lost``); in-flight counts are derived from active holds, never stored,
so they cannot drift after a crash.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from ncap.config import utcnow
from ncap.domain.budget import Buckets, Usage
from ncap.domain.instants import iso_second
from ncap.stores._common import (
    Charge,
    Entry,
    HeldRow,
    Key,
    TwoPhaseBudgets,
    build_usage,
    check_actuals,
    hold_ref,
    release_entries,
    settle_entries,
    usage_keys,
)
from ncap.stores.ports import Hold
from ncap.stores.sqlite.connection import Migration, SQLiteWriter, Synchronous

__all__ = ["SQLiteBudgetStore"]

T = TypeVar("T")

MIGRATIONS: tuple[Migration, ...] = (
    (
        1,
        """
        CREATE TABLE budget_counters (
            subject TEXT NOT NULL,
            kind TEXT NOT NULL,
            bucket TEXT NOT NULL,
            amount INTEGER NOT NULL,
            PRIMARY KEY (subject, kind, bucket)
        ) WITHOUT ROWID;
        CREATE TABLE budget_holds (
            hold_id TEXT PRIMARY KEY,
            workload_id TEXT NOT NULL,
            exception_id TEXT,
            tokens INTEGER NOT NULL,
            cost_micros INTEGER NOT NULL,
            minute TEXT NOT NULL,
            day TEXT NOT NULL,
            month TEXT NOT NULL,
            gateway_instance TEXT NOT NULL,
            created_at TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('active', 'kept'))
        );
        CREATE INDEX budget_holds_workload_state ON budget_holds (workload_id, state)
        """,
    ),
    (
        2,
        # client Idempotency-Key records (sqlite/idempotency.py)
        """
        CREATE TABLE idempotency_keys (
            key TEXT PRIMARY KEY,
            record BLOB NOT NULL,
            expires_at REAL NOT NULL
        )
        """,
    ),
)

_HOLD_COLUMNS = (
    "hold_id, workload_id, exception_id, tokens, cost_micros, minute, day, month,"
    " gateway_instance, created_at, state"
)


class SQLiteBudgetStore(TwoPhaseBudgets):
    """``BudgetStore`` on a local SQLite file shared by this host's gateways."""

    quota_scope = "host"
    round_trip = False  # its writer thread is in this process

    def __init__(
        self,
        path: str | Path,
        *,
        gateway_instance: str = "local",
        clock: Callable[[], datetime] = utcnow,
        synchronous: Synchronous = "FULL",
    ) -> None:
        self.path = Path(path)
        self._instance = gateway_instance
        self._clock = clock
        self._writer = SQLiteWriter(self.path, MIGRATIONS, synchronous=synchronous)
        self._orphans: set[asyncio.Task[Any]] = set()

    async def run_in_transaction(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn`` in the writer's next transaction (the Idempotency-Key records share
        the file and its atomicity)."""
        return await self._writer.run(fn)

    async def _reserve(self, charge: Charge) -> Hold:
        def run(conn: sqlite3.Connection) -> Hold:
            exists = charge.hold_id is not None and _exists(conn, charge.hold_id)
            usage = _usage(conn, charge.workload_id, charge.exception_id, charge.buckets)
            hold, entries = charge.admit(usage, exists, self._instance)
            _prune_minutes(conn, charge.workload_id, charge.buckets.minute)
            _add(conn, entries, create=True)
            conn.execute(f"INSERT INTO budget_holds ({_HOLD_COLUMNS}) VALUES ({_Q11})", _row(hold))
            return hold

        task = asyncio.ensure_future(self._writer.run(run))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._release_orphan)
            raise

    async def settle(self, hold: Hold | str, actual_tokens: int, actual_cost_micros: int) -> bool:
        check_actuals(actual_tokens, actual_cost_micros)

        def run(conn: sqlite3.Connection) -> bool:
            held = _take(conn, hold_ref(hold))
            if held is None:
                return False
            _add(conn, settle_entries(held, actual_tokens, actual_cost_micros), create=False)
            return True

        return await self._writer.run(run)

    async def keep(self, hold: Hold | str) -> bool:
        sql = "UPDATE budget_holds SET state = 'kept' WHERE hold_id = ? AND state = 'active'"
        ref = hold_ref(hold)
        return await self._writer.run(lambda conn: conn.execute(sql, (ref,)).rowcount == 1)

    async def release(self, hold: Hold | str) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            held = _take(conn, hold_ref(hold))
            if held is None:
                return False
            _add(conn, release_entries(held), create=False)
            return True

        return await self._writer.run(run)

    async def outstanding(self, workload_id: str | None = None) -> list[Hold]:
        sql = (
            f"SELECT {_HOLD_COLUMNS} FROM budget_holds"
            " WHERE ? IS NULL OR workload_id = ? ORDER BY created_at, hold_id"
        )
        params = (workload_id, workload_id)
        return await self._writer.run(lambda conn: [_hold(r) for r in conn.execute(sql, params)])

    async def usage(
        self, workload_id: str, *, exception_id: str | None = None, now: datetime | None = None
    ) -> Usage:
        buckets = Buckets.at(now or self._clock())
        return await self._writer.run(lambda conn: _usage(conn, workload_id, exception_id, buckets))

    async def recover_lost(self, gateway_instance: str | None = None) -> int:
        sql = (
            "UPDATE budget_holds SET state = 'kept'"
            " WHERE state = 'active' AND (? IS NULL OR gateway_instance = ?)"
        )
        params = (gateway_instance, gateway_instance)
        return await self._writer.run(lambda conn: conn.execute(sql, params).rowcount)

    async def close(self) -> None:
        if self._orphans:
            await asyncio.gather(*self._orphans, return_exceptions=True)
        await self._writer.close()

    def _release_orphan(self, task: asyncio.Task[Hold]) -> None:
        """A caller cancelled while its reservation committed: give the hold back."""
        if task.cancelled() or task.exception() is not None:
            return
        orphan = asyncio.ensure_future(self.release(task.result()))
        self._orphans.add(orphan)
        orphan.add_done_callback(self._orphans.discard)


_Q11 = ", ".join("?" * 11)


def _usage(
    conn: sqlite3.Connection, workload_id: str, exception_id: str | None, buckets: Buckets
) -> Usage:
    in_flight = conn.execute(
        "SELECT COUNT(*) FROM budget_holds WHERE workload_id = ? AND state = 'active'",
        (workload_id,),
    ).fetchone()[0]
    return build_usage(
        usage_keys(workload_id, exception_id, buckets), lambda k: _read(conn, k), int(in_flight)
    )


def _read(conn: sqlite3.Connection, key: Key) -> int:
    row = conn.execute(
        "SELECT amount FROM budget_counters WHERE subject = ? AND kind = ? AND bucket = ?", key
    ).fetchone()
    return int(row[0]) if row else 0


def _add(conn: sqlite3.Connection, entries: list[Entry], *, create: bool) -> None:
    """Add amounts to counters; settlements (``create=False``) never revive a pruned bucket."""
    if create:
        sql = (
            "INSERT INTO budget_counters (subject, kind, bucket, amount) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (subject, kind, bucket) DO UPDATE SET amount = amount + excluded.amount"
        )
        conn.executemany(sql, entries)
    else:
        sql = (
            "UPDATE budget_counters SET amount = amount + ?"
            " WHERE subject = ? AND kind = ? AND bucket = ?"
        )
        conn.executemany(sql, [(a, s, w, b) for s, w, b, a in entries])


def _prune_minutes(conn: sqlite3.Connection, workload_id: str, minute: str) -> None:
    conn.execute(
        "DELETE FROM budget_counters WHERE subject = ?"
        " AND kind IN ('tokens_minute', 'requests_minute') AND bucket < ?",
        (workload_id, minute),
    )


def _exists(conn: sqlite3.Connection, hold_id: str) -> bool:
    sql = "SELECT 1 FROM budget_holds WHERE hold_id = ?"
    return conn.execute(sql, (hold_id,)).fetchone() is not None


def _take(conn: sqlite3.Connection, hold_id: str) -> HeldRow | None:
    """Remove a hold and return its counter columns (None when it was already settled
    or released): only what its entries need, no ``Hold`` built."""
    row = conn.execute(_TAKE, (hold_id,)).fetchone()
    if row is None:
        return None
    conn.execute("DELETE FROM budget_holds WHERE hold_id = ?", (hold_id,))
    return HeldRow(*row)


_TAKE = (
    "SELECT workload_id, exception_id, tokens, cost_micros, minute FROM budget_holds"
    " WHERE hold_id = ?"
)


def _row(hold: Hold) -> tuple[Any, ...]:
    return (
        hold.hold_id,
        hold.workload_id,
        hold.exception_id,
        hold.tokens,
        hold.cost_micros,
        hold.minute,
        hold.day,
        hold.month,
        hold.gateway_instance,
        _created(hold.created_at),
        hold.state,
    )


def _created(value: datetime) -> str:
    """``value.astimezone(UTC).isoformat()``, its seconds formatted once per second."""
    utc = value.astimezone(UTC)
    us = utc.microsecond
    return f"{iso_second(utc)}.{us:06d}+00:00" if us else f"{iso_second(utc)}+00:00"


def _hold(row: tuple[Any, ...]) -> Hold:
    (hold_id, workload, exception, tokens, cost, minute, day, month, instance, created, state) = row
    return Hold(
        hold_id=hold_id,
        workload_id=workload,
        exception_id=exception,
        tokens=tokens,
        cost_micros=cost,
        minute=minute,
        day=day,
        month=month,
        gateway_instance=instance,
        created_at=datetime.fromisoformat(created),
        state=state,
    )
