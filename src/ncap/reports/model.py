"""The report as plain frozen data: every renderer (table, JSON, HTML, dashboard) reads
this and nothing else, so they cannot disagree.

Money is integer micro-USD; a requested count of ``None`` means the body omitted ``n``.
``alerts`` is one list fed by several sources (``threshold``, ``distribution_shift``
today; budget webhooks and admin-API exceptions later append to it the same way).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

__all__ = [
    "Alert",
    "CandidateEvidence",
    "ChoiceCost",
    "DenialRow",
    "DistributionRow",
    "ExceptionUsage",
    "MismatchRow",
    "OutputStats",
    "PendingRow",
    "Report",
    "RouteMismatch",
    "Severity",
    "ShiftResult",
    "SpendRow",
    "Totals",
    "Window",
    "report_dict",
]

Severity = Literal["info", "warning", "critical"]


@dataclass(frozen=True, slots=True)
class Window:
    """The half-open interval ``[start, end)`` a report covers."""

    start: datetime
    end: datetime

    def previous(self) -> Window:
        """The window of the same length just before this one (for the shift check)."""
        length: timedelta = self.end - self.start
        return Window(self.start - length, self.start)


@dataclass(frozen=True, slots=True)
class Totals:
    requests: int
    attempts: int
    denied_requests: int
    cost_micros: int
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class DistributionRow:
    workload_id: str
    route_id: str | None
    requested: int | None
    requests: int


@dataclass(frozen=True, slots=True)
class MismatchRow:
    """Allowed requests of one workload by how requested/effective/returned compare."""

    workload_id: str
    kind: Literal[
        "omitted_normalized",
        "requested_altered",
        "fewer_returned",
        "more_returned",
        "none_returned",
        "upstream_failed",
    ]
    requests: int


@dataclass(frozen=True, slots=True)
class RouteMismatch:
    route_id: str | None
    attempts: int
    returned_mismatch: int


@dataclass(frozen=True, slots=True)
class OutputStats:
    """Aggregate output tokens per request (all attempts of it) and per returned choice."""

    workload_id: str  # "*" for every workload together
    requests: int
    mean: float | None
    p50: int | None
    p95: int | None
    output_tokens: int
    returned_choices: int
    per_choice: float | None


@dataclass(frozen=True, slots=True)
class ChoiceCost:
    """Per returned choice, on the attempts whose route revealed each choice's output
    tokens (``output_tokens_per_choice``: the local engine, emulated branches); rows
    with only a total are not in it. ``cost_per_choice_micros`` is the attempts' cost
    over their choices (a shared prefill split evenly); ``output_cost_p95_micros`` the
    output price of the p95 choice, when the route's price is known."""

    route_id: str | None
    attempts: int
    choices: int
    tokens_mean: float | None
    tokens_p50: int | None
    tokens_p95: int | None
    tokens_max: int | None
    cost_per_choice_micros: float | None
    output_cost_p95_micros: float | None


@dataclass(frozen=True, slots=True)
class ExceptionUsage:
    id: str
    workload: str | None
    owner: str | None
    max_candidates: int | None
    budget_micros: int | None
    expires: datetime | None
    status: Literal["active", "expired", "revoked", "not_in_config"]
    requests_window: int
    requests_total: int
    spent_micros: int  # settled + reconciled, over the exception's life
    held_micros: int  # reservations still held by pending rows
    used_fraction: float | None  # (spent + held) / budget
    requests_after_expiry: int
    last_used: datetime | None
    revoked_at: datetime | None = None  # revoked through the admin API (status revoked)


@dataclass(frozen=True, slots=True)
class CandidateEvidence:
    """How different one workload's (and exception's) candidates were in the window,
    and what other candidate counts would have cost (``reports/evidence.py``)."""

    workload_id: str
    exception_id: str | None
    requests: int  # with evidence: two or more candidates returned in full
    candidates: int
    distinct_share_mean: float
    agreement_mean: float
    agreement: dict[str, int]  # requests per majority-share bin
    tool_call_share_mean: float
    duplicate_output_share: float | None
    priced_requests: int  # usage and prices known: the what-if is over these
    spent_micros: int
    what_if: dict[int, int]  # n -> micro-USD for the priced requests at n candidates
    saving_at_one_micros: int | None
    emulated_requests: int
    emulated_spent_micros: int | None
    native_equivalent_micros: int | None


@dataclass(frozen=True, slots=True)
class DenialRow:
    reason: str
    workload_id: str
    requests: int


@dataclass(frozen=True, slots=True)
class PendingRow:
    state: str
    reason: str | None
    count: int
    reserved_cost_micros: int
    oldest: datetime | None


@dataclass(frozen=True, slots=True)
class SpendRow:
    key: str | None
    requests: int  # first attempts: a request counts for the route it started on
    attempts: int
    cost_micros: int
    held_micros: int
    output_tokens: int
    answered: int = 0  # attempts that returned choices: what a route or model served


@dataclass(frozen=True, slots=True)
class ShiftResult:
    """Population stability index of the requested-count mix, this window vs previous."""

    workload_id: str  # "*" for all workloads
    psi: float | None
    current_requests: int
    previous_requests: int
    status: Literal["stable", "shift", "insufficient_data"]
    current: dict[str, int] = field(default_factory=dict)
    previous: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Alert:
    source: str  # threshold | distribution_shift | (later) budget | admin
    severity: Severity
    code: str
    message: str
    value: float | None = None
    threshold: float | None = None


@dataclass(frozen=True, slots=True)
class Report:
    kind: Literal["audit", "daily"]
    generated_at: datetime
    window: Window
    previous: Window
    totals: Totals
    distribution: list[DistributionRow]
    mismatches: list[MismatchRow]
    route_mismatches: list[RouteMismatch]
    output: list[OutputStats]
    per_choice: list[ChoiceCost]
    exceptions: list[ExceptionUsage]
    denials: list[DenialRow]
    pending: list[PendingRow]
    spend_by_workload: list[SpendRow]
    spend_by_route: list[SpendRow]
    spend_by_model: list[SpendRow]
    shift: list[ShiftResult]
    thresholds: dict[str, Any]
    alerts: list[Alert]
    elapsed_ms: float
    candidates: list[CandidateEvidence] = field(default_factory=list)

    @property
    def pending_total(self) -> PendingRow:
        """Every unsettled row together: count, reserved cost held, oldest."""
        oldest = [p.oldest for p in self.pending if p.oldest is not None]
        return PendingRow(
            "all",
            None,
            sum(p.count for p in self.pending),
            sum(p.reserved_cost_micros for p in self.pending),
            min(oldest) if oldest else None,
        )


def report_dict(report: Report) -> dict[str, Any]:
    """The report as JSON-ready data (timestamps in ISO 8601)."""
    data = asdict(report)
    data["pending_total"] = asdict(report.pending_total)
    return _plain(data)  # type: ignore[no-any-return]


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
