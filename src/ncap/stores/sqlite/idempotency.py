"""``Idempotency-Key`` records in the SQLite budget file (the processes of one host:
one table, inside the writer's transaction)."""

from __future__ import annotations

import sqlite3
import time

from ncap.stores.sqlite.budgets import SQLiteBudgetStore


class SQLiteIdempotency:
    """Records in the SQLite budget file (``idempotency_keys``, budgets migration 2),
    read and written inside the writer's transaction, so claims are atomic across the
    host's processes. Expired rows are deleted as new ones are claimed."""

    def __init__(self, budgets: SQLiteBudgetStore) -> None:
        self._budgets = budgets

    async def claim(self, key: str, record: bytes, ttl_s: float) -> bytes | None:
        def run(conn: sqlite3.Connection) -> bytes | None:
            now = time.time()
            conn.execute("DELETE FROM idempotency_keys WHERE expires_at <= ?", (now,))
            current = _sqlite_get(conn, key, now)
            if current is None:
                conn.execute(
                    "INSERT OR REPLACE INTO idempotency_keys VALUES (?, ?, ?)",
                    (key, record, now + ttl_s),
                )
            return current

        return await self._budgets.run_in_transaction(run)

    async def get(self, key: str) -> bytes | None:
        return await self._budgets.run_in_transaction(
            lambda conn: _sqlite_get(conn, key, time.time())
        )

    async def swap(self, key: str, expected: bytes, record: bytes | None, ttl_s: float) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            now = time.time()
            if _sqlite_get(conn, key, now) != expected:
                return False
            if record is None:
                conn.execute("DELETE FROM idempotency_keys WHERE key = ?", (key,))
            else:
                conn.execute(
                    "UPDATE idempotency_keys SET record = ?, expires_at = ? WHERE key = ?",
                    (record, now + ttl_s, key),
                )
            return True

        return await self._budgets.run_in_transaction(run)


def _sqlite_get(conn: sqlite3.Connection, key: str, now: float) -> bytes | None:
    row = conn.execute(
        "SELECT record FROM idempotency_keys WHERE key = ? AND expires_at > ?", (key, now)
    ).fetchone()
    return bytes(row[0]) if row is not None else None
