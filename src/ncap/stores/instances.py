"""Which gateways are alive: each instance heart-beats into the shared store.

A gateway registers before it writes anything and beats every ``interval``; an entry
whose last beat is older than its own ``timeout`` belongs to a gateway that stopped
(killed, partitioned, hung). Beats are stamped with the store's clock (PostgreSQL
``now()``; one host's clock for a SQLite file), never compared across gateway clocks.

The registry lives beside the ledger (a table in the same SQLite file or PostgreSQL
schema; in-process for ``memory://``): the ledger is the one store every gateway of a
deployment shares, and its rows name their ``gateway_instance``.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from ncap.errors import StoreUnavailable
from ncap.stores._postgres import PostgresPool

__all__ = [
    "Identity",
    "InstanceInfo",
    "InstanceRegistry",
    "MemoryInstanceRegistry",
    "PostgresInstanceRegistry",
    "SQLiteInstanceRegistry",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Identity:
    """This process: its instance id and where it runs (to tell a dead neighbour)."""

    instance: str
    host: str
    pid: int
    pid_namespace: int

    @classmethod
    def current(cls, instance: str) -> Identity:
        return cls(instance, os.uname().nodename, os.getpid(), _pid_namespace())


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    identity: Identity
    beat_age_s: float  # seconds since its last beat, by the store's clock
    timeout_s: float

    @property
    def expired(self) -> bool:
        return self.beat_age_s > self.timeout_s

    def dead_neighbour_of(self, me: Identity) -> bool:
        """Same host and PID namespace, and its process is gone: dead without waiting
        for the timeout (a restart after ``kill -9`` recovers at once)."""
        return self._beside(me) and not _process_alive(self.identity.pid)

    def live_twin_of(self, me: Identity) -> bool:
        """Another running process on this host uses ``me``'s instance id."""
        return self._beside(me) and not self.expired and _process_alive(self.identity.pid)

    def _beside(self, me: Identity) -> bool:
        them = self.identity
        same_place = (them.host, them.pid_namespace) == (me.host, me.pid_namespace)
        return same_place and them.pid != me.pid


class InstanceRegistry(Protocol):
    async def beat(self, me: Identity, timeout_s: float) -> None:
        """Register or refresh ``me``; raises ``StoreUnavailable`` when the store is down."""
        ...

    async def instances(self) -> list[InstanceInfo]: ...

    async def forget(self, instance: str) -> None: ...


class MemoryInstanceRegistry:
    """In-process: nobody else can share a ``memory://`` ledger."""

    def __init__(self) -> None:
        self._beats: dict[str, tuple[Identity, float, float]] = {}

    async def beat(self, me: Identity, timeout_s: float) -> None:
        self._beats[me.instance] = (me, time.monotonic(), timeout_s)

    async def instances(self) -> list[InstanceInfo]:
        now = time.monotonic()
        return [InstanceInfo(i, now - at, t) for i, at, t in self._beats.values()]

    async def forget(self, instance: str) -> None:
        self._beats.pop(instance, None)


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


class PostgresInstanceRegistry:
    """The ``gateway_instances`` table beside the PostgreSQL ledger; server time."""

    def __init__(self, pool: PostgresPool) -> None:
        self._pool = pool

    async def beat(self, me: Identity, timeout_s: float) -> None:
        await self._pool.execute(
            "INSERT INTO gateway_instances (instance, host, pid, pid_namespace, timeout_s)"
            " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (instance) DO UPDATE"
            " SET host = $2, pid = $3, pid_namespace = $4, beat_at = now(), timeout_s = $5",
            me.instance,
            me.host,
            me.pid,
            me.pid_namespace,
            timeout_s,
        )

    async def instances(self) -> list[InstanceInfo]:
        rows = await self._pool.fetch(
            "SELECT instance, host, pid, pid_namespace, timeout_s,"
            " EXTRACT(EPOCH FROM now() - beat_at)::float8 AS age FROM gateway_instances"
        )
        return [
            InstanceInfo(
                Identity(r["instance"], r["host"], r["pid"], r["pid_namespace"]),
                r["age"],
                r["timeout_s"],
            )
            for r in rows
        ]

    async def forget(self, instance: str) -> None:
        await self._pool.execute("DELETE FROM gateway_instances WHERE instance = $1", instance)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _process_alive(pid: int) -> bool:
    """A zombie (killed, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"
