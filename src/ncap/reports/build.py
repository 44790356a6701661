"""Build the audit / daily control report from the ledger with a few portable queries.

Cost of a report: one grouped scan of the window (the "cube": every dimension the
sections need, so spend, denials, distribution and route mismatches come from it),
one per-request grouping of the window (output per request and returned-vs-effective
need all attempts of a request together), one grouped scan of the previous window's
first attempts (the shift check), and small indexed queries for exceptions and
pending rows. Percentiles are exact nearest-rank values read from a histogram
(``GROUP BY`` the per-request total), which both SQLite and PostgreSQL can do.

Definitions (docs/decisions/report-what-counts.md):
- a *request* is counted once, on its first row: ``attempt <= 1`` (a denial is
  attempt 0, or 1 when its reserved row was written beside a reservation on Redis and
  then became the denial; the first dispatched attempt is 1, emulated branches 1..k);
- *output per request* sums ``output_tokens_total`` over all attempts of an allowed
  request that has known usage (requests with no usage at all are in *pending*);
- *returned* for a request is the sum of ``returned_candidate_count`` over its
  attempts (emulated branches return one each), compared with the effective count;
- exception usage is over the exception's life up to the window's end, because its
  budget is a lifetime budget.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from ncap.config import ExceptionGrant, Pricing, Thresholds, utcnow
from ncap.domain.money import micros_from_usd
from ncap.reports.admin_tables import budget_alerts
from ncap.reports.evidence import candidate_evidence, duplicate_alerts
from ncap.reports.model import (
    Alert,
    DenialRow,
    DistributionRow,
    ExceptionUsage,
    MismatchRow,
    OutputStats,
    PendingRow,
    Report,
    RouteMismatch,
    Severity,
    ShiftResult,
    SpendRow,
    Totals,
    Window,
)
from ncap.reports.per_choice import choice_costs
from ncap.reports.source import LedgerSource, parse_stamp

__all__ = ["STEPS", "build_report", "nearest_rank", "population_stability_index"]

Step = Callable[[str], None]
UNSETTLED = "('pending', 'usage_reconciliation_required')"
STEPS = ("window", "requests", "previous window", "exceptions", "pending", "candidates")

_CUBE_SQL = """
SELECT workload_id, route_id, upstream_model, requested_candidate_count, exception_id,
       policy_result, policy_reason, state, reconciliation_reason,
       COUNT(*),
       SUM(CASE WHEN attempt <= 1 THEN 1 ELSE 0 END),
       COALESCE(SUM(cost_micros), 0),
       COALESCE(SUM(input_tokens), 0),
       COALESCE(SUM(output_tokens_total), 0),
       COALESCE(SUM(CASE WHEN state IN ('pending', 'usage_reconciliation_required')
                    THEN reserved_cost_micros ELSE 0 END), 0),
       COALESCE(SUM(CASE WHEN output_tokens_total IS NOT NULL AND returned_candidate_count > 0
                    THEN output_tokens_total ELSE 0 END), 0),
       COALESCE(SUM(CASE WHEN output_tokens_total IS NOT NULL AND returned_candidate_count > 0
                    THEN returned_candidate_count ELSE 0 END), 0),
       SUM(CASE WHEN returned_candidate_count > 0 THEN 1 ELSE 0 END)
FROM {scan}
WHERE timestamp >= ? AND timestamp < ?
GROUP BY workload_id, route_id, upstream_model, requested_candidate_count, exception_id,
         policy_result, policy_reason, state, reconciliation_reason
"""

# an attempt that got no answer from its route (or a refusal: ``upstream_status``)
FAILED_REASONS = "('timeout', 'connection_error', 'upstream_error_after_dispatch', 'gateway_lost')"

_REQUESTS_SQL = f"""
SELECT workload_id, requested, effective, returned, output, COUNT(*), failed
FROM (SELECT MIN(workload_id) AS workload_id,
             MAX(requested_candidate_count) AS requested,
             MAX(effective_candidate_count) AS effective,
             SUM(returned_candidate_count) AS returned,
             SUM(output_tokens_total) AS output,
             MAX(CASE WHEN upstream_status IS NOT NULL
                       OR reconciliation_reason IN {FAILED_REASONS}
                      THEN 1 ELSE 0 END) AS failed
      FROM {{scan}}
      WHERE timestamp >= ? AND timestamp < ? AND policy_result = 'allow'
      GROUP BY request_id) AS per_request
