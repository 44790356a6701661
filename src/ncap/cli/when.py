"""Points in time as an operator types them on the command line (``--since``/``--until``).

Accepted: ``now``, ``today`` and ``yesterday`` (midnight UTC starting that day), a
duration back from now (``7d``, ``12h``, ``90m``, ``2w``), a date (``2026-12-01``,
midnight UTC) or an ISO 8601 instant (``2026-12-01T08:30:00Z``; no zone means UTC).
Anything else is a ``typer.BadParameter`` naming the option, never a traceback.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

import typer

from ncap.config import parse_duration

__all__ = ["WHEN_HELP", "parse_when"]

WHEN_HELP = "today, yesterday, a duration back (7d, 12h), a date (2026-12-01) or an ISO instant"


def parse_when(value: str, now: datetime, option: str) -> datetime:
    """The UTC instant ``value`` names, relative to ``now``."""
    word = value.strip().lower()
    midnight = datetime.combine(now.astimezone(UTC).date(), time(), UTC)
    named = {"now": now, "today": midnight, "yesterday": midnight - timedelta(days=1)}
    if word in named:
        return named[word]
    try:
        return now - parse_duration(word)
    except ValueError:
        pass
    try:
        if len(word) == 10:
            return datetime.combine(date.fromisoformat(word), time(), UTC)
        instant = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise typer.BadParameter(
            f"{value!r} is not a point in time; use {WHEN_HELP}", param_hint=option
        ) from None
    return instant if instant.tzinfo else instant.replace(tzinfo=UTC)
