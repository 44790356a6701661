"""An attempt's final ledger columns, worked out from what it reported (docs/ledger.md),
and a denial's ``denied_*`` columns: pure functions of the plan, the attempt and its
report, which the books (``ncap.lifecycle.settle``) write."""

from __future__ import annotations

from typing import Any

from ncap.config import Pricing
from ncap.domain.events import LEDGER_INT_MAX, AttemptOutcome, settle
from ncap.domain.evidence import Evidence
from ncap.domain.money import cost_micros
from ncap.domain.reservation import Reservation
from ncap.errors import Refusal
from ncap.lifecycle.plan import Attempt, AttemptReport, Plan
from ncap.protocol.responses import SummaryUsage
from ncap.redact import bounded_id

__all__ = [
    "NOTHING_GENERATED",
    "candidate_count",
    "denied_columns",
    "final_columns",
    "usage_complete",
]

# outcomes that generated nothing: settled at zero, the hold released
NOTHING_GENERATED: tuple[AttemptOutcome, ...] = ("rejected", "unbilled_error")


def final_columns(
    attempt: Attempt, report: AttemptReport, outcome: AttemptOutcome, *, now: float
) -> tuple[dict[str, Any], bool]:
    """The row's final columns (docs/ledger.md) from what the attempt reported, and whether
    its hold stays reserved."""
    usage, rejected = report.usage, outcome in NOTHING_GENERATED
    settlement = settle(
        effective_n=attempt.plan.expected_returned,
        returned_n=0 if rejected else report.returned,
        usage_present=usage_complete(usage),
        stream=report.stream,
        outcome=outcome,
    )
    if rejected and usage_complete(usage):
        final = _usage_fields(usage, attempt.route.route.pricing)  # what it reported
    elif rejected:
        final = dict(_NOTHING_USED)
    elif settlement.state == "settled":
        final = _usage_fields(usage, attempt.route.route.pricing)
        final["output_tokens_per_choice"] = _per_choice(attempt, report)
    else:
        final = {}
    if report.evidence is not None and not rejected:
        final.update(_evidence_columns(report.evidence))
    final.update(
        # an upstream's id as it sent it is untrusted: the ledger keeps plausible ids only
        provider_request_id=bounded_id(report.provider_request_id),
        returned_candidate_count=0 if rejected else report.returned,
        finish_reasons=report.finish_reasons,
        usage_source=_usage_source(usage, report.stream, outcome),
        state=settlement.state,
        reconciliation_reason=settlement.reconciliation_reason,
        latency_ms=round((now - attempt.started) * 1000, 3),
    )
    return final, settlement.holds_reservation


def candidate_count(value: Any) -> int | None:
    """The body's ``n`` when it is one the reference allows, else None (not recorded)."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 128:
        return value
    return None


def usage_complete(usage: SummaryUsage | None) -> bool:
    return (
        usage is not None
        and usage.prompt_tokens is not None
        and (usage.completion_tokens is not None)
    )


def _usage_fields(usage: SummaryUsage | None, pricing: Pricing) -> dict[str, Any]:
    if usage is None or usage.prompt_tokens is None or usage.completion_tokens is None:
        return {}
    details = usage.prompt_tokens_details
    cached = (details and details.cached_tokens) or 0
    written = (details and details.cache_write_tokens) or 0
    reasoning = usage.completion_tokens_details and usage.completion_tokens_details.reasoning_tokens
    cost = cost_micros(usage.prompt_tokens, cached, usage.completion_tokens, pricing, written)
    return {
        "input_tokens": usage.prompt_tokens,
        "cached_input_tokens": cached,
        "output_tokens_total": usage.completion_tokens,
        "reasoning_tokens": reasoning,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "cost_micros": cost,
    }


def _per_choice(attempt: Attempt, report: AttemptReport) -> tuple[int, ...] | None:
    """Each choice's output tokens where the route revealed them: the provider's own
    counts when they add up to its total, or an emulated branch's (one choice, its own
    usage). Never split from a total (None then)."""
    total = report.usage.completion_tokens if report.usage else None
    if total is None:
        return None
    counts = report.choice_tokens
    if counts is not None and len(counts) == report.returned and sum(counts) == total:
        return counts
    if attempt.plan.emulated and report.returned == 1:
        return (total,)
    return None


def _evidence_columns(evidence: Evidence) -> dict[str, int]:
    return {
        "candidates_compared": evidence.compared,
        "candidates_distinct": evidence.distinct,
        "candidates_majority": evidence.majority,
        "candidates_tool_calls": evidence.tool_calls,
    }


def _usage_source(usage: SummaryUsage | None, stream: bool, outcome: AttemptOutcome) -> Any:
    if outcome == "unbilled_error":
        return "provider_response"  # the zero comes from the provider's error answer
    if usage is None:
        return "none"
    return "provider_stream" if stream else "provider_response"


def denied_columns(refusal: Refusal | None, plan: Plan) -> dict[str, Any]:
    """``denied_by``/``denied_limit``/``denied_amount`` of a denial row. A fan-out is
    reserved branch by branch: the branch that did not fit stands for the whole
    request's need, which is what is recorded. The amount can be the client's own number
    (an ``output_ceiling`` refusal records the ``max_tokens`` asked, which JSON does not
    bound): past what a ledger column holds it is recorded as ``LEDGER_INT_MAX``."""
    if refusal is None:
        return {}
    amount = refusal.amount
    if plan.emulated and amount is not None:
        amount = _whole_need(refusal.limit, plan.reservation, plan.decision.effective)
    if amount is not None:
        amount = min(amount, LEDGER_INT_MAX)
    return {"denied_by": refusal.limit, "denied_limit": refusal.value, "denied_amount": amount}


def _whole_need(window: str, whole: Reservation, branches: int) -> int:
    if window.startswith("tokens_"):
        return whole.total_tokens
    if window.startswith("usd_") or window == "exception":
        return whole.cost_micros
    return branches  # requests_minute, concurrency: one per branch


_NOTHING_USED: dict[str, Any] = {
    "input_tokens": 0,
    "output_tokens_total": 0,
    "total_tokens": 0,
    "cost_micros": 0,
    "cached_input_tokens": 0,
}
