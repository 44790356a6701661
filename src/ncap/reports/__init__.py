"""FinOps reports over the ledger: ``ncap audit``, ``ncap report daily``, ``/dashboard``.

``build_report`` runs a few portable aggregate queries (SQLite and PostgreSQL) through
a read-only ``LedgerSource`` and returns a ``Report``; the renderers turn that one
value into rich tables, JSON or a self-contained HTML page.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

from ncap.reports.build import STEPS, build_report, nearest_rank, population_stability_index
from ncap.reports.model import (
    Alert,
    ChoiceCost,
    DenialRow,
    DistributionRow,
    ExceptionUsage,
    MismatchRow,
    OutputStats,
    PendingRow,
    Report,
    RouteMismatch,
    ShiftResult,
    SpendRow,
    Totals,
    Window,
    report_dict,
)
from ncap.reports.render import render_html, render_json, render_tables, render_tsv
from ncap.reports.source import (
    LedgerSource,
    PostgresSource,
    SQLiteSource,
    source_from_url,
)
from ncap.stores import ensure_report_indexes

__all__ = [
    "STEPS",
    "Alert",
    "ChoiceCost",
    "DenialRow",
    "DistributionRow",
    "ExceptionUsage",
    "LedgerSource",
    "MismatchRow",
    "OutputStats",
    "PendingRow",
    "PostgresSource",
    "Report",
    "RouteMismatch",
    "SQLiteSource",
    "ShiftResult",
    "SpendRow",
    "Totals",
    "Window",
    "build_report",
    "day_window",
    "ensure_report_indexes",
    "nearest_rank",
    "population_stability_index",
    "render_html",
    "render_json",
    "render_tables",
    "render_tsv",
    "report_dict",
    "since_window",
    "source_from_url",
]


def since_window(length: timedelta, now: datetime) -> Window:
    """``[now - length, now)``: the audit's window."""
    return Window(now - length, now)


def day_window(day: date) -> Window:
    """The UTC calendar day ``day``: the daily report's window."""
    start = datetime.combine(day, time(0), tzinfo=UTC)
    return Window(start, start + timedelta(days=1))
