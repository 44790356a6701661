"""The dashboard's time views: what changed, not only how much.

For the window and the one before it (same length, just before), bucketed by UTC hour
(windows up to 48 h) or UTC day: requests, denials and spend per workload, each
bucket set against the bucket one window-length earlier, and flagged when it moved by
``CHANGE`` or more of that earlier value (above a floor, so three requests against
two are not news) and, for the counts, by more than their noise: two counts of
independent arrivals differ by about ``sqrt(a + b)`` by chance alone, so a move of
``NOISE`` times that or less is not flagged (25 requests in a night hour against 14
the week before is chance; 500 against 1,000 is not). Beside them: every USD
budget's limit against what is spent and held in its current period (and whether
it refuses requests), spend by requested candidate count, and pending
reconciliation by workload and route.

The SQL stays in the dialect SQLite and PostgreSQL share; the one thing that differs,
the bucket of a timestamp, is the source's (``LedgerSource.bucket``). Two grouped
reads of the two windows, one of the current budget periods (only when a budget is
configured), one of the pending rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from ncap.config import Workload
from ncap.domain.money import micros_from_usd
from ncap.reports.model import Window, _plain
from ncap.reports.source import LedgerSource, parse_stamp

__all__ = [
    "CHANGE",
    "BudgetUse",
    "CandidateSpend",
    "Change",
    "PendingCell",
    "Point",
    "Series",
    "Timeline",
    "build_timeline",
    "moved",
    "timeline_dict",
]

HOURLY_UP_TO = timedelta(hours=48)
CHANGE = 0.4  # a move of 40 % of the earlier value, either way, is flagged
NOISE = 3.0  # ...and, for counts, more than 3 standard deviations of chance
COUNTS: frozenset[str] = frozenset({"requests", "denials"})
# below these (in both periods) a bucket is too small to flag
FLOOR: Mapping[str, float] = {"requests": 20, "denials": 10, "spend": 10_000}  # spend: µ$
NEAR = 0.8  # a budget at 80 % of its limit reads "near"
Metric = Literal["requests", "denials", "spend"]
METRICS: tuple[Metric, ...] = ("requests", "denials", "spend")
_HELD = "('pending', 'usage_reconciliation_required', 'reserved')"

_SERIES_SQL = f"""
SELECT {{bucket}}, workload_id, requested_candidate_count,
       SUM(CASE WHEN attempt <= 1 THEN 1 ELSE 0 END),
       SUM(CASE WHEN policy_result = 'deny' THEN 1 ELSE 0 END),
       COALESCE(SUM(cost_micros), 0),
       COALESCE(SUM(CASE WHEN state IN {_HELD} THEN reserved_cost_micros ELSE 0 END), 0)
FROM {{scan}}
WHERE timestamp >= ? AND timestamp < ?
GROUP BY {{bucket}}, workload_id, requested_candidate_count
"""

_PERIODS_SQL = f"""
SELECT workload_id,
       COALESCE(SUM(CASE WHEN timestamp >= ? THEN cost_micros ELSE 0 END), 0),
       COALESCE(SUM(CASE WHEN timestamp >= ? AND state IN {_HELD}
                    THEN reserved_cost_micros ELSE 0 END), 0),
       SUM(CASE WHEN timestamp >= ? AND policy_reason = 'budget_exhausted' THEN 1 ELSE 0 END),
       COALESCE(SUM(cost_micros), 0),
       COALESCE(SUM(CASE WHEN state IN {_HELD} THEN reserved_cost_micros ELSE 0 END), 0),
       SUM(CASE WHEN policy_reason = 'budget_exhausted' THEN 1 ELSE 0 END)
FROM {{scan}}
WHERE timestamp >= ? AND timestamp < ?
GROUP BY workload_id
"""

_PENDING_SQL = """
SELECT workload_id, route_id, COUNT(*), COALESCE(SUM(reserved_cost_micros), 0), MIN(timestamp)
FROM ledger_events
WHERE state IN ('pending', 'usage_reconciliation_required') AND state <> 'settled'
  AND timestamp < ?
