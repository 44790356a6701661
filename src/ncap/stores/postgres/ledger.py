"""The shared ledger on PostgreSQL: the same columns and semantics as the SQLite one.

GROUP COMMIT, as in SQLite: callers queue their writes and await a future; one writer
task takes everything queued and runs it as one transaction — all queued appends as
one multi-row ``INSERT … SELECT FROM unnest(…)``, the updates that set the same columns
as one ``UPDATE … FROM unnest(…)`` — and only after the commit resolves the futures.
That transaction is normally one statement (the insert and updates joined as
data-modifying ``WITH`` queries), sent without ``BEGIN``/``COMMIT``: one statement is
atomic and committed before its answer comes back, so a batch costs one round trip,
not three or more. An acknowledged ``append`` is therefore committed before the
attempt is dispatched, while the hot path pays one commit per batch rather than per
request. If a batch fails for a reason other than the connection, each of its writes
is retried alone, so one bad write fails alone; a connection failure fails the batch
with ``StoreUnavailable``.

How durable a commit is follows ``stores.ledger_durability``, as on SQLite: ``normal``
(the default) runs the ledger's connections at ``synchronous_commit = off`` — a
committed row survives the gateway being killed at any point (it is in the server,
not the client), and only a crash of the PostgreSQL server or its host may lose the
last commits (at most three ``wal_writer_delay``, ~600 ms by default; the database is
never corrupted) — and ``full`` keeps the server's own ``synchronous_commit`` (``on``
unless configured otherwise: the WAL is flushed, and replicated if so configured,
before the commit returns).

Duplicates: the insert is ``ON CONFLICT DO NOTHING RETURNING`` the keys it wrote, so a
second row for a (request_id, attempt) is refused with ``DuplicateAttempt`` without
failing its neighbours. The driver is asyncpg (measured against psycopg 3:
``bench/pg_driver.py``, docs/decisions/postgres-driver-asyncpg.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import asyncpg
from msgspec.structs import astuple

from ncap.config import LedgerDurability, Pricing
from ncap.domain.events import LEDGER_COLUMNS, LedgerEvent, ReconciliationRow
from ncap.errors import StoreUnavailable
from ncap.stores._common import (
    apply_import,
    check_update_fields,
    decode_per_choice,
    encode_per_choice,
)
from ncap.stores.ports import DuplicateAttempt, ImportResult, RowUpdate, SpentTotal
from ncap.stores.postgres.pool import STORE_TIMEOUT_S, PostgresPool, mapped

__all__ = ["PostgresLedgerStore"]

Conn = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy
EXPORT_PAGE = 1000
MAX_BATCH = 512

_TYPES: dict[str, str] = {
    "timestamp": "timestamptz",
    "attempt": "int4",
    "requested_candidate_count": "int4",
    "effective_candidate_count": "int4",
    "returned_candidate_count": "int4",
    "input_tokens": "int8",
    "cached_input_tokens": "int8",
    "output_tokens_total": "int8",
    "reasoning_tokens": "int8",
    "total_tokens": "int8",
    "reserved_input_tokens": "int8",
    "reserved_output_tokens": "int8",
    "reserved_cost_micros": "int8",
    "cost_micros": "int8",
    "finish_reasons": "jsonb",
    "stream_mode": "bool",
    "latency_ms": "float8",
    "denied_limit": "int8",
    "denied_amount": "int8",
    "upstream_status": "int4",
    "client_retry_count": "int4",
    "candidates_compared": "int4",
    "candidates_distinct": "int4",
    "candidates_majority": "int4",
    "candidates_tool_calls": "int4",
}
# ledger_durability -> the connections' synchronous_commit (None: the server's own)
_SYNCHRONOUS: dict[LedgerDurability, str | None] = {"normal": "off", "full": None}
_COLUMNS = ", ".join(LEDGER_COLUMNS)
_SELECT = f"SELECT {_COLUMNS} FROM ledger_events"
_INSERT_ROWS = (
    f"INSERT INTO ledger_events ({_COLUMNS}) SELECT * FROM unnest("
    + ", ".join(f"${i}::{_TYPES.get(c, 'text')}[]" for i, c in enumerate(LEDGER_COLUMNS, 1))
    + ") ON CONFLICT (request_id, attempt) DO NOTHING RETURNING 0, request_id, attempt"
)
_INSERT_ONE = (
    f"INSERT INTO ledger_events ({_COLUMNS}) VALUES ("
    + ", ".join(f"${i}::{_TYPES.get(c, 'text')}" for i, c in enumerate(LEDGER_COLUMNS, 1))
    + ") ON CONFLICT (request_id, attempt) DO NOTHING RETURNING 0, request_id, attempt"
)
_INSERT = _INSERT_ROWS.replace("RETURNING 0, ", "RETURNING ")
# the columns a row's values need converting in, by index
_FINISH_REASONS, _PER_CHOICE = (
    LEDGER_COLUMNS.index(name) for name in ("finish_reasons", "output_tokens_per_choice")
)


@dataclass(slots=True)
class _Write:
    kind: Literal["append", "update"]
    key: tuple[str, int]
    values: Any  # the encoded row (append) or the encoded fields (update)
    future: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class PostgresLedgerStore:
    """``LedgerStore`` on PostgreSQL, shared by every replica."""

    def __init__(
        self,
        url: str,
        *,
        durability: LedgerDurability = "normal",
        max_batch: int = MAX_BATCH,
        timeout_s: float = STORE_TIMEOUT_S,
    ) -> None:
        self.pool = PostgresPool(
            url, store="ledger", synchronous_commit=_SYNCHRONOUS[durability], timeout_s=timeout_s
        )
        self._max_batch = max_batch
        self._queue: list[_Write] = []
        self._wake: asyncio.Event | None = None
        self._writer: asyncio.Task[None] | None = None
        # the writer's connection, kept between batches
        self._conn: asyncpg.pool.PoolConnectionProxy[Any] | None = None
        self._conn_pool: asyncpg.Pool | None = None
        self._closed = False

    # -- writes (group commit) ---------------------------------------------------------

    async def append(self, event: LedgerEvent) -> None:
        await self._submit(_Write("append", (event.request_id, event.attempt), _encode_row(event)))

    async def append_reserved(self, event: LedgerEvent) -> None:
        await self.append(event)  # a subclass's ``append`` included

    async def update(self, request_id: str, attempt: int, /, **fields: Any) -> None:
        check_update_fields(fields)
        if fields:
            encoded = {name: _encode(name, value) for name, value in fields.items()}
            await self._submit(_Write("update", (request_id, attempt), encoded))

    async def update_many(self, updates: Sequence[RowUpdate]) -> None:
        writes = []
        for request_id, attempt, fields in updates:
            check_update_fields(fields)
            if fields:
                encoded = {name: _encode(name, value) for name, value in fields.items()}
                writes.append(_Write("update", (request_id, attempt), encoded))
        if writes:
            await self._submit(*writes)

    async def _submit(self, *writes: _Write) -> None:
        """Queue ``writes`` for the next batch and wait for all of them; the first
        failure is raised once every one is done."""
        if self._closed:
            raise RuntimeError("PostgreSQL ledger is closed")
        self._queue.extend(writes)
        if self._writer is None or self._writer.done():
            self._wake = asyncio.Event()
            self._writer = asyncio.create_task(self._write_loop())
        assert self._wake is not None
        self._wake.set()
        # bounded from submission: a write queued behind a batch that hangs (a partition)
        # fails on time, and is never sent if its batch had not started
        deadline = asyncio.get_running_loop().call_later(self.pool.timeout_s, _expire, writes)
        failure: BaseException | None = None
        try:
            for write in writes:
                try:
                    await write.future
                except Exception as exc:
                    failure = failure or exc
        except asyncio.CancelledError:
            for write in writes:  # a caller cancelled before its batch starts writes nothing
                write.future.cancel()
            raise
        finally:
            deadline.cancel()
        if failure is not None:
            raise failure

    async def _write_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = [w for w in self._queue[: self._max_batch] if not w.future.done()]
                del self._queue[: self._max_batch]
                if batch:
                    try:
                        await self._commit(batch)
                    except Exception as exc:  # never leave a caller waiting on a dead writer
                        for write in batch:
                            if not write.future.done():
                                write.future.set_exception(exc)
            if self._closed:
                return

    async def _commit(self, batch: list[_Write]) -> None:
        try:
            # bounded as every store call: a partition fails the batch, never hangs it
            async with asyncio.timeout(self.pool.timeout_s):
                outcomes = await _run_batch(await self._connection(), batch)
        except StoreUnavailable as exc:
            outcomes = [exc] * len(batch)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            if _connection_lost(exc):
                await self._drop_connection(terminate=True)
                outcomes = [_unavailable(exc)] * len(batch)
            else:  # one bad write: each alone, so it fails alone
                outcomes = [await _run_alone(self.pool, write) for write in batch]
        for write, outcome in zip(batch, outcomes, strict=True):
            if write.future.done():
                continue
            if outcome is None:
                write.future.set_result(None)
            else:
                write.future.set_exception(outcome)

    async def _connection(self) -> asyncpg.pool.PoolConnectionProxy[Any]:
        """The writer's connection: checked out of the writer pool once and kept while it
        works. At c=1 a batch is one write, and a checkout and release per batch were
        about a third of the write path's CPU (asyncpg releases under ``shield`` and a
        timeout: a task each). A lost connection is dropped and the next batch takes a
        new one."""
        if self._conn is None or not _usable(self._conn):
            await self._drop_connection(terminate=True)
            pool = await self.pool.writer()
            self._conn = await pool.acquire()
            self._conn_pool = pool
        return self._conn

    async def _drop_connection(self, *, terminate: bool) -> None:
        conn, pool, self._conn, self._conn_pool = self._conn, self._conn_pool, None, None
        if conn is None or pool is None:
            return
        # a lost connection may already be back in its pool (asyncpg releases a proxy
        # whose connection closed): terminating or releasing it again is refused
        with contextlib.suppress(asyncpg.InterfaceError, asyncpg.PostgresError, OSError):
            if terminate:  # its state after a lost round trip is unknown: never reused
                conn.terminate()
            await pool.release(conn)

    # -- reads -------------------------------------------------------------------------

    async def get(self, request_id: str) -> list[LedgerEvent]:
        rows = await self.pool.fetch(
            f"{_SELECT} WHERE request_id = $1 ORDER BY attempt", request_id
        )
        return [_decode(r) for r in rows]

    async def export(
        self, since: datetime | None = None, until: datetime | None = None
    ) -> AsyncIterator[LedgerEvent]:
        after: tuple[datetime | None, str, int] = (since, "", -1)
        while True:
            rows = await self.pool.fetch(
                f"{_SELECT} WHERE ($1::timestamptz IS NULL OR timestamp >= $1)"
                " AND ($4::timestamptz IS NULL OR timestamp < $4)"
                " AND ($5::timestamptz IS NULL OR (timestamp, request_id, attempt) > ($5, $2, $3))"
                f" ORDER BY timestamp, request_id, attempt LIMIT {EXPORT_PAGE}",
                since,
                after[1],
                after[2],
                until,
                after[0] if after[2] >= 0 else None,
            )
            for row in rows:
                yield _decode(row)
            if len(rows) < EXPORT_PAGE:
                return
            last = rows[-1]
            after = (last["timestamp"], last["request_id"], last["attempt"])

    async def pending(self, reserved_before: datetime | None = None) -> list[LedgerEvent]:
        rows = await self.pool.fetch(
            f"{_SELECT} WHERE (state IN ('pending', 'usage_reconciliation_required')"
            " OR ($1::timestamptz IS NOT NULL AND state = 'reserved' AND timestamp < $1))"
            " AND state <> 'settled'"
            " ORDER BY timestamp, request_id, attempt",
            reserved_before,
        )
        return [_decode(r) for r in rows]

    async def held_rows(self) -> AsyncIterator[LedgerEvent]:
        """Admitted rows still holding their reservation (``BudgetHistory``)."""
        rows = await self.pool.fetch(
            f"{_SELECT} WHERE state IN ('reserved', 'pending', 'usage_reconciliation_required')"
            " AND state <> 'settled'"
            " AND policy_result = 'allow' ORDER BY timestamp, request_id, attempt"
        )
        for row in rows:
            yield _decode(row)

    async def spent_totals(self, since: datetime) -> AsyncIterator[SpentTotal]:
        """Spend per (workload, exception, UTC minute), summed by the server."""
        rows = await self.pool.fetch(
            "SELECT workload_id, exception_id,"
            " to_char(timestamp AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI'),"
            " COALESCE(SUM(total_tokens), 0), COALESCE(SUM(cost_micros), 0), COUNT(*)"
            " FROM ledger_events WHERE state IN ('settled', 'reconciled')"
            " AND usage_source != 'none' AND policy_result = 'allow'"
            " AND (timestamp >= $1 OR exception_id IS NOT NULL) GROUP BY 1, 2, 3",
            since,
        )
        for r in rows:
            yield SpentTotal(r[0], r[1], r[2], int(r[3]), int(r[4]), int(r[5]))

    async def mark_lost(
        self,
        gateway_instance: str | None = None,
        *,
        before: datetime | None = None,
        reason: str = "gateway_lost",
    ) -> int:
        status = await self.pool.execute(
            "UPDATE ledger_events SET state = 'usage_reconciliation_required',"
            " reconciliation_reason = $3"
            " WHERE state = 'reserved' AND state <> 'settled'"
            " AND ($1::text IS NULL OR gateway_instance = $1)"
            " AND ($2::timestamptz IS NULL OR timestamp < $2)",
            gateway_instance,
            before,
            reason,
        )
        return int(status.split()[-1])

    async def import_reconciliation(
        self, rows: Iterable[ReconciliationRow], *, pricing: Mapping[str, Pricing] | None = None
    ) -> ImportResult:
        batch = list(rows)
        pool = await self.pool.get()
        with mapped():
            async with pool.acquire() as conn, conn.transaction():
                return await _import(conn, batch, pricing)

    async def ping(self) -> None:
        await self.pool.fetch("SELECT 1")

    async def close(self) -> None:
        self._closed = True
        if self._writer is not None and not self._writer.done():
            assert self._wake is not None
            self._wake.set()
            await asyncio.gather(self._writer, return_exceptions=True)
        await self._drop_connection(terminate=False)
        await self.pool.close()


async def _run_batch(conn: Conn, batch: list[_Write]) -> list[BaseException | None]:
    """The batch in one transaction. Usually that is one statement, so one round trip
    with no ``BEGIN``/``COMMIT`` (a statement is atomic by itself): every append in one
    ``INSERT``, the updates by the columns they set, each set one ``UPDATE``, joined
    as data-modifying ``WITH`` queries. A key updated twice, or appended and updated in
    the same batch, would not see its own earlier write inside one statement: such a
    batch runs statement by statement in an explicit transaction."""
    outcomes: list[BaseException | None] = [None] * len(batch)
    appends = [i for i, w in enumerate(batch) if w.kind == "append"]
    updates = [i for i, w in enumerate(batch) if w.kind == "update"]
    groups = _update_groups(batch, appends, updates)
    if groups is not None:
        await _in_one_statement(conn, batch, appends, groups, outcomes)
    else:
        async with conn.transaction():
            await _one_by_one(conn, batch, appends, updates, outcomes)
    return outcomes


async def _in_one_statement(
    conn: Conn,
    batch: list[_Write],
    appends: list[int],
    groups: dict[tuple[str, ...], list[int]],
    outcomes: list[BaseException | None],
) -> None:
    """One row is sent as plain parameters, several as one array per column (asyncpg
    encodes 45 one-element arrays at about twice the cost of 45 scalars)."""
    args: list[Any] = []
    if len(appends) == 1:
        args += batch[appends[0]].values
    elif appends:
        args += zip(*(batch[i].values for i in appends), strict=True)
    for names, members in groups.items():
        if len(members) == 1:
            write = batch[members[0]]
            args += (*write.key, *write.values.values())
        else:
            args += ([batch[i].key[0] for i in members], [batch[i].key[1] for i in members])
            args += ([batch[i].values[n] for i in members] for n in names)
    shape = tuple((names, len(members) == 1) for names, members in groups.items())
    rows = await conn.fetch(_statement(min(len(appends), 2), shape), *args)
    written = {(r[1], r[2]) for r in rows if r[0] == 0}
    updated = {(r[1], r[2]) for r in rows if r[0] == 1}
    _duplicates(batch, appends, written, outcomes)
    for members in groups.values():
        for i in members:
            if batch[i].key not in updated:
                outcomes[i] = _no_row(batch[i].key)


async def _one_by_one(
    conn: Conn,
    batch: list[_Write],
    appends: list[int],
    updates: list[int],
    outcomes: list[BaseException | None],
) -> None:
    if appends:
        columns = list(zip(*(batch[i].values for i in appends), strict=True))
        written = {(r[0], r[1]) for r in await conn.fetch(_INSERT, *columns)}
        _duplicates(batch, appends, written, outcomes)
    for i in updates:
        outcomes[i] = await _update(conn, batch[i])


def _duplicates(
    batch: list[_Write],
    appends: list[int],
    written: set[tuple[str, int]],
    outcomes: list[BaseException | None],
) -> None:
    for i in appends:
        key = batch[i].key
        if key in written:
            written.discard(key)  # a second append of the same key in a batch
        else:
            outcomes[i] = DuplicateAttempt(*key)


def _update_groups(
    batch: list[_Write], appends: list[int], updates: list[int]
) -> dict[tuple[str, ...], list[int]] | None:
    """The updates by the columns they set; None when one statement cannot hold the
    batch (a key updated twice, or updated in the batch that appends it)."""
    groups: dict[tuple[str, ...], list[int]] = {}
    keys = {batch[i].key for i in appends}
    for i in updates:
        write = batch[i]
        if write.key in keys:
            return None
        keys.add(write.key)
        groups.setdefault(tuple(write.values), []).append(i)
    return groups


@lru_cache(maxsize=128)
def _statement(appends: int, groups: tuple[tuple[tuple[str, ...], bool], ...]) -> str:
    """The batch's one statement; its rows are (0 appended | 1 updated, request_id,
    attempt). ``appends``: 0, 1 or 2 (several); each group: its columns, and whether it
    is a single update."""
    parts: list[str] = []
    n = 1
    if appends:
        parts.append(_INSERT_ONE if appends == 1 else _INSERT_ROWS)
        n += len(LEDGER_COLUMNS)
    for names, single in groups:
        parts.append(_update_one(names, n) if single else _update_many(names, n))
        n += 2 + len(names)
    if len(parts) == 1:
        return parts[0]
    ctes = ", ".join(f"w{j} AS ({sql})" for j, sql in enumerate(parts))
    union = " UNION ALL ".join(f"SELECT * FROM w{j}" for j in range(len(parts)))
    return f"WITH {ctes} {union}"


def _update_many(names: tuple[str, ...], first: int) -> str:
    """``UPDATE … FROM unnest(…)``: each row of the arrays updates its (request_id, attempt)."""
    columns = ("request_id", "attempt", *names)
    types = ("text", "int4", *(_TYPES.get(n, "text") for n in names))
    arrays = ", ".join(f"${i}::{t}[]" for i, t in enumerate(types, first))
    aliases = ", ".join(f'"{c}"' for c in columns)
    assignments = ", ".join(f'"{n}" = v."{n}"' for n in names)
    return (
        f"UPDATE ledger_events AS l SET {assignments} FROM unnest({arrays}) AS v({aliases})"
        " WHERE l.request_id = v.request_id AND l.attempt = v.attempt"
        " RETURNING 1, l.request_id, l.attempt"
    )


def _update_one(names: tuple[str, ...], first: int) -> str:
    assignments = ", ".join(
        f'"{n}" = ${i}::{_TYPES.get(n, "text")}' for i, n in enumerate(names, first + 2)
    )
    return (
        f"UPDATE ledger_events SET {assignments}"
        f" WHERE request_id = ${first} AND attempt = ${first + 1}"
        " RETURNING 1, request_id, attempt"
    )


async def _run_alone(pool: PostgresPool, write: _Write) -> BaseException | None:
    try:
        async with asyncio.timeout(pool.timeout_s), (await pool.writer()).acquire() as conn:
            return (await _run_batch(conn, [write]))[0]
    except StoreUnavailable as exc:
        return exc
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
        return _unavailable(exc)


async def _update(conn: Conn, write: _Write) -> BaseException | None:
    fields: dict[str, Any] = write.values
    names = list(fields)
    assignments = ", ".join(f"{n} = ${i}" for i, n in enumerate(names, 3))
    status = await conn.execute(
        f"UPDATE ledger_events SET {assignments} WHERE request_id = $1 AND attempt = $2",
        *write.key,
        *fields.values(),
    )
    if status.split()[-1] == "0":
        return _no_row(write.key)
    return None


def _expire(writes: Sequence[_Write]) -> None:
    for write in writes:
        if not write.future.done():
            write.future.set_exception(StoreUnavailable("ledger", "PostgreSQL", "TimeoutError"))


def _no_row(key: tuple[str, int]) -> KeyError:
    return KeyError(f"no ledger row for request {key[0]!r} attempt {key[1]}")


def _usable(conn: asyncpg.pool.PoolConnectionProxy[Any]) -> bool:
    """Still checked out and open (a proxy asyncpg released refuses every call)."""
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False


def _connection_lost(exc: BaseException) -> bool:
    return isinstance(
        exc,
        asyncpg.PostgresConnectionError
        | asyncpg.InterfaceError
        | asyncpg.CannotConnectNowError
        | OSError
        | TimeoutError,
    )


def _unavailable(exc: BaseException) -> StoreUnavailable:
    error = StoreUnavailable("ledger", "PostgreSQL", type(exc).__name__)
    error.__cause__ = exc
    return error


def _encode_row(event: LedgerEvent) -> tuple[Any, ...]:
    """``_encode`` of every column, in column order (the event's fields are the columns,
    in order: one C call copies them all)."""
    if event.timestamp.tzinfo is None:
        raise ValueError("ledger timestamps must be timezone-aware")
    row = list(astuple(event))
    row[_FINISH_REASONS] = _JSON_SORTED(event.finish_reasons)
    row[_PER_CHOICE] = encode_per_choice(event.output_tokens_per_choice)
    return tuple(row)


# json.dumps(value, sort_keys=True), without building an encoder per call (~4 µs)
_JSON_SORTED = json.JSONEncoder(sort_keys=True).encode


def _encode(name: str, value: Any) -> Any:
    if name == "finish_reasons":
        return _JSON_SORTED(value)
    if name == "output_tokens_per_choice":
        return encode_per_choice(value)
    if name == "timestamp" and value.tzinfo is None:
        raise ValueError("ledger timestamps must be timezone-aware")
    return value


def _decode(row: asyncpg.Record) -> LedgerEvent:
    values = dict(row.items())
    values["finish_reasons"] = json.loads(values["finish_reasons"])
    values["output_tokens_per_choice"] = decode_per_choice(values["output_tokens_per_choice"])
    return LedgerEvent(**values)


async def _import(
    conn: Conn,
    rows: list[ReconciliationRow],
    pricing: Mapping[str, Pricing] | None,
) -> ImportResult:
    """Every candidate row is read (and locked) once, then the reconciled ones written."""
    ids = sorted({r.provider_request_id for r in rows})
    found: dict[str, list[LedgerEvent]] = {}
    records = await conn.fetch(
        f"{_SELECT} WHERE provider_request_id = ANY($1::text[])"
        " ORDER BY request_id, attempt FOR UPDATE",
        ids,
    )
    for record in records:
        event = _decode(record)
        found.setdefault(event.provider_request_id or "", []).append(event)
    writes: list[LedgerEvent] = []

    def write(event: LedgerEvent) -> None:
        writes.append(event)
        found[event.provider_request_id or ""] = [
            event if (e.request_id, e.attempt) == (event.request_id, event.attempt) else e
            for e in found[event.provider_request_id or ""]
        ]

    result = apply_import(rows, lambda pid: list(found.get(pid, [])), write, pricing)
    names = [n for n in LEDGER_COLUMNS if n not in ("request_id", "attempt")]
    for event in writes:
        values = {n: _encode(n, getattr(event, n)) for n in names}
        await _update(conn, _Write("update", (event.request_id, event.attempt), values))
    return result
