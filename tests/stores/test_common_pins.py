"""Pins found by mutation testing (docs/mutation.md) on the helpers every ledger
backend without SQL shares (``stores/_common.py``): spend totals by minute, lost
reservations, and which row a provider id reconciles. Pure and socket-free."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta, timezone

import pytest
from msgspec.structs import replace

from ncap.domain.events import LedgerEvent, ReconciliationRow
from ncap.stores._common import _target, apply_import, is_lost, spent_totals
from ncap.stores.memory.budgets import MemoryBudgetStore
from ncap.stores.ports import SpentTotal

SINCE = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
BASE = LedgerEvent(
    timestamp=SINCE + timedelta(seconds=5), request_id="r", attempt=1, workload_id="w",
    environment="p", state="settled", usage_source="provider_response", total_tokens=10,
    cost_micros=100,
)  # fmt: skip


def _row(**changes: object) -> LedgerEvent:
    return replace(BASE, **changes)  # type: ignore[arg-type]


def test_spent_totals_sum_each_minute_of_settled_and_reconciled_rows() -> None:
    rows = [
        _row(),
        _row(attempt=2, state="reconciled", total_tokens=7, cost_micros=None),
        _row(attempt=3, timestamp=SINCE),  # exactly at ``since``: counted
        _row(attempt=4, state="pending"),  # held, not spent
        _row(attempt=5, usage_source="none"),  # settled without usage: nothing spent
        _row(attempt=6, policy_result="deny"),
        _row(attempt=7, timestamp=SINCE - timedelta(seconds=1)),  # before the window
        _row(attempt=8, timestamp=SINCE - timedelta(days=40), exception_id="x1"),
    ]
    assert sorted(spent_totals(rows, SINCE), key=lambda t: t.minute) == [
        SpentTotal("w", "x1", "2026-10-22T10:00", 10, 100, 1),  # an exception's whole life
        SpentTotal("w", None, "2026-12-01T10:00", 27, 200, 3),  # 10 + 7 + 10; 100 + 0 + 100
    ]


def test_is_lost_only_for_reserved_rows_strictly_before() -> None:
    reserved = _row(state="reserved", gateway_instance="g1")
    assert is_lost(reserved, None, None)
    assert is_lost(reserved, "g1", reserved.timestamp + timedelta(microseconds=1))
    assert not is_lost(reserved, "g1", reserved.timestamp)  # not older than ``before``
    assert not is_lost(reserved, "g2", None)
    assert not is_lost(_row(state="pending"), None, None)


def test_the_row_a_provider_id_reconciles() -> None:
    pending = _row(state="pending")
    reconciled = _row(attempt=2, state="reconciled")
    settled = _row(attempt=3)
    assert _target([settled, pending]) is pending
    assert _target([settled, reconciled]) is reconciled
    assert _target([pending, replace(pending, attempt=4)]) is None  # ambiguous
    assert _target([reconciled, replace(reconciled, attempt=4)]) is None
    assert _target([settled]) is settled
    assert _target([]) is None


class _History:
    """A ledger history that records what it was asked and yields given rows."""

    def __init__(self, held: list[LedgerEvent]) -> None:
        self.held = held
        self.since: list[datetime] = []

    async def held_rows(self) -> AsyncIterator[LedgerEvent]:
        for event in self.held:
            yield event

    async def spent_totals(self, since: datetime) -> AsyncIterator[SpentTotal]:
        self.since.append(since)
        for total in ():
            yield total


@pytest.fixture
def tokyo_local_time() -> Iterator[None]:
    """The process's local zone is not UTC (the month start must not depend on it)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    yield
    mp.undo()
    time.tzset()


async def test_recovery_reads_spend_from_the_utc_month_start_and_counts_new_holds(
    tokyo_local_time: None,
) -> None:
    """The clock is in another zone, and so is the process: the month starts at
    00:00:00.000000 UTC on the 1st (in Tokyo it is already December)."""
    clock = datetime(2026, 11, 30, 15, 30, 12, 5, tzinfo=timezone(timedelta(hours=-5)))
    held = _row(state="pending", reserved_input_tokens=4, reserved_output_tokens=6)
    history = _History([held, held])  # the same row twice: held again once
    store = MemoryBudgetStore(clock=lambda: clock, history=history)
    assert await store.recover_lost() == 1
    assert history.since == [datetime(2026, 11, 1, tzinfo=UTC)]
    assert await store.recover_lost() == 0  # once, at start-up
    assert history.since == [datetime(2026, 11, 1, tzinfo=UTC)]


def test_an_unmatched_row_does_not_stop_the_import() -> None:
    pending = _row(state="pending", provider_request_id="p-2", route_id="r")
    written: list[LedgerEvent] = []
    rows = [
        ReconciliationRow("p-1", 3, 4, cost_micros=9),  # no ledger row
        ReconciliationRow("p-2", 3, 4, cost_micros=9),
        ReconciliationRow("p-3", 1, 1, cost_micros=1),  # no ledger row either
    ]
    result = apply_import(rows, lambda pid: [pending] if pid == "p-2" else [], written.append, None)
    assert result.unmatched == ["p-1", "p-3"]
    assert [(e.provider_request_id, e.state) for e in result.reconciled] == [("p-2", "reconciled")]
    assert written == result.reconciled