GROUP BY workload_id, requested, effective, returned, output, failed
"""

_PREVIOUS_SQL = """
SELECT workload_id, requested_candidate_count, COUNT(*)
FROM {scan}
WHERE timestamp >= ? AND timestamp < ? AND attempt <= 1
GROUP BY workload_id, requested_candidate_count
"""

_EXCEPTIONS_SQL = """
SELECT exception_id,
       SUM(CASE WHEN attempt <= 1 THEN 1 ELSE 0 END),
       SUM(CASE WHEN attempt <= 1 AND timestamp >= ? THEN 1 ELSE 0 END),
       COALESCE(SUM(CASE WHEN state IN ('settled', 'reconciled') THEN cost_micros ELSE 0 END), 0),
       COALESCE(SUM(CASE WHEN state IN ('pending', 'usage_reconciliation_required', 'reserved')
                    THEN reserved_cost_micros ELSE 0 END), 0),
       MAX(timestamp)
FROM {scan}
WHERE exception_id IS NOT NULL AND timestamp < ?
GROUP BY exception_id
"""

_AFTER_EXPIRY_SQL = """
SELECT COUNT(*) FROM {scan}
WHERE exception_id IS NOT NULL AND exception_id = ? AND attempt <= 1
  AND timestamp >= ? AND timestamp < ?
"""

_PENDING_SQL = f"""
SELECT state, reconciliation_reason, COUNT(*), COALESCE(SUM(reserved_cost_micros), 0),
       MIN(timestamp)
