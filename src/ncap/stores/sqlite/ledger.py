"""The embedded ledger: one SQLite file in WAL mode, written by group commit.

``append`` returns once the row's transaction has committed (``_sqlite.SQLiteWriter``),
so the row is durable and visible to any new connection; reads use their own
connection and never wait for the writer. The schema is versioned in
``schema_version``; the column names are the ledger's (docs/ledger.md), then
ncap's own (``denied_by``, ``denied_limit``, ``denied_amount``, ``upstream_status``: migration 3;
``client_retry_count``: migration 4), which the
PostgreSQL adapter shares.
Timestamps are stored as fixed-width UTC ISO text
(``2026-11-29T10:15:00.000000Z``) so that text order is time order.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from functools import partial
from itertools import compress
from operator import is_not
from pathlib import Path
from typing import Any

import msgspec
from msgspec.structs import astuple

from ncap.config import Pricing
from ncap.domain.events import LEDGER_COLUMNS, LedgerEvent, ReconciliationRow
from ncap.domain.instants import iso_second
from ncap.stores._common import (
    apply_import,
    check_update_fields,
    decode_per_choice,
    encode_per_choice,
)
from ncap.stores._migrations import migrations
from ncap.stores.ports import DuplicateAttempt, ImportResult, RowUpdate, SpentTotal
from ncap.stores.sqlite.connection import (
    Migration,
    SQLiteReader,
    SQLiteWriter,
    Synchronous,
    connect,
)
from ncap.stores.sqlite.journal import Journal, recover, remove

__all__ = ["SQLiteLedgerStore", "export_rows"]

EXPORT_PAGE = 1000
EXPORT_MMAP = 1 << 30
_json = msgspec.json.Encoder(order="sorted").encode

# the whole schema of the ledger's file (ledger, instances, admin tables): one file per
# revision in sqlite/migrations/
MIGRATIONS: tuple[Migration, ...] = migrations("sqlite")

_COLUMNS = ", ".join(LEDGER_COLUMNS)
# The INSERT of each set of filled columns (a row's None columns are left out and take
# their default, NULL), a handful in practice. CPython's sqlite3 binds int, float, str
# and bytes directly but passes every other value, None included, through its adapter
# lookup, and a reserved row leaves about twenty columns empty.
_INSERTS: dict[tuple[bool, ...], str] = {}
_NULLS = (None,) * len(LEDGER_COLUMNS)
_SELECT = f"SELECT {_COLUMNS} FROM ledger_events"
# The lookups by state: each says ``state <> 'settled'``, the condition of the partial
# index that holds the state of every row not settled (revision 9), so SQLite uses it.
_HELD_ROWS = (
    f"{_SELECT} WHERE state IN ('reserved', 'pending', 'usage_reconciliation_required')"
    " AND state <> 'settled' AND policy_result = 'allow'"
    " ORDER BY timestamp, request_id, attempt"
)
_PENDING = (
    f"{_SELECT} WHERE state IN ('pending', 'usage_reconciliation_required', 'reserved')"
    " AND state <> 'settled' AND (state <> 'reserved' OR (? IS NOT NULL AND timestamp < ?))"
    " ORDER BY timestamp, request_id, attempt"
)
_MARK_LOST = (
    "UPDATE ledger_events SET state = 'usage_reconciliation_required', reconciliation_reason = ?"
    " WHERE state = 'reserved' AND state <> 'settled' AND (? IS NULL OR gateway_instance = ?)"
    " AND (? IS NULL OR timestamp < ?)"
)


class SQLiteLedgerStore:
    """``LedgerStore`` on a local SQLite file (WAL, group commit)."""

    def __init__(self, path: str | Path, *, synchronous: Synchronous = "NORMAL") -> None:
        self.path = Path(path)
        self._writer = SQLiteWriter(self.path, MIGRATIONS, synchronous=synchronous)
        self._reader = SQLiteReader(self.path)
        # the reserved rows' journal: where a commit is as durable as a write(2) to a
        # file (NORMAL, committed inline), an attempt waits for that write instead
        self._journal: Journal | None = None
        if self._writer.inline:
            _recover_now(self.path)
            self._journal = Journal(self.path)

    async def append(self, event: LedgerEvent) -> None:
        row = _encode_row(event)
        await self._writer.run(lambda conn: _insert(conn, event, row), single_statement=True)

    async def append_reserved(self, event: LedgerEvent) -> None:
        """Durable once written to the journal (``sqlite/journal.py``); the INSERT rides
        along with the next commit, and ``update`` of the row commits after it."""
        journal = self._journal
        if journal is None:
            await self.append(event)
            return
        row = _encode_row(event)
        file = journal.write(row)
        inserted = self._writer.submit(lambda conn: _insert(conn, event, row))
        inserted.add_done_callback(partial(journal.written, file))
        await asyncio.sleep(0)  # the loop's turn, as a commit gives it

    async def _flush(self) -> None:
        """Journaled rows into the table before a read that must see them."""
        if self._journal is not None and self._journal.unwritten:
            await self._writer.run(_nothing, single_statement=True)

    async def update(self, request_id: str, attempt: int, /, **fields: Any) -> None:
        check_update_fields(fields)
        if not fields:
            return
        encoded = dict(fields)
        for name in _SPECIAL_NAMES & encoded.keys():  # the rest are stored as they are
            encoded[name] = _encode(name, encoded[name])
        await self._writer.run(
            lambda conn: _update(conn, request_id, attempt, encoded), single_statement=True
        )

    async def update_many(self, updates: Sequence[RowUpdate]) -> None:
        """One job of the group commit for every row (in one savepoint: a row that is
        missing undoes the others, and the caller can apply them one by one). The
        lifecycle settles a tick's whole answers here, beside the answers: the job rides
        along with the next commit (``SQLiteWriter.run``)."""
        rows: list[RowUpdate] = []
        for request_id, attempt, fields in updates:
            check_update_fields(fields)
            if fields:
                special = _SPECIAL_NAMES & fields.keys()
                if special:
                    fields = dict(fields)
                    for name in special:  # the rest are stored as they are
                        fields[name] = _encode(name, fields[name])
                rows.append((request_id, attempt, fields))
        # the tick's settlement, beside the answers: it rides along with the next commit
        if len(rows) == 1:
            await self._writer.run(
                lambda conn: _update(conn, *rows[0]), single_statement=True, ride_along=True
            )
        elif rows:
            await self._writer.run(lambda conn: _update_all(conn, rows), ride_along=True)

    async def get(self, request_id: str) -> list[LedgerEvent]:
        await self._flush()
        sql = f"{_SELECT} WHERE request_id = ? ORDER BY attempt"
        return await self._reader.run(lambda conn: _fetch(conn, sql, (request_id,)))

    async def export(
        self, since: datetime | None = None, until: datetime | None = None
    ) -> AsyncIterator[LedgerEvent]:
        await self._flush()
        after: tuple[str, str, int] = (_ts(since) if since else "", "", -1)
        end = _ts(until) if until else "~"  # '~' sorts after every timestamp
        while True:
            page = await self._reader.run(partial(_export_page, after=after, end=end))
            for event in page:
                yield event
            if len(page) < EXPORT_PAGE:
                return
            last = page[-1]
            after = (_ts(last.timestamp), last.request_id, last.attempt)

    async def held_rows(self) -> AsyncIterator[LedgerEvent]:
        await self._flush()
        for event in await self._reader.run(lambda conn: _fetch(conn, _HELD_ROWS, ())):
            yield event

    async def spent_totals(self, since: datetime) -> AsyncIterator[SpentTotal]:
        await self._flush()
        stamp = _ts(since)
        for total in await self._reader.run(lambda conn: _spent_totals(conn, stamp)):
            yield total

    async def pending(self, reserved_before: datetime | None = None) -> list[LedgerEvent]:
        await self._flush()
        stamp = _ts(reserved_before) if reserved_before else None
        return await self._reader.run(lambda conn: _fetch(conn, _PENDING, (stamp, stamp)))

    async def mark_lost(
        self,
        gateway_instance: str | None = None,
        *,
        before: datetime | None = None,
        reason: str = "gateway_lost",
    ) -> int:
        stamp = _ts(before) if before else None

        def sweep(conn: sqlite3.Connection) -> tuple[list[tuple[Path, int]], int]:
            # a dead peer's journal first (its rows may not be in the table yet), in
            # the same transaction as the rows it marks
            found = recover(conn, self.path)
            return found, _mark_lost(conn, gateway_instance, stamp, reason)

        found, marked = await self._writer.run(sweep)
        remove(found)  # once committed
        return marked

    async def import_reconciliation(
        self, rows: Iterable[ReconciliationRow], *, pricing: Mapping[str, Pricing] | None = None
    ) -> ImportResult:
        batch = list(rows)
        return await self._writer.run(lambda conn: _import(conn, batch, pricing))

    def export_rows(
        self,
        since: datetime | None = None,
        until: datetime | None = None,
        *,
        select: str = _COLUMNS,
    ) -> Iterator[tuple[Any, ...]]:
        """The raw rows, streamed from the file (``export_rows``; also once closed)."""
        return export_rows(self.path, since, until, select=select)

    async def close(self) -> None:
        await self._writer.close()
        await self._reader.close()
        journal, self._journal = self._journal, None
        if journal is not None:
            journal.close()
            # whatever the last commit did not write (it failed) goes in now, or stays
            # in the file for the next start
            await asyncio.to_thread(_recover_now, self.path)


def _nothing(conn: sqlite3.Connection) -> None:
    """A job that only makes the writer commit what is queued before it."""


def _recover_now(path: Path) -> None:
    """The rows of journals no live process holds, inserted and committed."""
    conn = connect(path)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            found = recover(conn, path)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        remove(found)
    finally:
        conn.close()


def _ts(value: datetime) -> str:
    """``2026-11-29T10:15:00.000000Z`` (fixed width: text order is time order)."""
    if value.tzinfo is UTC:  # the gateway's own clock: already UTC
        utc = value
    elif value.tzinfo is None:
        raise ValueError("ledger timestamps must be timezone-aware")
    else:
        utc = value.astimezone(UTC)
    return f"{iso_second(utc)}.{utc.microsecond:06d}Z"  # the seconds formatted once each


def _encode(name: str, value: Any) -> Any:
    if name == "timestamp":
        return _ts(value)
    if name == "finish_reasons":
        return _json(value).decode()
    if name == "stream_mode":
        return int(bool(value))
    if name == "output_tokens_per_choice":
        return encode_per_choice(value)
    return value


_SPECIAL_NAMES = frozenset(
    ("timestamp", "finish_reasons", "stream_mode", "output_tokens_per_choice")
)
_TIMESTAMP, _FINISH_REASONS, _STREAM_MODE, _PER_CHOICE = (
    LEDGER_COLUMNS.index(name)
    for name in ("timestamp", "finish_reasons", "stream_mode", "output_tokens_per_choice")
)


def _encode_row(event: LedgerEvent) -> list[Any]:
    """The row's values in column order (the event's fields are the columns, in order:
    one C call copies them all); only four columns need converting."""
    row = list(astuple(event))
    row[_TIMESTAMP] = _ts(event.timestamp)
    row[_FINISH_REASONS] = _json(event.finish_reasons).decode()
    row[_STREAM_MODE] = int(bool(event.stream_mode))
    row[_PER_CHOICE] = encode_per_choice(event.output_tokens_per_choice)
    return row


def _decode_row(row: tuple[Any, ...]) -> LedgerEvent:
    values = dict(zip(LEDGER_COLUMNS, row, strict=True))
    values["timestamp"] = datetime.fromisoformat(values["timestamp"])
    values["finish_reasons"] = json.loads(values["finish_reasons"])
    values["stream_mode"] = bool(values["stream_mode"])
    values["output_tokens_per_choice"] = decode_per_choice(values["output_tokens_per_choice"])
    return LedgerEvent(**values)


def _insert(conn: sqlite3.Connection, event: LedgerEvent, row: list[Any]) -> None:
    filled = tuple(map(is_not, row, _NULLS))
    sql = _INSERTS.get(filled)
    if sql is None:
        sql = _insert_statement(filled)
    try:
        conn.execute(sql, tuple(compress(row, filled)))
    except sqlite3.IntegrityError as exc:
        if "UNIQUE" in str(exc):
            raise DuplicateAttempt(event.request_id, event.attempt) from exc
        raise


def _insert_statement(filled: tuple[bool, ...]) -> str:
    names = ", ".join(compress(LEDGER_COLUMNS, filled))
    sql = f"INSERT INTO ledger_events ({names}) VALUES ({', '.join('?' * sum(filled))})"
    if len(_INSERTS) < 256:
        _INSERTS[filled] = sql
    return sql


def _fetch(conn: sqlite3.Connection, sql: str, params: tuple[Any, ...]) -> list[LedgerEvent]:
    return [_decode_row(row) for row in conn.execute(sql, params)]


def export_rows(
    path: Path,
    since: datetime | None = None,
    until: datetime | None = None,
    *,
    select: str = _COLUMNS,
) -> Iterator[tuple[Any, ...]]:
    """The rows oldest first, from one read-only statement: by default the raw columns
    (``LEDGER_COLUMNS`` order, as stored: text timestamps, JSON finish reasons, 0/1
    stream mode, comma-separated per-choice tokens), or the caller's ``select`` list
    over them (``ncap ledger export`` has SQLite build its CSV cells). A large export
    streams at the speed of SQLite's cursor instead of building an event per row."""
    conn = connect(path)
    try:
        conn.execute("PRAGMA query_only = 1")
        # pages mapped, not read(2) into a copy: the export touches every page once
        conn.execute(f"PRAGMA mmap_size = {EXPORT_MMAP}")
        sql = (
            f"SELECT {select} FROM ledger_events WHERE timestamp >= ? AND timestamp < ? "
            "ORDER BY timestamp, request_id, attempt"
        )
        start = _ts(since) if since else ""
        end = _ts(until) if until else "~"  # '~' sorts after every timestamp
        cursor = conn.execute(sql, (start, end))
        while rows := cursor.fetchmany(EXPORT_PAGE):
            yield from rows
    finally:
        conn.close()


