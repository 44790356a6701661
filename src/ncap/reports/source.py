"""Where the report's SQL runs: a read-only connection to the configured ledger.

The report never goes through ``LedgerStore`` (which pages events one by one): it
sends a handful of aggregate queries written in the SQL that SQLite and PostgreSQL
share (``COUNT``/``SUM``/``MIN``/``MAX``, ``CASE``, ``GROUP BY``, sub-selects; no
``FILTER``, no ``percentile_cont``, no date functions). Placeholders are written
``?`` and a source rewrites them for its driver; timestamps are passed through
``stamp()`` because SQLite stores them as fixed-width UTC text while a PostgreSQL
ledger may use ``timestamptz``.
"""

from __future__ import annotations

import asyncio
import importlib
import sqlite3
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from ncap.errors import ConfigError
from ncap.reports.indexes import EXCEPTION_INDEX
from ncap.stores import sqlite_target

__all__ = [
    "LedgerSource",
    "PostgresSource",
    "SQLiteSource",
    "parse_stamp",
    "source_from_url",
]

Row = tuple[Any, ...]
# above this share of the ledger, a window is read by scanning the table (SQLite)
WIDE_WINDOW = 0.15


class LedgerSource(Protocol):
    """Runs read-only aggregate SQL against one ledger."""

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

    def stamp(self, value: datetime) -> Any: ...

    def scan(self, start: Any, end: Any) -> str:
        """The ``FROM`` target for reading the rows of ``[start, end)`` (stamped)."""
        ...

    def exception_scan(self) -> str:
        """The ``FROM`` target for queries over the rows that name an exception."""
        ...

    def bucket(self, hourly: bool) -> str:
        """An SQL expression: the row's UTC hour (``2026-12-01T14``) or day
        (``2026-12-01``) as text, the one date function the time views need."""
        ...

    def close(self) -> None: ...


class SQLiteSource:
    """A read-only (``mode=ro``) connection to the SQLite ledger file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ConfigError(f"ledger {self.path} does not exist")
        try:
            self._conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
            self._conn.execute("PRAGMA query_only = 1")
            self._conn.execute("SELECT 1 FROM ledger_events LIMIT 1").fetchall()
        except sqlite3.Error as exc:
            raise ConfigError(f"ledger {self.path} cannot be read: {exc}") from exc

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        try:
            return list(self._conn.execute(sql, tuple(params)))
        except sqlite3.Error as exc:
            raise ConfigError(f"ledger {self.path} cannot be read: {exc}") from exc

    def stamp(self, value: datetime) -> Any:
        # the same fixed-width text as stores/sqlite_ledger.py writes
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def scan(self, start: Any, end: Any) -> str:
        """SQLite has no histogram for ranges: it walks the timestamp index and looks
        every row up, about 4x slower than reading the table when the window holds much
        of the ledger. Count the window on the index (cheap) and pick."""
        total = self._conn.execute("SELECT COUNT(*) FROM ledger_events").fetchone()[0]
        inside = self._conn.execute(
            "SELECT COUNT(*) FROM ledger_events WHERE timestamp >= ? AND timestamp < ?",
            (start, end),
        ).fetchone()[0]
        wide = total and inside / total > WIDE_WINDOW
        return "ledger_events NOT INDEXED" if wide else "ledger_events"

    def exception_scan(self) -> str:
        """The report's partial index when the ledger has it (``reports/indexes.py``),
        else a plain scan (the timestamp index would be slower than the table)."""
        found = self._conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = ?", (EXCEPTION_INDEX,)
        ).fetchone()
        if found:
            return f"ledger_events INDEXED BY {EXCEPTION_INDEX}"
        return "ledger_events NOT INDEXED"

    def bucket(self, hourly: bool) -> str:
        return _text_bucket(hourly)  # stamps are fixed-width UTC text

    def close(self) -> None:
        self._conn.close()


class PostgresSource:
    """The PostgreSQL ledger through asyncpg (the driver the PostgreSQL store uses),
    on a private event loop so that the report code stays synchronous."""

    def __init__(self, url: str) -> None:
        try:
            self._asyncpg: Any = importlib.import_module("asyncpg")
        except ImportError as exc:
            raise ConfigError("reports on a PostgreSQL ledger need the asyncpg package") from exc
        self._loop = asyncio.new_event_loop()
        dsn, schema = _pg_dsn(url)
        settings = {"search_path": schema} if schema else None
        self._conn: Any = self._run(self._asyncpg.connect(dsn, server_settings=settings))
        self._text_stamps = self._stamps_are_text()

    def _run(self, coro: Any) -> Any:
        """Driver and network errors become one ``ConfigError`` saying the ledger is
        unreadable (the report is read-only: nothing to retry or roll back)."""
        try:
            return self._loop.run_until_complete(coro)
        except (self._asyncpg.PostgresError, OSError) as exc:
            raise ConfigError(f"PostgreSQL ledger cannot be read: {exc}") from exc

    def _stamps_are_text(self) -> bool:
        rows = self.query(
            "SELECT data_type FROM information_schema.columns"
            " WHERE table_name = 'ledger_events' AND column_name = 'timestamp'"
        )
        return bool(rows) and str(rows[0][0]) in ("text", "character varying")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        numbered = _numbered(sql)
        records = self._run(self._conn.fetch(numbered, *params))
        return [tuple(record) for record in records]

    def stamp(self, value: datetime) -> Any:
        if self._text_stamps:
            return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return value.astimezone(UTC)

    def scan(self, start: Any, end: Any) -> str:
        return "ledger_events"  # PostgreSQL's planner has range statistics

    def exception_scan(self) -> str:
        return "ledger_events"

    def bucket(self, hourly: bool) -> str:
        if self._text_stamps:
            return _text_bucket(hourly)
        fmt = 'YYYY-MM-DD"T"HH24' if hourly else "YYYY-MM-DD"
        return f"to_char(timestamp AT TIME ZONE 'UTC', '{fmt}')"

    def close(self) -> None:
        self._loop.run_until_complete(self._conn.close())
        self._loop.close()


def _text_bucket(hourly: bool) -> str:
    return f"substr(timestamp, 1, {13 if hourly else 10})"


def _numbered(sql: str) -> str:
    """``?`` placeholders as PostgreSQL's ``$1, $2, …`` (the report's SQL has no other ``?``)."""
    parts = sql.split("?")
    return "".join(f"{part}${i}" for i, part in enumerate(parts[:-1], 1)) + parts[-1]


def _pg_dsn(url: str) -> tuple[str, str | None]:
    """The DSN without ncap's own ``?schema=`` parameter, and that schema."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    schema = query.pop("schema", [None])[-1]
    rest = "&".join(f"{k}={v}" for k, values in query.items() for v in values)
    return parts._replace(query=rest).geturl(), schema


def source_from_url(url: str) -> LedgerSource:
    """The read-only source for the ledger URL of ``stores.ledger``."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "sqlite":
        path, _ = sqlite_target(url)
        return SQLiteSource(path)
    if scheme in ("postgresql", "postgres"):
        return PostgresSource(url)
    if scheme == "memory":
        raise ConfigError("a memory:// ledger is gone when its gateway stops; nothing to report")
    raise ConfigError(f"stores.ledger: unsupported store URL {url!r}")


def parse_stamp(value: Any) -> datetime | None:
    """A timestamp as the driver returned it (text from SQLite, datetime from psycopg)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    parsed = datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
