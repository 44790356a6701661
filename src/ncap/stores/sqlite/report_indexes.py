"""The one index the report adds to a SQLite ledger, kept apart from the store's schema.

Exception usage is summed over each exception's whole life, so without help it reads
the entire ledger on every report. A *partial* covering index over the rows that name
an exception (``WHERE exception_id IS NOT NULL``) answers it, and the after-expiry
check, from the index alone, in exception order (no sort); rows without an exception,
the bulk of the traffic, pay nothing for it on insert. The gateway creates it at
start-up and ``ncap ledger generate`` after writing; ``ncap audit`` never writes and
scans instead when it is missing. The statement is also valid PostgreSQL.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

__all__ = ["EXCEPTION_INDEX", "PER_CHOICE_INDEX", "ensure_report_indexes"]

EXCEPTION_INDEX = "ledger_events_report_exceptions"
_CREATE = (
    f"CREATE INDEX IF NOT EXISTS {EXCEPTION_INDEX} ON ledger_events"
    " (exception_id, timestamp, attempt, state, cost_micros, reserved_cost_micros)"
    " WHERE exception_id IS NOT NULL"
)
# the cost-per-choice section reads only rows with per-choice counts (few): the same
# trick, so that section costs nothing on a large ledger of remote traffic
PER_CHOICE_INDEX = "ledger_events_report_per_choice"
_CREATE_PER_CHOICE = (
    f"CREATE INDEX IF NOT EXISTS {PER_CHOICE_INDEX} ON ledger_events"
    " (timestamp, route_id, state, cost_micros, output_tokens_per_choice)"
    " WHERE output_tokens_per_choice IS NOT NULL"
)


def ensure_report_indexes(path: str | Path) -> None:
    """Create the report's index on the SQLite ledger at ``path`` (idempotent)."""
    conn = sqlite3.connect(path, timeout=30)
    try:
        conn.execute(_CREATE)
        conn.commit()
        if any(
            row[1] == "output_tokens_per_choice"
            for row in conn.execute("PRAGMA table_info(ledger_events)")
        ):  # a ledger the store has migrated (2)
            conn.execute(_CREATE_PER_CHOICE)
            conn.commit()
    finally:
        conn.close()