def _export_page(
    conn: sqlite3.Connection, after: tuple[str, str, int], end: str
) -> list[LedgerEvent]:
    sql = (
        f"{_SELECT} WHERE (timestamp, request_id, attempt) > (?, ?, ?) AND timestamp < ? "
        f"ORDER BY timestamp, request_id, attempt LIMIT {EXPORT_PAGE}"
    )
    return _fetch(conn, sql, (*after, end))


def _spent_totals(conn: sqlite3.Connection, since: str) -> list[SpentTotal]:
    """Spend per (workload, exception, minute), summed by SQLite: a month of rows costs
    a scan, not a Python object each. ``substr(timestamp, 1, 16)`` is the minute
    bucket (timestamps are fixed-width UTC ISO text)."""
    sql = (
        "SELECT workload_id, exception_id, substr(timestamp, 1, 16),"
        " COALESCE(SUM(total_tokens), 0), COALESCE(SUM(cost_micros), 0), COUNT(*)"
        " FROM ledger_events WHERE state IN ('settled', 'reconciled')"
        " AND usage_source != 'none' AND policy_result = 'allow'"
        " AND (timestamp >= ? OR exception_id IS NOT NULL) GROUP BY 1, 2, 3"
    )
    return [SpentTotal(*row) for row in conn.execute(sql, (since,))]


