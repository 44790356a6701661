"""The admin tables in the ledger's SQLite file (revision 6 of ``sqlite/migrations/``): plain
``sqlite3`` calls in a worker thread behind one lock (admin changes are rare)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from ncap.domain.grants import GrantChanges
from ncap.errors import ConfigError, StoreUnavailable
from ncap.stores._admin import audit_detail, entry_json, grant_changes, text_stamp
from ncap.stores._migrations import migrations
from ncap.stores.ports import (
    AdminChange,
    AuditEntry,
    BudgetAlertRow,
    DuplicateGrant,
)

T = TypeVar("T")
# the admin tables (revision 6), also run on a file the admin store opens before the
# ledger does: every statement is IF NOT EXISTS
SQLITE_DDL = dict(migrations("sqlite"))[6]


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
            return grant_changes(parsed, {(k, i) for k, i, _, r in parsed if r}, ended_at)

        return await self._run(read)

    async def record(self, change: AdminChange, at: datetime) -> None:
        stamp = text_stamp(at)
        body = json.dumps(entry_json(change.entry), sort_keys=True)
        detail = json.dumps(audit_detail(change), sort_keys=True)

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
                    text_stamp(alert.fired_at),
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
