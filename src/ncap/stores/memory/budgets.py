"""In-process budgets: the embedded default, ``quota_scope=instance``.

Counters live in this process only: per workload one row of its live buckets (the
minute, the day, the month) and their amounts, per exception its life-long spend; a
bucket that rolls over is replaced, so memory stays bounded. Admission is atomic because the
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

A row is bucketed by its own timestamp. The holds taken at admission and the first
attempt's row share the admission's instant; a retry's row is stamped a few
microseconds after its reservation, so at a minute boundary its rebuilt amounts may
land in the next minute. An
attempt the upstream refused (its hold was released; its row is settled with
``usage_source=none``) counts nothing, as it did live.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from uuid import uuid4

from msgspec.structs import replace

from ncap.config import utcnow
from ncap.domain.budget import Amounts, Buckets, BudgetWindows, Usage, admit
from ncap.domain.events import LedgerEvent
from ncap.stores._common import (
    Held,
    check_actuals,
    hold_ref,
    new_hold,
)
from ncap.stores.ports import BudgetHistory, Hold, Settle, hold_id_for

__all__ = ["MemoryBudgetStore"]


class MemoryBudgetStore:
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
        # workload -> its live buckets; exception -> its spend (a life-long budget)
        self._live: dict[str, _LiveBuckets] = {}
        self._exceptions: dict[str, int] = {}
        self._holds: dict[str, Hold] = {}
        self._active: dict[str, int] = {}  # workload -> active holds (kept ones excluded)

    async def reserve(
        self,
        workload_id: str,
        windows: BudgetWindows,
        amounts: Amounts,
        *,
        exception_id: str | None = None,
        now: datetime | None = None,
        hold_id: str | None = None,
    ) -> Hold:
        """Admit and hold in one critical section (no ``await`` inside). Written out
        here rather than through the shared ``Charge`` of the stores that wait
        (``TwoPhaseBudgets``): it runs on every request and never waits, so each call
        it saves is a share of the request."""
        buckets = Buckets.at(now or self._clock())
        tokens, cost = amounts.tokens, amounts.cost_micros
        with self._lock:
            if hold_id is not None and hold_id in self._holds:
                raise ValueError(f"hold {hold_id!r} already exists")
            limit = windows.max_concurrency
            if not (
                windows.counts_nothing
                and (limit is None or self._active.get(workload_id, 0) < limit)
            ):  # else ``admit`` has nothing to refuse: only the in-flight count is limited
                admit(
                    workload_id,
                    exception_id,
                    self._usage(workload_id, exception_id, buckets),
                    windows,
                    amounts,
                    buckets,
                )
            hold = Hold(
                hold_id or uuid4().hex,
                workload_id,
                exception_id,
                tokens,
                cost,
                buckets.minute,
                buckets.day,
                buckets.month,
                self._instance,
                buckets.now,
            )
            self._add(hold, tokens, cost, 1, _CREATE)
            self._holds[hold.hold_id] = hold
            active = self._active
            active[workload_id] = active.get(workload_id, 0) + 1
        return hold

    async def settle(self, hold: Hold | str, actual_tokens: int, actual_cost_micros: int) -> bool:
        check_actuals(actual_tokens, actual_cost_micros)
        with self._lock:
            held = self._holds.pop(hold_ref(hold), None)
            if held is None:
                return False
            self._settled(held, actual_tokens, actual_cost_micros)
        return True

    async def settle_many(self, settles: Sequence[Settle]) -> None:
        for _, actual_tokens, actual_cost_micros in settles:
            check_actuals(actual_tokens, actual_cost_micros)
        holds = self._holds
        with self._lock:
            for hold, actual_tokens, actual_cost_micros in settles:
                held = holds.pop(hold_ref(hold), None)
                if held is not None:
                    self._settled(held, actual_tokens, actual_cost_micros)

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
            self._add(held, -held.tokens, -held.cost_micros, -1, _ROLLED_OVER_STAYS)
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
            with self._lock:
                self._add(total, total.tokens, total.cost_micros, total.requests, _REPLAYED)
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
        self._add(hold, hold.tokens, hold.cost_micros, 1, _REPLAYED)
        return 1

    def _count(self, hold: Hold, delta: int) -> None:
        """Track active holds per workload, so admission does not scan every hold."""
        if hold.state == "active":
            self._active[hold.workload_id] = self._active.get(hold.workload_id, 0) + delta

    def _settled(self, held: Hold, actual_tokens: int, actual_cost_micros: int) -> None:
        """A hold's reservation replaced by its actual usage (the hold already taken out)."""
        self._count(held, -1)
        tokens, cost = actual_tokens - held.tokens, actual_cost_micros - held.cost_micros
        self._add(held, tokens, cost, 0, _ROLLED_OVER_STAYS)

    def _usage(self, workload_id: str, exception_id: str | None, buckets: Buckets) -> Usage:
        """The live counters (``usage_keys``' windows), read in place from the workload's
        row: a window whose bucket is not the current one is over (0)."""
        exception = self._exceptions.get(exception_id, 0) if exception_id is not None else 0
        live = self._live.get(workload_id)
        if live is None:
            return Usage(0, 0, 0, 0, 0, exception, self._active.get(workload_id, 0))
        minute = live.minute == buckets.minute
        day = live.day == buckets.day
        return Usage(
            live.tokens_minute if minute else 0,
            live.requests_minute if minute else 0,
            live.tokens_day if day else 0,
            live.cost_day if day else 0,
            live.cost_month if live.month == buckets.month else 0,
            exception,
            self._active.get(workload_id, 0),
        )

    def _add(self, spent: Held, tokens: int, cost: int, requests: int, mode: int) -> None:
        """Add one minute's amounts (a hold's, a settlement's delta, a replayed total)
        to the workload's live buckets and to its exception's budget, window by window:
        in the same bucket it adds; a different bucket replaces the live one only for a
        new reservation (``_CREATE``: the window rolled over) or a newer replayed one
        (``_REPLAYED``, whatever order the rows come in); otherwise (a settlement or a
        release of a bucket that rolled over since) that window changes nothing."""
        if spent.exception_id is not None:  # an exception's budget spans its whole life
            exceptions = self._exceptions
            exceptions[spent.exception_id] = exceptions.get(spent.exception_id, 0) + cost
        live = self._live.get(spent.workload_id)
        if live is None:
            live = self._live[spent.workload_id] = _LiveBuckets()
        minute = spent.minute
        if live.minute == minute:
            live.tokens_minute += tokens
            live.requests_minute += requests
            # the live minute's day and month are live too (every window moves with the
            # minute that set it): the common case ends here
            live.tokens_day += tokens
            live.cost_day += cost
            live.cost_month += cost
            return
        if _replaces(live.minute, minute, mode):
            live.minute, live.tokens_minute, live.requests_minute = minute, tokens, requests
        day = minute[:10]
        if live.day == day:
            live.tokens_day += tokens
            live.cost_day += cost
        elif _replaces(live.day, day, mode):
            live.day, live.tokens_day, live.cost_day = day, tokens, cost
        month = minute[:7]
        if live.month == month:
            live.cost_month += cost
        elif _replaces(live.month, month, mode):
            live.month, live.cost_month = month, cost


# what a different bucket does to a window's live one (``MemoryBudgetStore._add``)
_CREATE, _ROLLED_OVER_STAYS, _REPLAYED = 0, 1, 2


def _replaces(live: str, bucket: str, mode: int) -> bool:
    """Whether ``bucket`` replaces the live one (``""``: the window never counted)."""
    if not live or mode == _CREATE:
        return True
    return mode == _REPLAYED and bucket > live


class _LiveBuckets:
    """One workload's live window buckets and their amounts: the minute's tokens and
    requests, the day's tokens and cost, the month's cost (a reservation, a settlement
    and a release always touch all five, so two windows of one length share a
    bucket)."""

    __slots__ = (
        "cost_day",
        "cost_month",
        "day",
        "minute",
        "month",
        "requests_minute",
        "tokens_day",
        "tokens_minute",
    )

    def __init__(self) -> None:
        self.minute = self.day = self.month = ""  # no bucket counted yet
        self.tokens_minute = self.requests_minute = self.tokens_day = 0
        self.cost_day = self.cost_month = 0