def _update(
    conn: sqlite3.Connection, request_id: str, attempt: int, fields: Mapping[str, Any]
) -> None:
    names = tuple(fields)
    sql = _UPDATES.get(names)
    if sql is None:  # one statement text per set of columns (a handful in practice)
        assignments = ", ".join(f"{name} = ?" for name in names)
        sql = f"UPDATE ledger_events SET {assignments} WHERE request_id = ? AND attempt = ?"
        if len(_UPDATES) < 256:
            _UPDATES[names] = sql
    cur = conn.execute(sql, (*fields.values(), request_id, attempt))
    if cur.rowcount == 0:
        raise KeyError(f"no ledger row for request {request_id!r} attempt {attempt}")


def _update_all(conn: sqlite3.Connection, rows: list[RowUpdate]) -> None:
    for request_id, attempt, fields in rows:
        _update(conn, request_id, attempt, fields)


_UPDATES: dict[tuple[str, ...], str] = {}


def _mark_lost(
    conn: sqlite3.Connection, instance: str | None, before: str | None, reason: str
) -> int:
    cur = conn.execute(_MARK_LOST, (reason, instance, instance, before, before))
    return cur.rowcount


def _import(
    conn: sqlite3.Connection,
    rows: list[ReconciliationRow],
    pricing: Mapping[str, Pricing] | None,
) -> ImportResult:
    def find(provider_request_id: str) -> list[LedgerEvent]:
        sql = f"{_SELECT} WHERE provider_request_id = ? ORDER BY request_id, attempt"
        return _fetch(conn, sql, (provider_request_id,))

    def write(event: LedgerEvent) -> None:
        names = [n for n in LEDGER_COLUMNS if n not in ("request_id", "attempt")]
        encoded = {name: _encode(name, getattr(event, name)) for name in names}
        _update(conn, event.request_id, event.attempt, encoded)

    return apply_import(rows, find, write, pricing)
