"""The admin store: what the admin API changed (exceptions, API keys), its audit trail,
and the budget alerts already fired, in the ledger's database (SQLite DDL in
``stores/admin_schema.py``, PostgreSQL's in migration ``0006_admin.sql``).

Every change is one transaction that writes the entry (or its revocation) and its
audit row together, so the trail cannot miss a change that took effect. The store is
read whole (``changes``) at start-up, after each local change and every
``stores.admin_refresh_s`` (``http/admin.GrantsSync``, so that the replicas of a shared
ledger see each other's changes), and merged with the config by
``domain.grants.Grants``. Admin changes are rare: the SQLite adapter runs plain
``sqlite3`` calls in a worker thread behind one lock; the PostgreSQL one has a small
pool of its own on the ledger's URL (schema migrated by the same revisions), at the
server's own ``synchronous_commit`` (a committed revocation survives a server crash).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import asyncpg

from ncap.config import ExceptionGrant, KeyEntry
from ncap.domain.grants import GrantChanges
from ncap.errors import ConfigError, StoreUnavailable
from ncap.stores._postgres import PostgresPool, mapped
from ncap.stores.admin_schema import SQLITE_DDL

__all__ = [
    "AdminChange",
    "AdminStore",
    "AuditEntry",
    "BudgetAlertRow",
    "DuplicateGrant",
    "MemoryAdminStore",
    "PostgresAdminStore",
    "SQLiteAdminStore",
    "admin_store_for_ledger",
]

log = logging.getLogger("ncap.admin")
# "session": the dashboard's sign-out, which ends every browser session signed in
# before it; only an audit row (the latest one's instant is read back by ``changes``)
Kind = Literal["exception", "key", "session"]
Action = Literal["create", "revoke"]
T = TypeVar("T")


class DuplicateGrant(Exception):
    """An id already used by an entry the admin API created (ids are never reused, so
    the audit trail names one entry per id)."""


@dataclass(frozen=True, slots=True)
class AdminChange:
    """One admin change: ``entry`` for a create, None for a revoke of ``target``."""

    actor: str
    action: Action
    kind: Kind
    target: str
    entry: ExceptionGrant | KeyEntry | None = None
    # the name the request gave for whoever made it (``X-Ncap-Actor``): not verified,
    # so kept in the audit's detail beside the entry, never as its actor
    claimed_by: str | None = None


@dataclass(frozen=True, slots=True)
class AuditEntry:
    seq: int
    at: datetime
    actor: str
    action: str
    kind: str
    target: str
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True)
class BudgetAlertRow:
    """One threshold crossed in one window period (``budget_alerts``)."""

    subject: str  # workload id, or exception id for scope "exception"
    scope: str  # day | month | exception
    period: str  # 2026-12-01 | 2026-12 | life
    threshold_pct: int
    fired_at: datetime
    spent_micros: int
    limit_micros: int
    workload: str | None = None  # whose budget (for logs; not stored)


class AdminStore(Protocol):
    async def changes(self) -> GrantChanges: ...

    async def record(self, change: AdminChange, at: datetime) -> None:
        """Apply one change and its audit row atomically."""
        ...

    async def audit(self, limit: int = 1000) -> list[AuditEntry]: ...

    async def claim_alert(self, alert: BudgetAlertRow) -> bool:
        """True for the first claim of (subject, scope, period, threshold) only."""
        ...

    async def mark_delivered(self, alert: BudgetAlertRow) -> None: ...

    async def close(self) -> None: ...


def _entry(entry: ExceptionGrant | KeyEntry | None) -> dict[str, Any]:
    return entry.model_dump(mode="json") if entry is not None else {}


def _detail(change: AdminChange) -> dict[str, Any]:
    """The audit row's detail: the entry, and the name the request claimed, if any."""
    detail = _entry(change.entry)
    if change.claimed_by is not None:
        detail["claimed_actor"] = change.claimed_by
    return detail


