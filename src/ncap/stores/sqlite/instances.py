"""The instance registry in the ledger's SQLite file (``gateway_instances``, revision 2)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ncap.errors import StoreUnavailable
from ncap.stores.ports import (
    Identity,
    InstanceInfo,
)

T = TypeVar("T")


class SQLiteInstanceRegistry:
    """The ``gateway_instances`` table of the ledger's SQLite file (migration 0002)."""

    def __init__(self, path: Path) -> None:
        self._path = path

    async def beat(self, me: Identity, timeout_s: float) -> None:
        sql = (
            "INSERT INTO gateway_instances (instance, host, pid, pid_namespace, started_at,"
            " beat_at, timeout_s) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (instance) DO UPDATE"
            " SET host = excluded.host, pid = excluded.pid, pid_namespace = excluded.pid_namespace,"
            " beat_at = excluded.beat_at, timeout_s = excluded.timeout_s"
        )
        now = time.time()
        row = (me.instance, me.host, me.pid, me.pid_namespace, now, now, timeout_s)
        await self._run(lambda c: c.execute(sql, row))

    async def instances(self) -> list[InstanceInfo]:
        sql = "SELECT instance, host, pid, pid_namespace, beat_at, timeout_s FROM gateway_instances"
        rows = await self._run(lambda c: c.execute(sql).fetchall())
        now = time.time()
        return [InstanceInfo(Identity(i, h, p, n), now - b, t) for i, h, p, n, b, t in rows]

    async def forget(self, instance: str) -> None:
        sql = "DELETE FROM gateway_instances WHERE instance = ?"
        await self._run(lambda c: c.execute(sql, (instance,)))

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.to_thread(self._call, fn)

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        try:
            conn = sqlite3.connect(self._path, timeout=10, isolation_level=None)
            try:
                return fn(conn)
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise StoreUnavailable("ledger", "SQLite", type(exc).__name__) from exc
