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

from datetime import UTC, datetime
from typing import Any

from ncap.stores import LedgerSource, PostgresSource, SQLiteSource
from ncap.stores import open_report_source as source_from_url

__all__ = [
    "LedgerSource",
    "PostgresSource",
    "SQLiteSource",
    "parse_stamp",
    "source_from_url",
]


def parse_stamp(value: Any) -> datetime | None:
    """A timestamp as the driver returned it (text from SQLite, datetime from psycopg)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    parsed = datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