FROM ledger_events
WHERE state IN {UNSETTLED} AND state <> 'settled' AND timestamp < ?
GROUP BY state, reconciliation_reason
"""


@dataclass(frozen=True, slots=True)
class _Cell:
    """One group of the window cube."""

    workload_id: str
    route_id: str | None
    model: str | None
    requested: int | None
    exception_id: str | None
    policy_result: str
    policy_reason: str
    state: str
    reconciliation_reason: str | None
    attempts: int
    requests: int
    cost: int
    input_tokens: int
    output_tokens: int
    held: int
    choice_output: int
    choices: int
    answered: int = 0  # attempts that returned choices (a fallback route answers retries)


@dataclass(frozen=True, slots=True)
class _RequestGroup:
    workload_id: str
    requested: int | None
    effective: int
    returned: int | None
    output: int | None
    count: int
    failed: bool = False  # an attempt failed upstream (an outage, a refusal)


def build_report(
    source: LedgerSource,
    window: Window,
    *,
    kind: Literal["audit", "daily"] = "audit",
    exceptions: Sequence[ExceptionGrant] = (),
    revoked: Mapping[str, datetime] | None = None,
    thresholds: Thresholds | None = None,
    extra_alerts: Iterable[Alert] = (),
    pricing: Mapping[str, Pricing] | None = None,
    now: datetime | None = None,
    step: Step | None = None,
) -> Report:
    """The whole report for ``window``; ``step`` is called before each query (progress)."""
    started = time.perf_counter()
    limits = thresholds or Thresholds()
    now = now or utcnow()
    tick = step or (lambda _name: None)
    previous = window.previous()
    cells, groups, before = _scan_windows(source, window, previous, tick)
    tick("exceptions")
    usage = _exception_usage(source, window, exceptions, revoked or {})
    tick("pending")
    pending = _pending(source, window)
    output = _output_stats(groups, cells)
    shift = _shift(cells, before, limits)
    tick("candidates")
    candidates = candidate_evidence(source, window, pricing)
    report = Report(
        kind=kind,
        generated_at=now,
        window=window,
        previous=previous,
        totals=_totals(cells),
        distribution=_distribution(cells),
        mismatches=_mismatches(groups),
        route_mismatches=_route_mismatches(cells),
        output=output,
        per_choice=choice_costs(source, window, pricing),
        exceptions=usage,
        denials=_denials(cells),
        pending=pending,
        spend_by_workload=_spend(cells, lambda c: c.workload_id),
        spend_by_route=_spend(cells, lambda c: c.route_id),
        spend_by_model=_spend(cells, lambda c: c.model),
        shift=shift,
        thresholds=limits.model_dump(),
        alerts=[],
        elapsed_ms=0.0,
        candidates=candidates,
    )
    alerts = [
        *_threshold_alerts(report, limits, now),
        *_shift_alerts(shift, limits.distribution_shift_psi),
        *duplicate_alerts(candidates, limits),
        *budget_alerts(source, window),
        *extra_alerts,
    ]
    elapsed = round((time.perf_counter() - started) * 1000, 1)
    return _with(report, alerts=alerts, elapsed_ms=elapsed)


def _scan_windows(
    source: LedgerSource, window: Window, previous: Window, tick: Step
) -> tuple[list[_Cell], list[_RequestGroup], list[Any]]:
    """The three grouped reads of the window and the previous window."""
    span = (source.stamp(window.start), source.stamp(window.end))
    tick("window")
    scan = source.scan(*span)
    cells = [_cell(row) for row in source.query(_CUBE_SQL.format(scan=scan), span)]
    tick("requests")
    groups = [_group(row) for row in source.query(_REQUESTS_SQL.format(scan=scan), span)]
    tick("previous window")
    before_span = (source.stamp(previous.start), span[0])
    before_sql = _PREVIOUS_SQL.format(scan=source.scan(*before_span))
    return cells, groups, source.query(before_sql, before_span)


def _with(report: Report, **changes: Any) -> Report:
    from dataclasses import replace

    return replace(report, **changes)


def _int(value: Any) -> int:
    return int(value) if value is not None else 0


def _opt(value: Any) -> int | None:
    return int(value) if value is not None else None


def _cell(row: Sequence[Any]) -> _Cell:
    return _Cell(
        workload_id=str(row[0]),
        route_id=row[1],
        model=row[2],
        requested=_opt(row[3]),
        exception_id=row[4],
        policy_result=str(row[5]),
        policy_reason=str(row[6]),
        state=str(row[7]),
        reconciliation_reason=row[8],
        attempts=_int(row[9]),
        requests=_int(row[10]),
        cost=_int(row[11]),
        input_tokens=_int(row[12]),
        output_tokens=_int(row[13]),
        held=_int(row[14]),
        choice_output=_int(row[15]),
        choices=_int(row[16]),
        answered=_int(row[17]),
    )


def _group(row: Sequence[Any]) -> _RequestGroup:
    return _RequestGroup(
        workload_id=str(row[0]),
        requested=_opt(row[1]),
        effective=_int(row[2]),
        returned=_opt(row[3]),
        output=_opt(row[4]),
        count=_int(row[5]),
        failed=bool(row[6]),
    )


def _totals(cells: list[_Cell]) -> Totals:
    return Totals(
        requests=sum(c.requests for c in cells),
        attempts=sum(c.attempts for c in cells if c.policy_result == "allow"),
        denied_requests=sum(c.requests for c in cells if c.policy_result == "deny"),
        cost_micros=sum(c.cost for c in cells),
        input_tokens=sum(c.input_tokens for c in cells),
        output_tokens=sum(c.output_tokens for c in cells),
    )


def _distribution(cells: list[_Cell]) -> list[DistributionRow]:
    counts: dict[tuple[str, str | None, int | None], int] = defaultdict(int)
    for c in cells:
        if c.requests:
            counts[(c.workload_id, c.route_id, c.requested)] += c.requests
    return [
        DistributionRow(w, r, n, count)
        for (w, r, n), count in sorted(counts.items(), key=lambda kv: _sort_key(kv[0]))
    ]


def _sort_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((v is not None, v if v is not None else "") for v in key)


def _mismatches(groups: list[_RequestGroup]) -> list[MismatchRow]:
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for g in groups:
        for kind in _kinds(g):
            counts[(g.workload_id, kind)] += g.count
    return [MismatchRow(w, k, n) for (w, k), n in sorted(counts.items())]  # type: ignore[arg-type]


def _kinds(g: _RequestGroup) -> list[str]:
    kinds = []
    if g.requested is None:
        kinds.append("omitted_normalized")
    elif g.requested != g.effective:
        kinds.append("requested_altered")
    if g.failed and not g.returned:
        # the route failed (a 502 upstream_error to the client): an outage or a refusal,
        # not a route or gateway defect about the count; listed, not in the mismatch rate
        kinds.append("upstream_failed")
    elif g.returned is None:
        kinds.append("none_returned")
    elif g.returned < g.effective:
        kinds.append("fewer_returned")
    elif g.returned > g.effective:
        kinds.append("more_returned")
    return kinds


def _route_mismatches(cells: list[_Cell]) -> list[RouteMismatch]:
    attempts: dict[str | None, list[int]] = defaultdict(lambda: [0, 0])
    for c in cells:
        if c.policy_result != "allow":
            continue
        attempts[c.route_id][0] += c.attempts
        if c.reconciliation_reason == "returned_mismatch":
            attempts[c.route_id][1] += c.attempts
    return [
        RouteMismatch(route, total, bad)
        for route, (total, bad) in sorted(attempts.items(), key=lambda kv: kv[0] or "")
    ]


def nearest_rank(histogram: Mapping[int, int], p: float) -> int | None:
    """The nearest-rank ``p`` percentile (0 < p <= 1) of a value -> count histogram."""
    total = sum(histogram.values())
    if total == 0:
        return None
    rank = max(1, math.ceil(p * total))
    seen = 0
    for value in sorted(histogram):
        seen += histogram[value]
        if seen >= rank:
            return value
    raise AssertionError("unreachable: the ranks add up to the total")


def _output_stats(groups: list[_RequestGroup], cells: list[_Cell]) -> list[OutputStats]:
    histograms: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for g in groups:
        if g.output is not None:
            histograms["*"][g.output] += g.count
            histograms[g.workload_id][g.output] += g.count
    choices: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for c in cells:
        for key in ("*", c.workload_id):
            choices[key][0] += c.choice_output
            choices[key][1] += c.choices
    keys = ["*", *sorted(k for k in set(histograms) | set(choices) if k != "*")]
    return [_stats(key, histograms.get(key, {}), *choices.get(key, [0, 0])) for key in keys]


def _stats(key: str, histogram: Mapping[int, int], out: int, choices: int) -> OutputStats:
    requests = sum(histogram.values())
    total = sum(v * n for v, n in histogram.items())
    return OutputStats(
        workload_id=key,
        requests=requests,
        mean=round(total / requests, 3) if requests else None,
        p50=nearest_rank(histogram, 0.50),
        p95=nearest_rank(histogram, 0.95),
        output_tokens=out,
        returned_choices=choices,
        per_choice=round(out / choices, 3) if choices else None,
    )


def _exception_usage(
    source: LedgerSource,
    window: Window,
    grants: Sequence[ExceptionGrant],
    revoked: Mapping[str, datetime],
) -> list[ExceptionUsage]:
    start, end = source.stamp(window.start), source.stamp(window.end)
    sql = _EXCEPTIONS_SQL.format(scan=source.exception_scan())
    rows = {row[0]: row for row in source.query(sql, (start, end))}
    usage = [
        _grant_usage(source, window, g, rows.pop(g.id, None), revoked.get(g.id)) for g in grants
    ]
    usage += [_unknown_usage(eid, row) for eid, row in sorted(rows.items())]
    return usage


def _grant_usage(
    source: LedgerSource,
    window: Window,
    grant: ExceptionGrant,
    row: Sequence[Any] | None,
    revoked_at: datetime | None,
) -> ExceptionUsage:
    spent, held = (_int(row[3]), _int(row[4])) if row else (0, 0)
    budget = micros_from_usd(grant.budget_usd)
    after = 0
    if row and grant.expires < window.end:
        since, until = source.stamp(grant.expires), source.stamp(window.end)
        sql = _AFTER_EXPIRY_SQL.format(scan=source.exception_scan())
        after = _int(source.query(sql, (grant.id, since, until))[0][0])
    return ExceptionUsage(
        id=grant.id,
        workload=grant.workload,
        owner=grant.owner,
        max_candidates=grant.max_candidates,
        budget_micros=budget,
        expires=grant.expires,
        status=_status(grant, window, revoked_at),
        requests_window=_int(row[2]) if row else 0,
        requests_total=_int(row[1]) if row else 0,
        spent_micros=spent,
        held_micros=held,
        used_fraction=round((spent + held) / budget, 6) if budget else None,
        requests_after_expiry=after,
        last_used=parse_stamp(row[5]) if row else None,
        revoked_at=revoked_at if revoked_at and revoked_at < window.end else None,
    )


def _status(
    grant: ExceptionGrant, window: Window, revoked_at: datetime | None
) -> Literal["active", "expired", "revoked"]:
    """At the window's end: revoked (through the admin API) before expired before active;
    a revocation after the window's end did not apply to it yet."""
    if revoked_at is not None and revoked_at < window.end:
        return "revoked"
    return "expired" if grant.expires <= window.end else "active"


