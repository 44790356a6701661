"""PostgreSQL plumbing: the URL, a lazily opened pool, migrations, error mapping.

``postgresql://user@host:5432/db?schema=name`` — ``schema`` (not a libpq parameter)
puts every table in that schema (created if missing); tests use one schema each.
The pool opens on first use and migrates under an advisory lock, so N gateways
starting together apply each revision once. A pool that cannot connect raises
``StoreUnavailable`` and is retried on the next call: service resumes by itself.

Every call is bounded (``timeout_s``, the configuration's ``stores.timeout_s``, 2 s by
default): connecting, checking a connection out of the pool and each statement, so a
partitioned server (packets dropped, nothing reset) becomes ``StoreUnavailable`` — a
503 at the edge — within that time rather than after the kernel gives up.

``synchronous_commit`` (the ledger's ``stores.ledger_durability``: ``normal`` is ``off``,
``full`` leaves the server's own setting) is a start-up parameter of every pooled
connection, so it is the session's default and no statement can lose it. A
``?synchronous_commit=`` in the URL wins over it. Connections go back to the pool
without asyncpg's reset query (``RESET ALL``, ``UNLISTEN *``, …: one more round trip
per use): nothing here changes session state (no ``SET``, ``LISTEN``, session advisory
lock or cursor), and an open transaction is still rolled back by asyncpg itself.

The ledger's group-commit writer has a small pool of its own (``writer()``), whose
connections run every prepared statement on its generic plan: the writer only inserts
rows and updates them by primary key, and re-planning its batch statements on every
execution (what ``plan_cache_mode = auto`` does for statements over ``unnest`` arrays,
whose custom plans always look cheaper) was about 40 % of the server's CPU per write.
Sequential scans, hash and merge joins are off on those connections so that a generic
plan made on an empty table is still the primary-key lookup it is on a full one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg

from ncap.errors import StoreUnavailable
from ncap.stores._migrations import Migration, migrations
from ncap.stores.ports import STORE_TIMEOUT_S

__all__ = ["STORE_TIMEOUT_S", "PostgresPool", "mapped", "migrate", "postgres_target"]


_SCHEMA = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
# the writer's connections (module docstring): generic plans, primary-key lookups only
WRITER_SETTINGS = {
    "plan_cache_mode": "force_generic_plan",
    "enable_seqscan": "off",
    "enable_hashjoin": "off",
    "enable_mergejoin": "off",
}


def postgres_target(url: str) -> tuple[str, str | None]:
    """The libpq URL without ``schema``, and the schema (None: the server's default)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query)
    schema = next((v for k, v in query if k == "schema"), None)
    if schema is not None and not _SCHEMA.match(schema):
        raise ValueError(f"schema {schema!r}: use lower-case letters, digits and _")
    rest = urlencode([(k, v) for k, v in query if k != "schema"])
    scheme = "postgresql" if parts.scheme in ("postgresql", "postgres") else parts.scheme
    return urlunsplit(parts._replace(scheme=scheme, query=rest)), schema


@contextlib.contextmanager
def mapped(store: str = "ledger") -> Iterator[None]:
    """Every asyncpg / socket failure becomes the one store error (a 503 at the edge)."""
    try:
        yield
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
        raise StoreUnavailable(store, "PostgreSQL", type(exc).__name__) from exc


async def migrate(conn: asyncpg.Connection, schema: str | None, target: int | None = None) -> int:
    """Apply the revisions newer than ``schema_version`` (up to ``target``); returns
    the revision the database is at. Serialized by a transaction-scoped advisory lock."""
    steps: Sequence[Migration] = migrations("postgresql")
    async with conn.transaction():
        await conn.execute(
            "SELECT pg_advisory_xact_lock(hashtext('ncap-migrate:' || $1))", schema or "public"
        )
        if schema is not None:
            await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_version ("
            " version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        current = int(await conn.fetchval("SELECT COALESCE(MAX(version), 0) FROM schema_version"))
        for version, script in steps:
            if version > current and (target is None or version <= target):
                await conn.execute(script)
                await conn.execute("INSERT INTO schema_version (version) VALUES ($1)", version)
                current = version
    return current


class PostgresPool:
    """One asyncpg pool per store, opened (and the schema migrated) on first use."""

    def __init__(
        self,
        url: str,
        *,
        store: str = "ledger",
        max_size: int = 8,
        timeout_s: float = STORE_TIMEOUT_S,
        synchronous_commit: str | None = None,
    ) -> None:
        self.dsn, self.schema = postgres_target(url)
        quiet_pool_floor_logs()
        if "synchronous_commit" in parse_qs(urlsplit(self.dsn).query):
            synchronous_commit = None  # the URL's own (asyncpg passes it as a setting)
        self.synchronous_commit = synchronous_commit
        self._store = store
        self._max_size = max_size
        self.timeout_s = timeout_s
        self._pool: asyncpg.Pool | None = None
        self._writer: asyncpg.Pool | None = None
        self._lock = asyncio.Lock()
        self.version = 0

    async def get(self) -> asyncpg.Pool:
        if self._pool is not None:
            return self._pool
        async with self._lock:
            if self._pool is None:
                with mapped(self._store):
                    # the migration may wait for a peer's (advisory lock): longer bound
                    async with asyncio.timeout(max(self.timeout_s * 5, 10.0)):
                        self._pool = await self._open()
        return self._pool

    async def writer(self) -> asyncpg.Pool:
        """The group-commit writer's own pool (module docstring), opened after ``get``
        (so after the migration)."""
        if self._writer is not None:
            return self._writer
        await self.get()
        async with self._lock:
            if self._writer is None:
                with mapped(self._store):
                    async with asyncio.timeout(self.timeout_s):
                        self._writer = await self._create(2, WRITER_SETTINGS)
        return self._writer

    async def _open(self) -> asyncpg.Pool:
        settings = {"search_path": self.schema} if self.schema else {}
        conn = await asyncpg.connect(self.dsn, timeout=self.timeout_s, server_settings=settings)
        try:
            self.version = await migrate(conn, self.schema)  # at the server's durability
        finally:
            await conn.close()
        return await self._create(self._max_size, {})

    async def _create(self, max_size: int, extra: dict[str, str]) -> asyncpg.Pool:
        settings = {"search_path": self.schema} if self.schema else {}
        if self.synchronous_commit is not None:
            settings["synchronous_commit"] = self.synchronous_commit
        pool = await asyncpg.create_pool(
            self.dsn,
            min_size=1,
            max_size=max_size,
            timeout=self.timeout_s,
            command_timeout=self.timeout_s,
            server_settings={**settings, **extra},
            reset=_keep_session,
        )
        assert pool is not None
        return pool

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        pool = await self.get()
        with mapped(self._store):
            async with asyncio.timeout(self.timeout_s), pool.acquire() as conn:
                return list(await conn.fetch(sql, *args))

    async def execute(self, sql: str, *args: Any) -> str:
        pool = await self.get()
        with mapped(self._store):
            async with asyncio.timeout(self.timeout_s), pool.acquire() as conn:
                return str(await conn.execute(sql, *args))

    async def close(self) -> None:
        for pool in (self._writer, self._pool):
            if pool is not None:
                with contextlib.suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                    await asyncio.wait_for(pool.close(), 5)
        self._writer = self._pool = None


class _PoolFloorFilter(logging.Filter):
    """asyncpg logs "Failed to restore the pool connection floor" with a full traceback
    each time it fails to reconnect its idle floor (several times a second across
    gateways while PostgreSQL is away): enough to drown real alerts, and the outage is
    already reported (503s, /readyz, the heartbeat warning). This keeps one line
    without the traceback per ``every_s``, saying how many were folded into it."""

    def __init__(self, every_s: float = 30.0) -> None:
        super().__init__()
        self._every_s = every_s
        self._last = -every_s
        self._folded = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "connection floor" not in str(record.msg):
            return True
        now = time.monotonic()
        if now - self._last < self._every_s:
            self._folded += 1
            return False
        cause = record.exc_info[1] if record.exc_info else None
        reason = type(cause).__name__ if cause is not None else "unknown"
        record.msg = "PostgreSQL unreachable: cannot restore the pool's idle connections (%s)"
        record.args = (reason,)
        if self._folded:
            record.msg += "; %d such failures since the last line"
            record.args = (reason, self._folded)
        record.exc_info = None
        record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        self._last, self._folded = now, 0
        return True


def quiet_pool_floor_logs() -> None:
    """Install ``_PoolFloorFilter`` on asyncpg's pool logger (once per process)."""
    logger = logging.getLogger("asyncpg.pool")
    if not any(isinstance(f, _PoolFloorFilter) for f in logger.filters):
        logger.addFilter(_PoolFloorFilter())


async def _keep_session(conn: asyncpg.Connection) -> None:
    """A released connection keeps its session as is (module docstring)."""
