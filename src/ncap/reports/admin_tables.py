"""What the report reads from the admin tables beside the ledger (``stores/admin_schema``):
budget alerts fired in the window (shown in the report's alerts, ``source="budget"``)
and the exceptions the admin API created (their usage belongs in the exceptions
section as much as the config's). Portable SQL; a ledger without the tables (one the
gateway never opened, or a PostgreSQL ledger before its migration) has neither.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

from ncap.config import ExceptionGrant
from ncap.domain.money import format_usd
from ncap.errors import ConfigError
from ncap.reports.model import Alert, Window
from ncap.reports.source import LedgerSource, parse_stamp

__all__ = ["admin_exceptions", "budget_alerts", "revoked_exceptions", "with_admin_exceptions"]

_WINDOW_NAMES = {"day": "day budget", "month": "month budget", "exception": "lifetime budget"}


def budget_alerts(source: LedgerSource, window: Window) -> list[Alert]:
    sql = (
        "SELECT subject, scope, period, threshold_pct, fired_at, spent_micros, limit_micros,"
        " delivered FROM budget_alerts WHERE fired_at >= ? AND fired_at < ?"
        " AND scope <> 'candidates'"
        " ORDER BY fired_at, scope, threshold_pct"
    )
    try:
        rows = source.query(sql, (source.stamp(window.start), source.stamp(window.end)))
    except ConfigError:
        return []  # no such table: nothing was ever fired against this ledger
    return [_alert(*row) for row in rows]


def _alert(
    subject: str,
    scope: str,
    period: str,
    pct: int,
    fired_at: object,
    spent: int,
    limit: int,
    delivered: int,
) -> Alert:
    who = "exception" if scope == "exception" else "workload"
    at = parse_stamp(fired_at)
    when = at.strftime("%Y-%m-%d %H:%M UTC") if at else "?"
    note = "" if delivered else " (webhook not delivered)"
    return Alert(
        source="budget",
        severity="critical" if pct >= 100 else "warning",
        code=f"budget_{scope}_{pct}",
        message=(
            f"{who} {subject} reached {pct}% of its {_WINDOW_NAMES.get(scope, scope)}"
            f" ({period}): {format_usd(spent)} of {format_usd(limit)}, at {when}{note}"
        ),
        value=round(spent / limit, 4) if limit else None,
        threshold=pct / 100,
    )


def admin_exceptions(source: LedgerSource) -> list[ExceptionGrant]:
    """Exceptions the admin API created, revoked ones included (their spend counts)."""
    sql = "SELECT body FROM admin_grants WHERE kind = 'exception' AND body IS NOT NULL"
    try:
        rows = source.query(sql)
    except ConfigError:
        return []
    return [ExceptionGrant.model_validate(json.loads(body)) for (body,) in rows]


def revoked_exceptions(source: LedgerSource) -> dict[str, datetime]:
    """When each revoked exception was revoked (the admin API's own entries and the
    config's alike: a revocation of a config entry is a row without a body)."""
    sql = (
        "SELECT id, revoked_at FROM admin_grants"
        " WHERE kind = 'exception' AND revoked_at IS NOT NULL"
    )
    try:
        rows = source.query(sql)
    except ConfigError:
        return {}
    out = {}
    for ident, at in rows:
        stamp = parse_stamp(at)
        if stamp is not None:
            out[str(ident)] = stamp
    return out


def with_admin_exceptions(
    source: LedgerSource, configured: Sequence[ExceptionGrant]
) -> list[ExceptionGrant]:
    known = {e.id for e in configured}
    return [*configured, *(e for e in admin_exceptions(source) if e.id not in known)]
