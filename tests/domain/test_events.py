"""The ledger event's columns (docs/ledger.md), settlement states and reconciliation."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest
from msgspec import structs

from ncap.config import Pricing
from ncap.domain.events import (
    LEDGER_COLUMNS,
    AttemptOutcome,
    LedgerEvent,
    ReconciliationRow,
    reconcile,
    settle,
)

SPEC_COLUMNS = [
    "timestamp",
    "request_id",
    "attempt",
    "workload_id",
    "environment",
    "route_id",
    "model_alias",
    "upstream_model",
    "provider_request_id",
    "requested_candidate_count",
    "effective_candidate_count",
    "returned_candidate_count",
    "exception_id",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens_total",
    "reasoning_tokens",
    "total_tokens",
    "reserved_input_tokens",
    "reserved_output_tokens",
    "reserved_cost_micros",
    "cost_micros",
    "finish_reasons",
    "stream_mode",
    "usage_source",
    "quota_scope",
    "policy_result",
    "policy_reason",
    "state",
    "reconciliation_reason",
    "gateway_instance",
    "latency_ms",
]

NOW = datetime(2026, 11, 29, tzinfo=UTC)


# ncap's own columns, after the spec's (what refused a denied request, a failure's
# status, each choice's output tokens where the route reveals them, how different the
# candidates were)
EXTENSION_COLUMNS = [
    "denied_by",
    "denied_limit",
    "denied_amount",
    "upstream_status",
    "client_retry_count",
    "output_tokens_per_choice",
    "candidates_compared",
    "candidates_distinct",
    "candidates_majority",
    "candidates_tool_calls",
]


def test_columns_are_the_specs_in_its_order_then_the_extensions() -> None:
    assert list(LEDGER_COLUMNS) == SPEC_COLUMNS + EXTENSION_COLUMNS


def test_unknown_usage_is_none_not_zero() -> None:
    e = LedgerEvent(timestamp=NOW, request_id="r", attempt=0, workload_id="w", environment="p")
    assert e.input_tokens is None and e.output_tokens_total is None and e.cost_micros is None
    assert e.requested_candidate_count is None and e.state == "reserved"


SETTLE_TABLE: list[tuple[AttemptOutcome, bool, int | None, bool, str, str | None]] = [
    # outcome, stream, returned, usage -> state, reason   (effective n = 2 throughout)
    ("completed", False, 2, True, "settled", None),
    ("completed", False, 1, True, "usage_reconciliation_required", "returned_mismatch"),
    ("completed", False, 3, True, "usage_reconciliation_required", "returned_mismatch"),
    ("completed", False, 2, False, "usage_reconciliation_required", "usage_missing"),
    ("completed", True, 2, True, "settled", None),
    ("completed", True, 2, False, "pending", "usage_missing"),
    ("completed", True, 1, True, "usage_reconciliation_required", "returned_mismatch"),
    ("stream_cut", True, 2, False, "pending", "stream_cut"),
    ("stream_cut", True, 1, False, "pending", "stream_cut"),
    ("stream_cut", True, 2, True, "settled", None),  # the usage chunk is the last one
    ("timeout", False, None, False, "usage_reconciliation_required", "timeout"),
    ("timeout", True, None, False, "pending", "timeout"),
    ("connection_error", False, None, False, "usage_reconciliation_required", "connection_error"),
    (
        "upstream_error",
        False,
        None,
        False,
        "usage_reconciliation_required",
        "upstream_error_after_dispatch",
    ),
    ("upstream_error", True, 1, False, "pending", "upstream_error_after_dispatch"),
    ("timeout", False, 2, True, "usage_reconciliation_required", "timeout"),
    ("gateway_lost", False, None, False, "usage_reconciliation_required", "gateway_lost"),
    ("gateway_lost", True, None, False, "usage_reconciliation_required", "gateway_lost"),
    ("rejected", False, 0, False, "settled", None),  # a 4xx refusal generated nothing
    ("unbilled_error", False, 0, False, "settled", None),  # the contract: nothing generated
    ("unbilled_error", True, 0, False, "settled", None),  # an error answer to a stream request
    # the provider cancelled its own work at the timeout and counted it: settled at that
    ("cancelled", False, 0, True, "settled", None),
    ("cancelled", True, 0, True, "settled", None),
    ("cancelled", False, 0, False, "usage_reconciliation_required", "usage_missing"),
]


@pytest.mark.parametrize(
    ("outcome", "stream", "returned", "usage", "state", "reason"), SETTLE_TABLE
)
def test_settle(
    outcome: AttemptOutcome,
    stream: bool,
    returned: int | None,
    usage: bool,
    state: str,
    reason: str | None,
) -> None:
    s = settle(
        effective_n=2, returned_n=returned, usage_present=usage, stream=stream, outcome=outcome
    )
    assert (s.state, s.reconciliation_reason) == (state, reason)
    assert s.holds_reservation is (state in ("pending", "usage_reconciliation_required"))


PRICING = Pricing(input_per_mtok=0.15, cached_input_per_mtok=0.075, output_per_mtok=0.60)
PENDING = LedgerEvent(
    timestamp=NOW,
    request_id="r1",
    attempt=0,
    workload_id="w",
    environment="p",
    route_id="primary-chat",
    provider_request_id="chatcmpl-1",
    state="pending",
    reconciliation_reason="stream_cut",
)
ROW = ReconciliationRow("chatcmpl-1", input_tokens=1000, output_tokens=500, cached_input_tokens=400)


def test_reconcile_moves_pending_to_reconciled_with_usage_and_cost() -> None:
    outcome, e = reconcile(PENDING, ROW, PRICING)
    assert outcome == "reconciled"
    assert (e.state, e.usage_source, e.reconciliation_reason) == (
        "reconciled",
        "reconciliation_import",
        "stream_cut",
    )
    assert (e.input_tokens, e.cached_input_tokens, e.output_tokens_total, e.total_tokens) == (
        1000,
        400,
        500,
        1500,
    )
    assert e.cost_micros == 90 + 30 + 300


@pytest.mark.parametrize(
    ("event", "row", "pricing", "outcome"),
    [
        (PENDING, replace(ROW, cost_micros=7), None, "reconciled"),
        (PENDING, ROW, None, "unpriced"),
        (structs.replace(PENDING, state="settled"), ROW, PRICING, "not_pending"),
        (structs.replace(PENDING, state="denied"), ROW, PRICING, "not_pending"),
        (structs.replace(PENDING, state="reserved"), ROW, PRICING, "not_pending"),
    ],
)
def test_reconcile_outcomes(
    event: LedgerEvent, row: ReconciliationRow, pricing: Pricing | None, outcome: str
) -> None:
    assert reconcile(event, row, pricing)[0] == outcome


def test_reconcile_is_idempotent() -> None:
    _, done = reconcile(PENDING, ROW, PRICING)
    assert reconcile(done, ROW, PRICING) == ("unchanged", done)
    other = replace(ROW, output_tokens=501)
    assert reconcile(done, other, PRICING) == ("conflict", done)
