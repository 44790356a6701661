"""PostgreSQL plumbing: the URL, a lazily opened pool, migrations, error mapping.

``postgresql://user@host:5432/db?schema=name`` — ``schema`` (not a libpq parameter)
puts every table in that schema (created if missing); tests use one schema each.
The pool opens on first use and migrates under an advisory lock, so N gateways
starting together apply each revision once. A pool that cannot connect raises
``StoreUnavailable`` and is retried on the next call: service resumes by itself.

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
import re
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg

from ncap.errors import StoreUnavailable
from ncap.stores._migrations import Migration, migrations

__all__ = ["PostgresPool", "mapped", "migrate", "postgres_target"]

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
        connect_timeout_s: float = 2.0,
        command_timeout_s: float = 10.0,
        synchronous_commit: str | None = None,
    ) -> None:
        self.dsn, self.schema = postgres_target(url)
        if "synchronous_commit" in parse_qs(urlsplit(self.dsn).query):
            synchronous_commit = None  # the URL's own (asyncpg passes it as a setting)
        self.synchronous_commit = synchronous_commit
        self._store = store
        self._max_size = max_size
        self._connect_timeout_s = connect_timeout_s
        self._command_timeout_s = command_timeout_s
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
                    self._writer = await self._create(2, WRITER_SETTINGS)
        return self._writer

    async def _open(self) -> asyncpg.Pool:
        settings = {"search_path": self.schema} if self.schema else {}
        conn = await asyncpg.connect(
            self.dsn, timeout=self._connect_timeout_s, server_settings=settings
        )
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
            timeout=self._connect_timeout_s,
            command_timeout=self._command_timeout_s,
            server_settings={**settings, **extra},
            reset=_keep_session,
        )
        assert pool is not None
        return pool

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        pool = await self.get()
        with mapped(self._store):
            return list(await pool.fetch(sql, *args))

    async def execute(self, sql: str, *args: Any) -> str:
        pool = await self.get()
        with mapped(self._store):
            return str(await pool.execute(sql, *args))

    async def close(self) -> None:
        for pool in (self._writer, self._pool):
            if pool is not None:
                with contextlib.suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                    await asyncio.wait_for(pool.close(), 5)
        self._writer = self._pool = None


async def _keep_session(conn: asyncpg.Connection) -> None:
    """A released connection keeps its session as is (module docstring)."""
