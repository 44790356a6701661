"""The reports' read-only access to a SQLite ledger file (``mode=ro``).

The report never goes through ``LedgerStore`` (which pages events one by one): it sends a
handful of aggregate queries in the SQL that SQLite and PostgreSQL share; this source
picks the table scan or index for each and stamps times as the file stores them.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ncap.errors import ConfigError
from ncap.stores._common import text_bucket
from ncap.stores.ports import Row
from ncap.stores.sqlite.report_indexes import EXCEPTION_INDEX, PER_CHOICE_INDEX

__all__ = ["WIDE_WINDOW", "SQLiteSource"]

# above this share of the ledger, a window is read by scanning the table (SQLite)
WIDE_WINDOW = 0.15


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
        # the same fixed-width text as sqlite/ledger.py writes
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
        """The report's partial index when the ledger has it (``report_indexes.py``),
        else a plain scan (the timestamp index would be slower than the table)."""
        if self._has_index(EXCEPTION_INDEX):
            return f"ledger_events INDEXED BY {EXCEPTION_INDEX}"
        return "ledger_events NOT INDEXED"

    def per_choice_scan(self, start: Any, end: Any) -> str:
        """The report's partial index of the rows with per-choice counts when the
        ledger has it, else the window's scan."""
        if self._has_index(PER_CHOICE_INDEX):
            return f"ledger_events INDEXED BY {PER_CHOICE_INDEX}"
        return self.scan(start, end)

    def _has_index(self, name: str) -> bool:
        found = self._conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = ?", (name,)
        ).fetchone()
        return found is not None

    def bucket(self, hourly: bool) -> str:
        return text_bucket(hourly)  # stamps are fixed-width UTC text

    def close(self) -> None:
        self._conn.close()