def _unknown_usage(exception_id: str, row: Sequence[Any]) -> ExceptionUsage:
    """Rows naming an exception the config no longer has (revoked or renamed)."""
    return ExceptionUsage(
        id=exception_id,
        workload=None,
        owner=None,
        max_candidates=None,
        budget_micros=None,
        expires=None,
        status="not_in_config",
        requests_window=_int(row[2]),
        requests_total=_int(row[1]),
        spent_micros=_int(row[3]),
        held_micros=_int(row[4]),
        used_fraction=None,
        requests_after_expiry=0,
        last_used=parse_stamp(row[5]),
    )


def _denials(cells: list[_Cell]) -> list[DenialRow]:
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for c in cells:
        if c.policy_result == "deny":
            counts[(c.policy_reason, c.workload_id)] += c.requests
    return [
        DenialRow(r, w, n) for (r, w), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ]


def _pending(source: LedgerSource, window: Window) -> list[PendingRow]:
    rows = source.query(_PENDING_SQL, (source.stamp(window.end),))
    found = [PendingRow(str(r[0]), r[1], _int(r[2]), _int(r[3]), parse_stamp(r[4])) for r in rows]
    return sorted(found, key=lambda p: (p.state, p.reason or ""))


def _spend(cells: list[_Cell], key: Callable[[_Cell], str | None]) -> list[SpendRow]:
    sums: dict[str | None, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0, 0])
    for c in cells:
        s = sums[key(c)]
        s[0] += c.requests
        s[1] += c.attempts if c.policy_result == "allow" else 0
        s[2] += c.cost
        s[3] += c.held
        s[4] += c.output_tokens
        s[5] += c.answered
    rows = [SpendRow(k, *v) for k, v in sums.items()]
    return sorted(rows, key=lambda r: (-r.cost_micros, r.key or ""))


