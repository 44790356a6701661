"""The gauges that describe the stores, for operators.

``StoreGauges`` sets them (pending reconciliation, reservations outstanding, budget
spent/reserved/limit per workload, window and exception) from a snapshot of the ledger
and the budget store, at start-up and on scrape, cached for ``max_age_s``. An
in-process counter would be wrong after a restart and after another process (``ncap
reconcile import``) changed the ledger. The counters the request path moves (route
health, settled cost) are moved by the lifecycle itself (``ncap.lifecycle.health``,
``ncap.lifecycle.settle``).

Nothing here reads request content: labels are config ids and fixed codes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from datetime import datetime

from ncap.config import Config, ExceptionGrant, utcnow
from ncap.domain.budget import Buckets, BudgetWindows, Usage
from ncap.domain.events import LedgerEvent
from ncap.domain.grants import Grants
from ncap.domain.money import micros_from_usd
from ncap.metrics import Metrics
from ncap.protocol.validate import MULTI_CANDIDATE_FIELDS
from ncap.stores.ports import (
    BudgetStore,
    Hold,
    LedgerStore,
    hold_id_for,
)

__all__ = [
    "MULTI_CANDIDATE_FIELDS",
    "StoreGauges",
]

log = logging.getLogger("ncap.health")


class StoreGauges:
    """Store-derived gauges, refreshed at most every ``max_age_s`` (one scrape pays)."""

    def __init__(
        self,
        config: Config,
        ledger: LedgerStore,
        budgets: BudgetStore,
        metrics: Metrics,
        *,
        max_age_s: float,
        grants: Grants | None = None,
    ) -> None:
        self._config = config
        self._grants = grants or Grants.from_config(config)
        # every exception seen in force since start-up: a revoked one keeps its series
        # (spend, limit) and reads ``ncap_exception_active 0`` instead of vanishing
        self._seen: dict[str, ExceptionGrant] = {}
        self._pending_keys: set[tuple[str, str]] = set()  # (workload, route) ever pending
        self._ledger = ledger
        self._budgets = budgets
        self._metrics = metrics
        self._max_age_s = max_age_s
        self._at: float | None = None
        self._lock = asyncio.Lock()

    async def refresh(self, *, force: bool = False) -> None:
        """Re-read the stores unless the last snapshot is recent; a store that fails
        leaves the previous values (``/readyz`` is where store health is reported)."""
        async with self._lock:
            if (
                not force
                and self._at is not None
                and (time.monotonic() - self._at < self._max_age_s)
            ):
                return
            try:
                await self._read(utcnow())
            except Exception as exc:  # a scrape never fails because a store did
                log.warning("metrics snapshot failed: %s", type(exc).__name__)
                return
            self._at = time.monotonic()

    async def _read(self, now: datetime) -> None:
        m = self._metrics
        pending = await self._ledger.pending()
        m.pending_reconciliation.set(len(pending))
        self._pending(pending, now)
        holds = await self._settle_reconciled(await self._budgets.outstanding(), pending)
        m.reservations_outstanding.set(len(holds))
        buckets = Buckets.at(now)
        for name, workload in self._config.workloads.items():
            usage = await self._budgets.usage(name, now=now)
            mine = [h for h in holds if h.workload_id == name]
            windows = BudgetWindows.for_workload(workload)
            self._workload(name, usage, windows, _reserved(mine, buckets))
        await self._exceptions(holds, now)

    async def _exceptions(self, holds: list[Hold], now: datetime) -> None:
        """The config's and the admin API's exceptions; active while in force (neither
        revoked nor expired)."""
        m = self._metrics
        in_force = {g.id: g for g in self._grants.exceptions}
        for grant in (*self._config.exceptions, *in_force.values()):
            self._seen[grant.id] = in_force.get(grant.id, self._seen.get(grant.id, grant))
        for grant in self._seen.values():
            usage = await self._budgets.usage(grant.workload, exception_id=grant.id, now=now)
            held = sum(h.cost_micros for h in holds if h.exception_id == grant.id)
            labels = (grant.id, grant.workload)
            active = grant.id in in_force and grant.expires > now
            m.child(m.exception_spent, *labels).set(max(usage.cost_exception - held, 0))
            m.child(m.exception_reserved, *labels).set(held)
            m.child(m.exception_active, *labels).set(1 if active else 0)
            if grant.budget_usd is not None:
                m.child(m.exception_limit, *labels).set(micros_from_usd(grant.budget_usd) or 0)

    def _pending(self, pending: list[LedgerEvent], now: datetime) -> None:
        """Pending rows and the oldest one's age by (workload, route); a pair whose rows
        were all reconciled reads 0 rather than keeping its last value."""
        m = self._metrics
        counts: dict[tuple[str, str], int] = {}
        oldest: dict[tuple[str, str], datetime] = {}
        for e in pending:
            key = (e.workload_id, e.route_id or "")
            counts[key] = counts.get(key, 0) + 1
            oldest[key] = min(oldest.get(key, e.timestamp), e.timestamp)
        self._pending_keys |= counts.keys()
        for key in self._pending_keys:
            m.child(m.pending_by_route, *key).set(counts.get(key, 0))
            age = (now - oldest[key]).total_seconds() if key in oldest else 0.0
            m.child(m.pending_oldest_age, *key).set(max(age, 0.0))

    async def _settle_reconciled(self, holds: list[Hold], pending: list[LedgerEvent]) -> list[Hold]:
        """Settle the kept holds whose rows another process reconciled.

        ``ncap reconcile import`` settles the holds of the budget store it opens; an
        in-process store (``memory://``) is this process's own, so the import cannot
        reach it and the holds would count against the budgets until a restart. A kept
        hold whose row is no longer pending is settled here at the row's final usage.
        Returns the holds still outstanding."""
        waiting = {hold_id_for(e.request_id, e.attempt) for e in pending}
        out = []
        for hold in holds:
            if hold.state != "kept" or hold.hold_id in waiting:
                out.append(hold)
                continue
            row = await self._final_row(hold.hold_id)
            if row is None:
                out.append(hold)  # no final row (yet): leave it
                continue
            await self._budgets.settle(hold, row.total_tokens or 0, row.cost_micros or 0)
        return out

    async def _final_row(self, hold_id: str) -> LedgerEvent | None:
        request_id, _, attempt = hold_id.rpartition("#")
        for event in await self._ledger.get(request_id):
            if str(event.attempt) == attempt and event.state in ("reconciled", "settled"):
                return event
        return None

    async def run(self, interval_s: float) -> None:
        """Refresh every ``interval_s`` in the background (held reservations that
        another process reconciled are released without waiting for a scrape)."""
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh()

    def _workload(
        self, name: str, usage: Usage, windows: BudgetWindows, reserved: dict[str, int]
    ) -> None:
        m = self._metrics
        used = {
            "tokens_minute": usage.tokens_minute,
            "requests_minute": usage.requests_minute,
            "tokens_day": usage.tokens_day,
            "usd_micros_day": usage.cost_day,
            "usd_micros_month": usage.cost_month,
            "concurrency": usage.in_flight,
        }
        limits = {
            "tokens_minute": windows.tokens_per_minute,
            "requests_minute": windows.requests_per_minute,
            "tokens_day": windows.tokens_per_day,
            "usd_micros_day": windows.usd_per_day_micros,
            "usd_micros_month": windows.usd_per_month_micros,
            "concurrency": windows.max_concurrency,
        }
        for window, amount in used.items():
            held = reserved.get(window, 0)
            m.child(m.budget_spent, name, window).set(max(amount - held, 0))
            m.child(m.budget_reserved, name, window).set(held)
            limit = limits[window]
            if limit is not None:
                m.child(m.budget_limit, name, window).set(limit)


def _reserved(holds: Iterable[Hold], buckets: Buckets) -> dict[str, int]:
    """What unsettled holds contribute to each current window (the counters include it)."""
    out = {"tokens_minute": 0, "tokens_day": 0, "usd_micros_day": 0, "usd_micros_month": 0}
    for h in holds:
        if h.minute == buckets.minute:
            out["tokens_minute"] += h.tokens
        if h.day == buckets.day:
            out["tokens_day"] += h.tokens
            out["usd_micros_day"] += h.cost_micros
        if h.month == buckets.month:
            out["usd_micros_month"] += h.cost_micros
    return out
