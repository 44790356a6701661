"""The ledger event (one row per attempt, docs/ledger.md) and how an attempt settles.

An event is sanitized by construction: it has no field that could hold prompt or
completion text, headers, tool arguments or end-user identifiers. Token and cost
fields are None while unknown — a missing usage is never recorded as zero.

States of an attempt, and who moves it:

=============================== ============================================ ===========
state                           meaning                                      reservation
=============================== ============================================ ===========
reserved                        written before dispatch; outcome unknown     held, slot
settled                         provider usage recorded, choices == n        replaced
pending                         a stream ended or was cut without usage      held
usage_reconciliation_required   usage missing/ambiguous, or choices != n     held
reconciled                      usage imported from the provider's export    replaced
denied                          refused by policy before dispatch            none
=============================== ============================================ ===========

``reserved`` rows left by a crashed gateway become ``usage_reconciliation_required``
with reason ``gateway_lost`` at the next start (``LedgerStore.mark_lost``).
``settle()`` below decides the state of a finished attempt; ``reconcile()`` applies
one row of a provider usage export to a pending event.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import msgspec
from msgspec.structs import replace

from ncap.config import Pricing
from ncap.domain.money import cost_micros

__all__ = [
    "LEDGER_COLUMNS",
    "LEDGER_INT_MAX",
    "UNSETTLED_STATES",
    "AttemptOutcome",
    "EventState",
    "LedgerEvent",
    "ReconcileOutcome",
    "ReconciliationRow",
    "Settlement",
    "UsageSource",
    "reconcile",
    "settle",
]

# the largest integer a ledger column holds (SQLite INTEGER, PostgreSQL BIGINT)
LEDGER_INT_MAX = 2**63 - 1

EventState = Literal[
    "reserved", "settled", "pending", "usage_reconciliation_required", "reconciled", "denied"
]
UsageSource = Literal["provider_response", "provider_stream", "reconciliation_import", "none"]
AttemptOutcome = Literal[
    "completed",  # the upstream answered 2xx and the response (or stream) ended normally
    "stream_cut",  # a stream stopped early: client disconnect or upstream error mid-stream
    "rejected",  # the upstream refused with a 4xx before generating anything: not billed
    "timeout",  # no answer in time: the provider may still have generated and billed
    # no answer in time from a provider that then stopped the work itself and counted
    # what it had used (the local engine cancels its sequences): settled at that usage
    "cancelled",
    "connection_error",  # the connection failed after the request was sent
    "upstream_error",  # 5xx or an unreadable body after dispatch: billing unknown
    # a well-formed error answer (5xx with an error envelope) from a route whose contract
    # says such answers are unbilled (``error_responses: unbilled``): settled at zero
    "unbilled_error",
    "gateway_lost",  # the gateway died with the attempt in flight
]
UNSETTLED_STATES: tuple[EventState, ...] = ("pending", "usage_reconciliation_required")


class LedgerEvent(msgspec.Struct, frozen=True, gc=False):
    """One attempt: the ledger's columns in docs/ledger.md's order, then ncap's own
    (``denied_*``, ``upstream_status``, ``client_retry_count``, ``output_tokens_per_choice``,
    the ``candidates_*`` evidence)."""

    timestamp: datetime
    request_id: str
    attempt: int
    workload_id: str
    environment: str
    route_id: str | None = None
    model_alias: str | None = None
    upstream_model: str | None = None
    provider_request_id: str | None = None
    requested_candidate_count: int | None = None
    effective_candidate_count: int = 1
    returned_candidate_count: int | None = None
    exception_id: str | None = None
    input_tokens: int | None = None
    cached_input_tokens: int | None = None
    output_tokens_total: int | None = None
    reasoning_tokens: int | None = None
    total_tokens: int | None = None
    reserved_input_tokens: int = 0
    reserved_output_tokens: int = 0
    reserved_cost_micros: int = 0
    cost_micros: int | None = None
    finish_reasons: dict[str, int] = msgspec.field(default_factory=dict)
    stream_mode: bool = False
    usage_source: UsageSource = "none"
    quota_scope: str = "instance"
    policy_result: Literal["allow", "deny"] = "allow"
    policy_reason: str = "within_default"
    state: EventState = "reserved"
    reconciliation_reason: str | None = None
    gateway_instance: str = ""
    latency_ms: float | None = None
    # extensions after the ledger's standard columns: what refused a denied request (null
    # otherwise): the limit's name (a budget window, max_candidates, output_ceiling, a field), its
    # value, and what the request needed of it, in the limit's unit
    denied_by: str | None = None
    denied_limit: int | None = None
    denied_amount: int | None = None
    # the HTTP status a failed attempt's upstream answered with (null: it answered, or
    # sent no status: a timeout, a reset, a cut stream)
    upstream_status: int | None = None
    # the client's own retry number for this try (the official SDKs send it as
    # ``x-stainless-retry-count``; null when absent): a client retry is a row of its own
    client_retry_count: int | None = None
    # each choice's output tokens in index order, where the route reveals them (the
    # local engine; an emulated branch's own usage); None where only the total is known
    output_tokens_per_choice: tuple[int, ...] | None = None
    # how different the request's candidates were (``ncap.domain.evidence``), on the
    # row of the attempt that returned them (an emulated fan-out: its first branch's),
    # when it returned two or more and ended normally: how many were compared, how
    # many distinct, the largest group of identical ones, how many called a tool
    candidates_compared: int | None = None
    candidates_distinct: int | None = None
    candidates_majority: int | None = None
    candidates_tool_calls: int | None = None


LEDGER_COLUMNS: tuple[str, ...] = LedgerEvent.__struct_fields__


@dataclass(frozen=True, slots=True)
class Settlement:
    """The final state of an attempt and what happens to its budget hold."""

    state: EventState
    reconciliation_reason: str | None

    @property
    def holds_reservation(self) -> bool:
        """True: ``BudgetStore.keep`` (held until reconciled); False: ``settle``."""
        return self.state in UNSETTLED_STATES


# the fixed outcomes, built once (a frozen value is shared safely)
_SETTLED = Settlement("settled", None)
_MISMATCH = Settlement("usage_reconciliation_required", "returned_mismatch")

_FAILURE_REASONS: dict[AttemptOutcome, str] = {
    "stream_cut": "stream_cut",
    "timeout": "timeout",
    "connection_error": "connection_error",
    "upstream_error": "upstream_error_after_dispatch",
    "gateway_lost": "gateway_lost",
}


def settle(
    *,
    effective_n: int,
    returned_n: int | None,
    usage_present: bool,
    stream: bool,
    outcome: AttemptOutcome = "completed",
) -> Settlement:
    """Decide the state of a dispatched attempt.

    Settled only with usage *and* exactly the effective number of choices. A stream
    without usage stays ``pending`` (held, not zero); any other doubt is
    ``usage_reconciliation_required``. A 4xx refusal, and an error answer the route's
    contract calls unbilled, settle at zero: nothing ran. An attempt the provider
    cancelled at its timeout settles at the usage it counted up to the cancel.
    """
    if outcome in ("rejected", "unbilled_error"):
        return _SETTLED
    if outcome == "cancelled" and usage_present:
        return _SETTLED
    usage_usable = usage_present and outcome in ("completed", "stream_cut")
    if usage_usable and returned_n == effective_n:
        return _SETTLED
    if usage_usable:
        return _MISMATCH
    reason = _FAILURE_REASONS.get(outcome, "usage_missing")
    if stream and outcome != "gateway_lost":
        return Settlement("pending", reason)
    return Settlement("usage_reconciliation_required", reason)


@dataclass(frozen=True, slots=True)
class ReconciliationRow:
    """One line of a provider usage export, keyed by the provider's request id, or
    (``provider_request_id`` empty) by the id ncap sent with the attempt
    (``X-Client-Request-Id``: ``<ncap request id>#<attempt>``)."""

    provider_request_id: str
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int = 0
    reasoning_tokens: int | None = None
    cost_micros: int | None = None  # the provider's own figure wins over route prices
    client_request_id: str | None = None


ReconcileOutcome = Literal["reconciled", "unchanged", "conflict", "not_pending", "unpriced"]


def reconcile(
    event: LedgerEvent, row: ReconciliationRow, pricing: Pricing | None
) -> tuple[ReconcileOutcome, LedgerEvent]:
    """Apply ``row`` to ``event``; idempotent: a reconciled event is never rewritten."""
    if event.state == "reconciled":
        same = event.input_tokens == row.input_tokens and event.output_tokens_total == (
            row.output_tokens
        )
        return ("unchanged" if same else "conflict"), event
    if event.state not in UNSETTLED_STATES:
        return "not_pending", event
    cost = _row_cost(row, pricing)
    if cost is None:
        return "unpriced", event
    return "reconciled", replace(
        event,
        input_tokens=row.input_tokens,
        cached_input_tokens=row.cached_input_tokens,
        output_tokens_total=row.output_tokens,
        reasoning_tokens=row.reasoning_tokens,
        total_tokens=row.input_tokens + row.output_tokens,
        cost_micros=cost,
        usage_source="reconciliation_import",
        state="reconciled",
    )


def _row_cost(row: ReconciliationRow, pricing: Pricing | None) -> int | None:
    if row.cost_micros is not None:
        return row.cost_micros
    if pricing is None:
        return None
    return cost_micros(row.input_tokens, row.cached_input_tokens, row.output_tokens, pricing)
