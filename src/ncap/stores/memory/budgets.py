"""In-process budgets: the embedded default, ``quota_scope=instance``.

Counters live in this process only, one live bucket per (subject, window); a bucket
that rolls over is dropped, so memory stays bounded. Admission is atomic because the
check and the update run under one lock with no ``await`` between them.

THE LEDGER IS THE SOURCE OF TRUTH, THE COUNTERS A CACHE OF IT. Built with a
``history`` (the ledger), ``recover_lost`` (called once at start-up, after the ledger
turned a dead predecessor's ``reserved`` rows into ``gateway_lost`` ones) replays what
can still weigh on a window: unsettled rows become *kept* holds whose reserved
amounts stay counted (their slot freed); settled and reconciled spend, summed per
minute by the ledger (this month's, and every exception's), is added to its own
buckets. A restart or a ``kill -9`` therefore loses no hold and forgets no spend:
every attempt was in the ledger before it was dispatched (``append`` is durable when
it returns). Without a history (tests,
``memory://`` ledgers) nothing survives the process.

A row is bucketed by its own timestamp, taken a few microseconds after the
reservation's: at a minute boundary a rebuilt row may land in the next minute. An
attempt the upstream refused (its hold was released; its row is settled with
``usage_source=none``) counts nothing, as it did live.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from msgspec.structs import replace

from ncap.config import utcnow
from ncap.domain.budget import Amounts, Buckets, Usage
from ncap.domain.events import LedgerEvent
from ncap.stores._common import (
    LIFE_BUCKET,
    Charge,
    Entry,
    TwoPhaseBudgets,
    check_actuals,
    hold_entries,
    hold_ref,
    minute_entries,
    new_hold,
    release_entries,
    settle_entries,
)
from ncap.stores.ports import BudgetHistory, Hold, Settle, hold_id_for

__all__ = ["MemoryBudgetStore"]


class MemoryBudgetStore(TwoPhaseBudgets):
    """``BudgetStore`` in a dict; also the fake the lifecycle tests use."""

    quota_scope = "instance"
    round_trip = False

    def __init__(
        self,
        *,
        gateway_instance: str = "local",
        clock: Callable[[], datetime] = utcnow,
        history: BudgetHistory | None = None,
    ) -> None:
        self._instance = gateway_instance
        self._clock = clock
        self._history = history
        self._rebuilt = False
        self._lock = threading.Lock()
        # (subject, window) -> (live bucket, amount)
        self._counters: dict[tuple[str, str], tuple[str, int]] = {}
        self._holds: dict[str, Hold] = {}
        self._active: dict[str, int] = {}  # workload -> active holds (kept ones excluded)

    async def _reserve(self, charge: Charge) -> Hold:
        with self._lock:
            usage = self._usage(charge.workload_id, charge.exception_id, charge.buckets)
            exists = charge.hold_id is not None and charge.hold_id in self._holds
            hold, entries = charge.admit(usage, exists, self._instance)
            self._add(entries, create=True)
            self._holds[hold.hold_id] = hold
            self._count(hold, +1)
        return hold

    async def settle(self, hold: Hold | str, actual_tokens: int, actual_cost_micros: int) -> bool:
        check_actuals(actual_tokens, actual_cost_micros)
        with self._lock:
            held = self._holds.pop(hold_ref(hold), None)
            if held is None:
                return False
            self._count(held, -1)
            self._add(settle_entries(held, actual_tokens, actual_cost_micros), create=False)
        return True

    async def settle_many(self, settles: Sequence[Settle]) -> None:
        for _, actual_tokens, actual_cost_micros in settles:
            check_actuals(actual_tokens, actual_cost_micros)
        with self._lock:
            for hold, actual_tokens, actual_cost_micros in settles:
                held = self._holds.pop(hold_ref(hold), None)
                if held is not None:
                    self._count(held, -1)
                    entries = settle_entries(held, actual_tokens, actual_cost_micros)
                    self._add(entries, create=False)

    async def keep(self, hold: Hold | str) -> bool:
        with self._lock:
            held = self._holds.get(hold_ref(hold))
            if held is None or held.state == "kept":
                return False
            self._count(held, -1)
            self._holds[held.hold_id] = replace(held, state="kept")
        return True

    async def release(self, hold: Hold | str) -> bool:
        with self._lock:
            held = self._holds.pop(hold_ref(hold), None)
            if held is None:
                return False
            self._count(held, -1)
            self._add(release_entries(held), create=False)
        return True

    async def outstanding(self, workload_id: str | None = None) -> list[Hold]:
        with self._lock:
            holds = list(self._holds.values())
        return [h for h in holds if workload_id is None or h.workload_id == workload_id]

    async def usage(
        self, workload_id: str, *, exception_id: str | None = None, now: datetime | None = None
    ) -> Usage:
        with self._lock:
            return self._usage(workload_id, exception_id, Buckets.at(now or self._clock()))

    async def recover_lost(self, gateway_instance: str | None = None) -> int:
        """Rebuild the counters from the ledger (once, at start-up); returns how many
        unsettled attempts are held again. Without a history: nothing to recover."""
        if self._history is None or self._rebuilt:
            return 0
        self._rebuilt = True
        month_start = (
            self._clock().astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        )
        async for total in self._history.spent_totals(month_start):
            entries = minute_entries(
                total.workload_id,
                total.exception_id,
                total.minute,
                total.tokens,
                total.cost_micros,
                total.requests,
            )
            with self._lock:
                self._add_replayed(entries)
        held = 0
        async for event in self._history.held_rows():
            with self._lock:
                held += self._hold_again(event)
        return held

    async def close(self) -> None:
        return None

    def _hold_again(self, event: LedgerEvent) -> int:
        """Count an unsettled row's reservation again, as a kept hold; 1 if new."""
        hold_id = hold_id_for(event.request_id, event.attempt)
        if hold_id in self._holds:
            return 0
        tokens = event.reserved_input_tokens + event.reserved_output_tokens
        hold = new_hold(
            event.workload_id,
            event.exception_id,
            Amounts(tokens, event.reserved_cost_micros),
            Buckets.at(event.timestamp),
            event.gateway_instance,
            hold_id,
        )
        self._holds[hold_id] = replace(hold, state="kept")
        self._add_replayed(hold_entries(hold, hold.tokens, hold.cost_micros, 1))
        return 1

    def _count(self, hold: Hold, delta: int) -> None:
        """Track active holds per workload, so admission does not scan every hold."""
        if hold.state == "active":
            self._active[hold.workload_id] = self._active.get(hold.workload_id, 0) + delta

    def _usage(self, workload_id: str, exception_id: str | None, buckets: Buckets) -> Usage:
        """The live counters (``usage_keys``' windows), read in place: one lookup each,
        no key map built per admission."""
        counters, minute, day = self._counters, buckets.minute, buckets.day
        exception = 0
        if exception_id is not None:
            exception = _live(counters.get((exception_id, "cost_exception")), LIFE_BUCKET)
        return Usage(
            _live(counters.get((workload_id, "tokens_minute")), minute),
            _live(counters.get((workload_id, "requests_minute")), minute),
            _live(counters.get((workload_id, "tokens_day")), day),
            _live(counters.get((workload_id, "cost_day")), day),
            _live(counters.get((workload_id, "cost_month")), buckets.month),
            exception,
            self._active.get(workload_id, 0),
        )

    def _add(self, entries: list[Entry], *, create: bool) -> None:
        """Add to the live buckets; a new bucket replaces an old one only when ``create``
        (a settlement for a bucket that already rolled over changes nothing)."""
        for subject, window, bucket, amount in entries:
            live, current = self._counters.get((subject, window), (bucket, 0))
            if live == bucket:
                self._counters[(subject, window)] = (bucket, current + amount)
            elif create:
                self._counters[(subject, window)] = (bucket, amount)

    def _add_replayed(self, entries: list[Entry]) -> None:
        """Like ``_add``, whatever order the rows come in: a newer bucket replaces the
        live one, an older one is already over and changes nothing."""
        for subject, window, bucket, amount in entries:
            live, current = self._counters.get((subject, window), (bucket, 0))
            if live == bucket:
                self._counters[(subject, window)] = (bucket, current + amount)
            elif bucket > live:
                self._counters[(subject, window)] = (bucket, amount)


def _live(counter: tuple[str, int] | None, bucket: str) -> int:
    """A counter's amount when it is in ``bucket`` (an older bucket is over: 0)."""
    return counter[1] if counter is not None and counter[0] == bucket else 0