GROUP BY workload_id, route_id
"""


@dataclass(frozen=True, slots=True)
class Point:
    """One bucket of a series against the bucket one window-length earlier."""

    bucket: str  # UTC: 2026-12-01 (day) or 2026-12-01T14 (hour)
    previous_bucket: str
    value: float
    previous: float
    change: float | None  # (value - previous) / previous; None when previous is 0
    flagged: bool


@dataclass(frozen=True, slots=True)
class Series:
    workload_id: str
    metric: Metric
    points: list[Point]
    total: float
    previous_total: float
    change: float | None
    flagged: bool  # the window's total moved by CHANGE or more


@dataclass(frozen=True, slots=True)
class Change:
    """A flagged bucket (or a window total: ``bucket`` is ``"window"``)."""

    workload_id: str
    metric: Metric
    bucket: str
    value: float
    previous: float
    change: float | None


@dataclass(frozen=True, slots=True)
class BudgetUse:
    """A workload's USD budget in its current period (the one holding the window's end)."""

    workload_id: str
    window: Literal["day", "month"]
    period: str
    limit_micros: int
    spent_micros: int
    held_micros: int
    refusals: int  # budget_exhausted denials of the workload in the period
    used: float  # (spent + held) / limit
    status: Literal["ok", "near", "refusing"]
    # day budgets: the window's days, (day, spent, held), to set against the limit
    days: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CandidateSpend:
    requested: str  # "omitted" or the n asked for
    requests: int
    spend_micros: int
    previous_spend_micros: int
    change: float | None


@dataclass(frozen=True, slots=True)
class PendingCell:
    workload_id: str
    route_id: str | None
    count: int
    held_micros: int
    oldest: datetime | None


@dataclass(frozen=True, slots=True)
class Timeline:
    granularity: Literal["hour", "day"]
    buckets: list[str]
    series: list[Series]
    changes: list[Change]
    budgets: list[BudgetUse]
    by_candidates: list[CandidateSpend]
    pending: list[PendingCell]


def build_timeline(
    source: LedgerSource, window: Window, workloads: Mapping[str, Workload]
) -> Timeline:
    hourly = window.end - window.start <= HOURLY_UP_TO
    starts = _bucket_starts(window, hourly)
    length = window.end - window.start
    previous = window.previous()
    current_rows = _read(source, window, hourly)
    previous_rows = _read(source, previous, hourly)
    keys = [_key(t, hourly) for t in starts]
    earlier = [_key(_floor(t - length, hourly), hourly) for t in starts]
    series = _series(current_rows, previous_rows, keys, earlier)
    return Timeline(
        granularity="hour" if hourly else "day",
        buckets=keys,
        series=series,
        changes=_changes(series),
        budgets=_budgets(source, window, workloads, current_rows, hourly),
        by_candidates=_by_candidates(current_rows, previous_rows),
        pending=_pending(source, window),
    )


def timeline_dict(timeline: Timeline) -> dict[str, Any]:
    return _plain(asdict(timeline))  # type: ignore[no-any-return]


# -- reading -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Row:
    bucket: str
    workload_id: str
    requested: int | None
    requests: int
    denials: int
    spend: int
    held: int


def _read(source: LedgerSource, window: Window, hourly: bool) -> list[_Row]:
    span = (source.stamp(window.start), source.stamp(window.end))
    sql = _SERIES_SQL.format(bucket=source.bucket(hourly), scan=source.scan(*span))
    return [
        _Row(str(r[0]), str(r[1]), _opt(r[2]), _int(r[3]), _int(r[4]), _int(r[5]), _int(r[6]))
        for r in source.query(sql, span)
    ]


def _int(value: Any) -> int:
    return int(value) if value is not None else 0


def _opt(value: Any) -> int | None:
    return int(value) if value is not None else None


def _floor(moment: datetime, hourly: bool) -> datetime:
    moment = moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    return moment if hourly else moment.replace(hour=0)


def _key(moment: datetime, hourly: bool) -> str:
    return moment.strftime("%Y-%m-%dT%H" if hourly else "%Y-%m-%d")


def _bucket_starts(window: Window, hourly: bool) -> list[datetime]:
    step = timedelta(hours=1) if hourly else timedelta(days=1)
    moment, out = _floor(window.start, hourly), []
    while moment < window.end:
        out.append(moment)
        moment += step
    return out


# -- series and changes --------------------------------------------------------------------


def _change(value: float, previous: float) -> float | None:
    return round((value - previous) / previous, 4) if previous else None


def moved(metric: Metric, value: float, previous: float) -> bool:
    """Flag a move of CHANGE or more, above the metric's floor (a new source of traffic,
    previous 0, counts once it passes the floor); a count's move must also exceed
    NOISE times the spread two Poisson counts have by chance (``sqrt(value + previous)``)."""
    if max(value, previous) < FLOOR[metric]:
        return False
    move = abs(value - previous)
    if metric in COUNTS and move <= NOISE * (value + previous) ** 0.5:
        return False
    return previous == 0 or move >= CHANGE * previous


def _values(row: _Row, metric: Metric) -> float:
    return float({"requests": row.requests, "denials": row.denials, "spend": row.spend}[metric])


def _totals(rows: Sequence[_Row], metric: Metric) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = defaultdict(float)
    for row in rows:
        out[(row.workload_id, row.bucket)] += _values(row, metric)
    return out


def _series(
    current: Sequence[_Row], previous: Sequence[_Row], keys: list[str], earlier: list[str]
) -> list[Series]:
    workloads = sorted({r.workload_id for r in (*current, *previous)})
    out = []
    for metric in METRICS:
        now, before = _totals(current, metric), _totals(previous, metric)
        for workload in workloads:
            points = [
                _point(metric, key, prev_key, now[(workload, key)], before[(workload, prev_key)])
                for key, prev_key in zip(keys, earlier, strict=True)
            ]
            total = sum(p.value for p in points)
            previous_total = sum(p.previous for p in points)
            if not total and not previous_total:
                continue
            out.append(
                Series(
                    workload,
                    metric,
                    points,
                    total,
                    previous_total,
                    _change(total, previous_total),
                    moved(metric, total, previous_total),
                )
            )
    return out


def _point(metric: Metric, key: str, prev_key: str, value: float, previous: float) -> Point:
    return Point(
        key, prev_key, value, previous, _change(value, previous), moved(metric, value, previous)
    )


def _changes(series: Sequence[Series]) -> list[Change]:
    """Every flagged window total and bucket, the largest moves first."""
    out = []
    for s in series:
        if s.flagged:
            total = Change(s.workload_id, s.metric, "window", s.total, s.previous_total, s.change)
            out.append(total)
        out += [
            Change(s.workload_id, s.metric, p.bucket, p.value, p.previous, p.change)
            for p in s.points
            if p.flagged
        ]
    return sorted(out, key=lambda c: (-abs(c.change if c.change is not None else 9.9), c.bucket))


# -- budgets, candidate counts, pending ----------------------------------------------------


def _budgets(
    source: LedgerSource,
    window: Window,
    workloads: Mapping[str, Workload],
    rows: Sequence[_Row],
    hourly: bool,
) -> list[BudgetUse]:
    limited = {
        name: w for name, w in workloads.items() if w.usd_per_day is not None or w.usd_per_month
    }
    if not limited:
        return []
    end = window.end.astimezone(UTC)
    day = end.replace(hour=0, minute=0, second=0, microsecond=0)
    month = day.replace(day=1)
    day_s, month_s = source.stamp(day), source.stamp(month)
    span = (month_s, source.stamp(end))
    sql = _PERIODS_SQL.format(scan=source.scan(*span))
    found = {str(r[0]): r for r in source.query(sql, (day_s, day_s, day_s, *span))}
    daily = _daily(rows) if not hourly else {}
    out = []
    for name, workload in sorted(limited.items()):
        r = found.get(name)
        for scope, usd, offset, period in (
            ("day", workload.usd_per_day, 1, day.strftime("%Y-%m-%d")),
            ("month", workload.usd_per_month, 4, month.strftime("%Y-%m")),
        ):
            limit = micros_from_usd(usd)
            if not limit:
                continue
            spent, held, refused = (
                (_int(r[offset]), _int(r[offset + 1]), _int(r[offset + 2])) if r else (0, 0, 0)
            )
            days = daily.get(name, []) if scope == "day" else []
            out.append(_use(name, scope, period, limit, spent, held, refused, days))  # type: ignore[arg-type]
    return out


def _use(
    name: str,
    scope: Literal["day", "month"],
    period: str,
    limit: int,
    spent: int,
    held: int,
    refused: int,
    days: list[tuple[str, int, int]],
) -> BudgetUse:
    used = round((spent + held) / limit, 4)
    status: Literal["ok", "near", "refusing"] = (
        "refusing" if refused or used >= 1 else "near" if used >= NEAR else "ok"
    )
    return BudgetUse(name, scope, period, limit, spent, held, refused, used, status, days)


def _daily(rows: Sequence[_Row]) -> dict[str, list[tuple[str, int, int]]]:
    sums: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for row in rows:
        cell = sums[row.workload_id][row.bucket]
        cell[0] += row.spend
        cell[1] += row.held
    return {w: [(d, s, h) for d, (s, h) in sorted(days.items())] for w, days in sums.items()}


def _by_candidates(current: Sequence[_Row], previous: Sequence[_Row]) -> list[CandidateSpend]:
    def sums(rows: Sequence[_Row]) -> dict[int | None, list[int]]:
        out: dict[int | None, list[int]] = defaultdict(lambda: [0, 0])
        for row in rows:
            out[row.requested][0] += row.requests
            out[row.requested][1] += row.spend
        return out

    now, before = sums(current), sums(previous)
    order = sorted(set(now) | set(before), key=lambda n: -1 if n is None else n)
    return [
        CandidateSpend(
            "omitted" if n is None else str(n),
            now[n][0],
            now[n][1],
            before[n][1],
            _change(now[n][1], before[n][1]),
        )
        for n in order
    ]


def _pending(source: LedgerSource, window: Window) -> list[PendingCell]:
    rows = source.query(_PENDING_SQL, (source.stamp(window.end),))
    cells = [PendingCell(str(r[0]), r[1], _int(r[2]), _int(r[3]), parse_stamp(r[4])) for r in rows]
    return sorted(cells, key=lambda c: (-c.count, c.workload_id, c.route_id or ""))
