"""Client ``Idempotency-Key`` records beside the budgets, one adapter per budget backend.

The records live where the budgets live, so they reach exactly as far as the budgets'
``quota_scope``: Redis (every replica: a claim is one Lua ``GET``/``SET … PX`` with an
expiry, a swap a compare-and-set), the SQLite budget file (the processes of one host,
one table, inside the writer's transaction) and in-process memory (one process,
bounded). ``idempotency_for(budgets)`` picks the adapter. A record is opaque bytes
(``lifecycle.idempotency`` encodes it); keys arrive already scoped and hashed, so no
client text is stored in a key.
"""

from __future__ import annotations

import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable
from importlib.resources import files

from ncap.stores.base import BudgetStore, IdempotencyStore
from ncap.stores.memory_budget import MemoryBudgetStore
from ncap.stores.redis_budget import RedisBudgetStore, mapped_redis
from ncap.stores.sqlite_budget import SQLiteBudgetStore

__all__ = [
    "MemoryIdempotency",
    "RedisIdempotency",
    "SQLiteIdempotency",
    "idempotency_for",
]

DEFAULT_MAX_KEYS = 100_000


def idempotency_for(budgets: BudgetStore) -> IdempotencyStore:
    """The records of ``budgets``' backend, shared as far as its counters are."""
    if isinstance(budgets, RedisBudgetStore):
        return RedisIdempotency(budgets)
    if isinstance(budgets, SQLiteBudgetStore):
        return SQLiteIdempotency(budgets)
    if isinstance(budgets, MemoryBudgetStore):
        return MemoryIdempotency()
    raise TypeError(f"no Idempotency-Key records for {type(budgets).__name__}")


class MemoryIdempotency:
    """One process's records, at most ``max_keys`` (the oldest go first: with one TTL,
    insertion order is expiry order)."""

    def __init__(
        self, *, max_keys: int = DEFAULT_MAX_KEYS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._max_keys = max_keys
        self._clock = clock

    def _live(self, key: str) -> bytes | None:
        found = self._records.get(key)
        if found is None:
            return None
        if found[0] <= self._clock():
            del self._records[key]
            return None
        return found[1]

    def _put(self, key: str, record: bytes, ttl_s: float) -> None:
        self._records.pop(key, None)
        self._records[key] = (self._clock() + ttl_s, record)
        while len(self._records) > self._max_keys:
            self._records.popitem(last=False)

    async def claim(self, key: str, record: bytes, ttl_s: float) -> bytes | None:
        current = self._live(key)
        if current is None:
            self._put(key, record, ttl_s)
        return current

    async def get(self, key: str) -> bytes | None:
        return self._live(key)

    async def swap(self, key: str, expected: bytes, record: bytes | None, ttl_s: float) -> bool:
        if self._live(key) != expected:
            return False
        if record is None:
            del self._records[key]
        else:
            self._put(key, record, ttl_s)
        return True


def _lua(name: str) -> str:
    return files("ncap.stores").joinpath(f"lua/{name}.lua").read_text()


class RedisIdempotency:
    """Records on the budgets' Redis, ``<prefix>:i1:<key>``, expiring by themselves."""

    def __init__(self, budgets: RedisBudgetStore) -> None:
        self._redis = budgets.client
        self._prefix = f"{budgets.prefix}:i1:"
        self._claim = self._redis.register_script(_lua("idempotency_claim_v1"))
        self._swap = self._redis.register_script(_lua("idempotency_swap_v1"))

    async def claim(self, key: str, record: bytes, ttl_s: float) -> bytes | None:
        with mapped_redis():
            found = await self._claim(keys=[self._prefix + key], args=[record, _ms(ttl_s)])
        return bytes(found) if found else None

    async def get(self, key: str) -> bytes | None:
        with mapped_redis():
            found = await self._redis.get(self._prefix + key)
        return found.encode() if isinstance(found, str) else found

    async def swap(self, key: str, expected: bytes, record: bytes | None, ttl_s: float) -> bool:
        args: list[bytes | int] = [expected, record or b"", _ms(ttl_s)]
        with mapped_redis():
            return bool(await self._swap(keys=[self._prefix + key], args=args))


def _ms(ttl_s: float) -> int:
    return max(1, round(ttl_s * 1000))


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