def population_stability_index(current: Mapping[str, int], previous: Mapping[str, int]) -> float:
    """PSI = sum((p - q) * ln(p / q)) over the buckets of both mixes.

    Each bucket gets half a request added (both windows) so an empty bucket is finite.
    """
    buckets = sorted(set(current) | set(previous))
    n_cur = sum(current.values()) + 0.5 * len(buckets)
    n_prev = sum(previous.values()) + 0.5 * len(buckets)
    psi = 0.0
    for b in buckets:
        p = (current.get(b, 0) + 0.5) / n_cur
        q = (previous.get(b, 0) + 0.5) / n_prev
        psi += (p - q) * math.log(p / q)
    return psi


def _bucket(requested: int | None) -> str:
    return "omitted" if requested is None else str(requested)


def _shift(cells: list[_Cell], before: list[Any], limits: Thresholds) -> list[ShiftResult]:
    cur: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    prev: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for c in cells:
        if c.requests:
            for key in ("*", c.workload_id):
                cur[key][_bucket(c.requested)] += c.requests
    for workload, requested, count in before:
        for key in ("*", str(workload)):
            prev[key][_bucket(_opt(requested))] += _int(count)
    keys = ["*", *sorted(k for k in set(cur) | set(prev) if k != "*")]
    return [_shift_one(k, dict(cur.get(k, {})), dict(prev.get(k, {})), limits) for k in keys]


def _shift_one(
    key: str, cur: dict[str, int], prev: dict[str, int], limits: Thresholds
) -> ShiftResult:
    n_cur, n_prev = sum(cur.values()), sum(prev.values())
    if min(n_cur, n_prev) < limits.shift_min_requests:
        return ShiftResult(key, None, n_cur, n_prev, "insufficient_data", cur, prev)
    psi = round(population_stability_index(cur, prev), 6)
    status: Literal["stable", "shift"] = (
        "shift" if psi > limits.distribution_shift_psi else "stable"
    )
    return ShiftResult(key, psi, n_cur, n_prev, status, cur, prev)


def _shift_alerts(shift: list[ShiftResult], limit: float) -> list[Alert]:
    alerts = []
    for s in shift:
        if s.status != "shift":
            continue
        scope = "all workloads" if s.workload_id == "*" else s.workload_id
        message = (
            f"requested-candidate mix of {scope} shifted from the previous window "
            f"(PSI {s.psi:.3f} > {limit:g})"
        )
        alerts.append(
            Alert(
                "distribution_shift", "warning", "requested_candidates_shift", message, s.psi, limit
            )
        )
    return alerts


