"""In-process budgets: the embedded default, ``quota_scope=instance``.

Counters live in this process only, one live bucket per (subject, window); a bucket
that rolls over is dropped, so memory stays bounded. Admission is atomic because the
check and the update run under one lock with no ``await`` between them. Nothing
survives a restart: a dead process's holds die with it (``recover_lost`` is a no-op).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime

from ncap.config import utcnow
from ncap.domain.budget import Amounts, Buckets, BudgetWindows, Usage, admit
from ncap.stores._common import (
    Entry,
    Key,
    build_usage,
    hold_entries,
    hold_ref,
    new_hold,
    usage_keys,
)
from ncap.stores.base import Hold

__all__ = ["MemoryBudgetStore"]


class MemoryBudgetStore:
    """``BudgetStore`` in a dict; also the fake the lifecycle tests use."""

    quota_scope = "instance"

    def __init__(
        self, *, gateway_instance: str = "local", clock: Callable[[], datetime] = utcnow
    ) -> None:
        self._instance = gateway_instance
        self._clock = clock
        self._lock = threading.Lock()
        # (subject, window) -> (live bucket, amount)
        self._counters: dict[tuple[str, str], tuple[str, int]] = {}
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
        buckets = Buckets.at(now or self._clock())
        with self._lock:
            if hold_id is not None and hold_id in self._holds:
                raise ValueError(f"hold {hold_id!r} already exists")
            usage = self._usage(workload_id, exception_id, buckets)
            admit(workload_id, exception_id, usage, windows, amounts, buckets)
            hold = new_hold(workload_id, exception_id, amounts, buckets, self._instance, hold_id)
            self._add(hold_entries(hold, hold.tokens, hold.cost_micros, 1), create=True)
            self._holds[hold.hold_id] = hold
            self._count(hold, +1)
        return hold

    async def settle(self, hold: Hold | str, actual_tokens: int, actual_cost_micros: int) -> bool:
        if actual_tokens < 0 or actual_cost_micros < 0:
            raise ValueError("actual usage cannot be negative")
        with self._lock:
            held = self._holds.pop(hold_ref(hold), None)
            if held is None:
                return False
            self._count(held, -1)
            deltas = hold_entries(
                held, actual_tokens - held.tokens, actual_cost_micros - held.cost_micros, 0
            )
            self._add(deltas, create=False)
        return True

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
            self._add(hold_entries(held, -held.tokens, -held.cost_micros, -1), create=False)
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
        return 0

    async def close(self) -> None:
        return None

    def _count(self, hold: Hold, delta: int) -> None:
        """Track active holds per workload, so admission does not scan every hold."""
        if hold.state == "active":
            self._active[hold.workload_id] = self._active.get(hold.workload_id, 0) + delta

    def _usage(self, workload_id: str, exception_id: str | None, buckets: Buckets) -> Usage:
        in_flight = self._active.get(workload_id, 0)
        return build_usage(usage_keys(workload_id, exception_id, buckets), self._read, in_flight)

    def _read(self, key: Key) -> int:
        bucket, amount = self._counters.get(key[:2], ("", 0))
        return amount if bucket == key[2] else 0

    def _add(self, entries: list[Entry], *, create: bool) -> None:
        """Add to the live buckets; a new bucket replaces an old one only when ``create``
        (a settlement for a bucket that already rolled over changes nothing)."""
        for subject, window, bucket, amount in entries:
            live, current = self._counters.get((subject, window), (bucket, 0))
            if live == bucket:
                self._counters[(subject, window)] = (bucket, current + amount)
            elif create:
                self._counters[(subject, window)] = (bucket, amount)