class MemoryAdminStore:
    """The admin store of a ``memory://`` ledger (nothing survives the process)."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], dict[str, Any] | None] = {}
        self._revoked: set[tuple[str, str]] = set()
        self._audit: list[AuditEntry] = []
        self._alerts: set[tuple[str, str, str, int]] = set()

    async def changes(self) -> GrantChanges:
        ended = [e.at for e in self._audit if e.kind == "session"]
        return _changes(
            [(k, i, b, (k, i) in self._revoked) for (k, i), b in self._rows.items()],
            self._revoked,
            max(ended, default=None),
        )

    async def record(self, change: AdminChange, at: datetime) -> None:
        key = (change.kind, change.target)
        if change.kind == "session":
            pass
        elif change.action == "create":
            if key in self._rows:
                raise DuplicateGrant(change.target)
            self._rows[key] = _entry(change.entry)
        else:
            self._rows.setdefault(key, None)
            self._revoked.add(key)
        self._audit.append(
            AuditEntry(
                len(self._audit) + 1,
                at,
                change.actor,
                change.action,
                change.kind,
                change.target,
                _detail(change),
            )
        )

    async def audit(self, limit: int = 1000) -> list[AuditEntry]:
        return self._audit[-limit:]

    async def claim_alert(self, alert: BudgetAlertRow) -> bool:
        key = (alert.subject, alert.scope, alert.period, alert.threshold_pct)
        if key in self._alerts:
            return False
        self._alerts.add(key)
        return True

    async def mark_delivered(self, alert: BudgetAlertRow) -> None:
        return None

    async def close(self) -> None:
        return None


class SQLiteAdminStore:
    """The admin tables in the SQLite ledger file (WAL: the ledger's writer and these
    short transactions wait for each other through ``busy_timeout``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA busy_timeout = 10000")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.executescript(SQLITE_DDL)
            self._conn = conn
        return self._conn

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """``work`` on the connection, in a thread. A file that cannot be opened as the
        admin tables is a configuration problem (naming the file); a failure once open
        (the file locked past the busy timeout, a disk error) is the store being
        unavailable, a 503 as on PostgreSQL."""

        def locked() -> T:
            with self._lock:
                try:
                    conn = self._connection()
                except sqlite3.Error as exc:
                    raise ConfigError(f"admin tables in {self.path}: {exc}") from exc
                try:
                    return work(conn)
                except sqlite3.Error as exc:
                    raise StoreUnavailable("admin", "SQLite", type(exc).__name__) from exc

        return await asyncio.to_thread(locked)

    async def changes(self) -> GrantChanges:
        def read(conn: sqlite3.Connection) -> GrantChanges:
            rows = conn.execute(
                "SELECT kind, id, body, revoked_at IS NOT NULL FROM admin_grants"
                " ORDER BY created_at"
            ).fetchall()
            parsed = [(k, i, json.loads(b) if b else None, bool(r)) for k, i, b, r in rows]
            (ended,) = conn.execute(
                "SELECT max(at) FROM admin_audit WHERE kind = 'session'"
            ).fetchone()
            ended_at = datetime.fromisoformat(ended) if ended else None
            return _changes(parsed, {(k, i) for k, i, _, r in parsed if r}, ended_at)

        return await self._run(read)

    async def record(self, change: AdminChange, at: datetime) -> None:
        stamp = _stamp(at)
        body = json.dumps(_entry(change.entry), sort_keys=True)
        detail = json.dumps(_detail(change), sort_keys=True)

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            try:
                _write_grant(conn, change, body, stamp)
                conn.execute(
                    "INSERT INTO admin_audit (at, actor, action, kind, target, detail)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (stamp, change.actor, change.action, change.kind, change.target, detail),
                )
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

        await self._run(write)

    async def audit(self, limit: int = 1000) -> list[AuditEntry]:
        def read(conn: sqlite3.Connection) -> list[AuditEntry]:
            rows = conn.execute(
                "SELECT seq, at, actor, action, kind, target, detail FROM admin_audit"
                " ORDER BY seq DESC LIMIT ?",
                (limit,),
            ).fetchall()
            return [
                AuditEntry(s, datetime.fromisoformat(a), who, act, k, t, json.loads(d))
                for s, a, who, act, k, t, d in reversed(rows)
            ]

        return await self._run(read)

    async def claim_alert(self, alert: BudgetAlertRow) -> bool:
        def claim(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "INSERT INTO budget_alerts (subject, scope, period, threshold_pct, fired_at,"
                " spent_micros, limit_micros) VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT DO NOTHING",
                (
                    alert.subject,
                    alert.scope,
                    alert.period,
                    alert.threshold_pct,
                    _stamp(alert.fired_at),
                    alert.spent_micros,
                    alert.limit_micros,
                ),
            )
            return cur.rowcount == 1

        return await self._run(claim)

    async def mark_delivered(self, alert: BudgetAlertRow) -> None:
        def mark(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE budget_alerts SET delivered = 1 WHERE subject = ? AND scope = ?"
                " AND period = ? AND threshold_pct = ?",
                (alert.subject, alert.scope, alert.period, alert.threshold_pct),
            )

        await self._run(mark)

    async def close(self) -> None:
        def close(conn: sqlite3.Connection) -> None:
            conn.close()
            self._conn = None

        if self._conn is not None:
            await self._run(close)


class PostgresAdminStore:
    """The admin tables beside the PostgreSQL ledger, shared by every replica: an id is
    refused (``DuplicateGrant``) whichever replica used it first, and an alert is
    claimed by one replica only (``INSERT … ON CONFLICT DO NOTHING`` on its key)."""

    def __init__(self, url: str) -> None:
        # a small pool of its own; the server's synchronous_commit (module docstring)
        self.pool = PostgresPool(url, store="admin", max_size=2)

    async def changes(self) -> GrantChanges:
        rows = await self.pool.fetch(
            "SELECT kind, id, body, revoked_at IS NOT NULL AS revoked FROM admin_grants"
            " ORDER BY created_at, kind, id"
        )
        parsed = [
            (r["kind"], r["id"], json.loads(r["body"]) if r["body"] else None, r["revoked"])
            for r in rows
        ]
        ended = await self.pool.fetch(
            "SELECT max(at) AS at FROM admin_audit WHERE kind = 'session'"
        )
        return _changes(parsed, {(k, i) for k, i, _, r in parsed if r}, ended[0]["at"])

    async def record(self, change: AdminChange, at: datetime) -> None:
        body = json.dumps(_entry(change.entry), sort_keys=True)
        detail = json.dumps(_detail(change), sort_keys=True)
        pool = await self.pool.get()
        with mapped("admin"):
            async with pool.acquire() as conn, conn.transaction():
                await _write_pg_grant(conn, change, body, at)
                await conn.execute(
                    "INSERT INTO admin_audit (at, actor, action, kind, target, detail)"
                    " VALUES ($1, $2, $3, $4, $5, $6)",
                    at,
                    change.actor,
                    change.action,
                    change.kind,
                    change.target,
                    detail,
                )

    async def audit(self, limit: int = 1000) -> list[AuditEntry]:
        rows = await self.pool.fetch(
            "SELECT seq, at, actor, action, kind, target, detail FROM admin_audit"
            " ORDER BY seq DESC LIMIT $1",
            limit,
        )
        return [
            AuditEntry(
                r["seq"],
                r["at"],
                r["actor"],
                r["action"],
                r["kind"],
                r["target"],
                json.loads(r["detail"]),
            )
            for r in reversed(rows)
        ]

    async def claim_alert(self, alert: BudgetAlertRow) -> bool:
        status = await self.pool.execute(
            "INSERT INTO budget_alerts (subject, scope, period, threshold_pct, fired_at,"
            " spent_micros, limit_micros) VALUES ($1, $2, $3, $4, $5, $6, $7)"
            " ON CONFLICT DO NOTHING",
            alert.subject,
            alert.scope,
            alert.period,
            alert.threshold_pct,
            alert.fired_at,
            alert.spent_micros,
            alert.limit_micros,
        )
        return status == "INSERT 0 1"

    async def mark_delivered(self, alert: BudgetAlertRow) -> None:
        await self.pool.execute(
            "UPDATE budget_alerts SET delivered = 1 WHERE subject = $1 AND scope = $2"
            " AND period = $3 AND threshold_pct = $4",
            alert.subject,
            alert.scope,
            alert.period,
            alert.threshold_pct,
        )

    async def close(self) -> None:
        await self.pool.close()


async def _write_pg_grant(
    conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy[Any],
    change: AdminChange,
    detail: str,
    at: datetime,
) -> None:
    """``_write_grant`` on PostgreSQL. A create that meets the id (committed by any
    replica, or being written by one: the insert waits for it) writes nothing."""
    if change.kind == "session":
        return  # a sign-out is its audit row alone
    if change.action == "create":
        created = await conn.fetchval(
            "INSERT INTO admin_grants (kind, id, body, created_at) VALUES ($1, $2, $3, $4)"
            " ON CONFLICT (kind, id) DO NOTHING RETURNING true",
            change.kind,
            change.target,
            detail,
            at,
        )
        if not created:
            raise DuplicateGrant(change.target)  # the transaction rolls back: no audit row
        return
    status = await conn.execute(
        "UPDATE admin_grants SET revoked_at = $1 WHERE kind = $2 AND id = $3"
        " AND revoked_at IS NULL",
        at,
        change.kind,
        change.target,
    )
    if status == "UPDATE 0":  # a tombstone, or revoked already: the first instant stays
        await conn.execute(
            "INSERT INTO admin_grants (kind, id, body, created_at, revoked_at)"
            " VALUES ($1, $2, NULL, $3, $3) ON CONFLICT (kind, id) DO NOTHING",
            change.kind,
            change.target,
            at,
        )


def _write_grant(conn: sqlite3.Connection, change: AdminChange, detail: str, stamp: str) -> None:
    if change.kind == "session":
        return  # a sign-out is its audit row alone
    if change.action == "create":
        try:
            conn.execute(
                "INSERT INTO admin_grants (kind, id, body, created_at) VALUES (?, ?, ?, ?)",
                (change.kind, change.target, detail, stamp),
            )
        except sqlite3.IntegrityError as exc:
            raise DuplicateGrant(change.target) from exc
        return
    cur = conn.execute(
        "UPDATE admin_grants SET revoked_at = ? WHERE kind = ? AND id = ? AND revoked_at IS NULL",
        (stamp, change.kind, change.target),
    )
    if cur.rowcount == 0:  # an entry the config defines (a tombstone), or one revoked
        # already, by a replica whose revoke this one had not yet read: the first instant
        # is the revocation's, so a second revoke never moves it
        conn.execute(
            "INSERT INTO admin_grants (kind, id, body, created_at, revoked_at)"
            " VALUES (?, ?, NULL, ?, ?) ON CONFLICT (kind, id) DO NOTHING",
            (change.kind, change.target, stamp, stamp),
        )


def _changes(
    rows: list[tuple[str, str, dict[str, Any] | None, bool]],
    revoked: set[tuple[str, str]],
    sessions_ended_at: datetime | None = None,
) -> GrantChanges:
    live = [(k, b) for k, _, b, r in rows if b and not r]
    return GrantChanges(
        sessions_ended_at=sessions_ended_at,
        exceptions=tuple(ExceptionGrant.model_validate(b) for k, b in live if k == "exception"),
        keys=tuple(KeyEntry.model_validate(b) for k, b in live if k == "key"),
        revoked_exceptions=frozenset(i for k, i in revoked if k == "exception"),
        revoked_keys=frozenset(i for k, i in revoked if k == "key"),
    )


def _stamp(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def admin_store_for_ledger(url: str, sqlite_path: Path | None) -> AdminStore:
    """The admin store beside the ledger: its SQLite file, its PostgreSQL database (and
    schema), or memory for ``memory://``."""
    if sqlite_path is not None:
        return SQLiteAdminStore(sqlite_path)
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresAdminStore(url)
    if not url.startswith("memory://"):
        log.warning("admin changes are kept in memory only: no admin tables for this ledger")
    return MemoryAdminStore()