def _threshold_alerts(report: Report, t: Thresholds, now: datetime) -> list[Alert]:
    alerts: list[Alert] = []
    overall = report.output[0] if report.output else None
    p95, mean = (overall.p95, overall.mean) if overall else (None, None)
    p95_limit, mean_limit = t.output_tokens_per_request_p95, t.output_tokens_per_request_mean
    if p95 is not None and p95_limit is not None and p95 > p95_limit:
        alerts.append(
            _alert("output_p95_above_threshold", "output tokens per request p95", p95, p95_limit)
        )
    if mean is not None and mean_limit is not None and mean > mean_limit:
        alerts.append(
            _alert(
                "output_mean_above_threshold", "output tokens per request mean", mean, mean_limit
            )
        )
    alerts += _rate_alerts(report, t)
    alerts += _pending_alerts(report, t, now)
    alerts += _exception_alerts(report, t)
    return alerts


def _alert(
    code: str, what: str, value: float, limit: float, severity: Severity = "warning"
) -> Alert:
    message = f"{what} is {value:g}, above {limit:g}"
    return Alert("threshold", severity, code, message, float(value), float(limit))


def _rate_alerts(report: Report, t: Thresholds) -> list[Alert]:
    alerts = []
    total = report.totals.requests
    if t.denial_rate is not None and total:
        rate = report.totals.denied_requests / total
        if rate > t.denial_rate:
            alerts.append(
                _alert("denial_rate_above_threshold", "denial rate", round(rate, 6), t.denial_rate)
            )
    allowed = total - report.totals.denied_requests
    bad = sum(
        m.requests
        for m in report.mismatches
        if m.kind in ("fewer_returned", "more_returned", "requested_altered")
    )
    if t.mismatch_rate is not None and allowed and bad / allowed > t.mismatch_rate:
        alerts.append(
            _alert(
                "mismatch_rate_above_threshold",
                "requested/effective/returned mismatch rate",
                round(bad / allowed, 6),
                t.mismatch_rate,
            )
        )
    return alerts


def _pending_alerts(report: Report, t: Thresholds, now: datetime) -> list[Alert]:
    alerts = []
    pending = report.pending_total
    if t.pending_count is not None and pending.count > t.pending_count:
        alerts.append(
            _alert(
                "pending_count_above_threshold",
                "pending reconciliation count",
                pending.count,
                t.pending_count,
            )
        )
    age = t.pending_age_delta
    if age is not None and pending.oldest is not None and now - pending.oldest > age:
        hours = (now - pending.oldest).total_seconds() / 3600
        alerts.append(
            _alert(
                "pending_older_than_threshold",
                "oldest pending row age (hours)",
                round(hours, 2),
                age.total_seconds() / 3600,
            )
        )
    return alerts


def _exception_alerts(report: Report, t: Thresholds) -> list[Alert]:
    alerts = []
    for e in report.exceptions:
        if e.used_fraction is not None and e.used_fraction >= 1:
            alerts.append(
                _alert(
                    "exception_budget_exhausted",
                    f"exception {e.id} budget used",
                    e.used_fraction,
                    1.0,
                    "critical",
                )
            )
        elif e.used_fraction is not None and e.used_fraction >= t.exception_budget_warn:
            alerts.append(
                _alert(
                    "exception_budget_warning",
                    f"exception {e.id} budget used",
                    e.used_fraction,
                    t.exception_budget_warn,
                )
            )
        if e.requests_after_expiry:
            alerts.append(
                Alert(
                    "threshold",
                    "critical",
                    "expired_exception_in_use",
                    f"exception {e.id} expired but {e.requests_after_expiry} "
                    "request(s) used it after expiry",
                    float(e.requests_after_expiry),
                    0.0,
                )
            )
        if e.status == "not_in_config" and e.requests_window:
            alerts.append(
                Alert(
                    "threshold",
                    "warning",
                    "unknown_exception_in_use",
                    f"exception {e.id} is not in the config but "
                    f"{e.requests_window} request(s) in the window used it",
                    float(e.requests_window),
                    0.0,
                )
            )
    return alerts
