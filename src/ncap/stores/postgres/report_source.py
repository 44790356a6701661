"""The reports' read-only access to a PostgreSQL ledger, through asyncpg (the driver
the PostgreSQL store uses) on a private event loop, so that the report code stays
synchronous. Placeholders arrive written ``?`` and are numbered here.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ncap.errors import ConfigError
from ncap.stores._common import text_bucket
from ncap.stores.ports import Row

__all__ = ["PostgresSource"]


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

    def per_choice_scan(self, start: Any, end: Any) -> str:
        return "ledger_events"

    def bucket(self, hourly: bool) -> str:
        if self._text_stamps:
            return text_bucket(hourly)
        fmt = 'YYYY-MM-DD"T"HH24' if hourly else "YYYY-MM-DD"
        return f"to_char(timestamp AT TIME ZONE 'UTC', '{fmt}')"

    def close(self) -> None:
        self._loop.run_until_complete(self._conn.close())
        self._loop.close()


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
