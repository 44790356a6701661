"""Redis budget counters rebuilt from the ledger, after Redis lost them.

The ledger is the source of truth and the Redis counters a cache of it. When a
workload's generation marker is missing (a Redis restarted without persistence, a
FLUSHALL, a failover to an empty replica, an eviction), the budget script refuses
every operation on that workload (``NCAPLOST``) until one gateway has written them
back: this module works out what to write, per workload, from the same two ledger
queries the in-process budgets rebuild from (``BudgetHistory``):

- settled and reconciled spend of the current minute, day and month (and every
  exception's spend, of any age), summed into the live buckets;
- every admitted row still holding its reservation: a ``reserved`` row (an attempt
  in flight, or a gateway lost) becomes an *active* hold again, so the live gateway's
  settlement finds it and replaces its amounts by actuals (and a peer's recovery
  keeps it if that gateway died); a ``pending`` / ``usage_reconciliation_required``
  row becomes a *kept* hold. Their reserved amounts are counted in their buckets.

The payload is written by the script's ``restore`` operation, in one atomic call with
the marker, so no operation ever sees half-rebuilt counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from ncap.domain.budget import Buckets
from ncap.domain.events import LedgerEvent
from ncap.stores.ports import BudgetHistory, hold_id_for

__all__ = ["Restore", "indices", "restore_payloads"]

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# the script's TTLs (lua/budgets_v3.lua), seconds
TTL = {"tm": 120, "rm": 120, "td": 172800, "cd": 172800, "cm": 3024000, "x": 0}


@dataclass(slots=True)
class Restore:
    """One workload's counters (key suffix -> [amount, ttl]) and hold records."""

    counters: dict[str, list[int]] = field(default_factory=dict)
    holds: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, suffix: str, kind: str, amount: int) -> None:
        entry = self.counters.setdefault(suffix, [0, TTL[kind]])
        entry[0] += amount

    def payload(self) -> dict[str, Any]:
        # an empty Lua table encodes as {} either way; the script only iterates
        return {"c": self.counters or {}, "h": self.holds or {}}


def indices(at: datetime) -> tuple[int, int, int]:
    """The script's (minute, day, month) bucket numbers of an instant."""
    us = (at.astimezone(UTC) - EPOCH) // timedelta(microseconds=1)
    seconds = us // 1_000_000
    utc = at.astimezone(UTC)
    return seconds // 60, seconds // 86400, utc.year * 12 + utc.month - 1


def _minute_start(minute: str) -> datetime:
    return datetime.fromisoformat(minute + ":00").replace(tzinfo=UTC)


class _Builder:
    def __init__(self, now: datetime) -> None:
        self.now = Buckets.at(now)
        self.m, self.d, self.mo = indices(now)
        self.out: dict[str, Restore] = {}

    def add(
        self, workload: str, exception: str | None, minute: str, tokens: int, cost: int, n: int
    ) -> None:
        r = self.out.setdefault(workload, Restore())
        if minute == self.now.minute:
            r.add(f":tm:{self.m}", "tm", tokens)
            r.add(f":rm:{self.m}", "rm", n)
        if minute[:10] == self.now.day:
            r.add(f":td:{self.d}", "td", tokens)
            r.add(f":cd:{self.d}", "cd", cost)
        if minute[:7] == self.now.month:
            r.add(f":cm:{self.mo}", "cm", cost)
        if exception:
            r.add(f":x:{exception}", "x", cost)

    def hold(self, event: LedgerEvent) -> None:
        tokens = event.reserved_input_tokens + event.reserved_output_tokens
        minute = Buckets.at(event.timestamp).minute
        self.add(
            event.workload_id,
            event.exception_id,
            minute,
            tokens,
            event.reserved_cost_micros,
            1,
        )
        m, d, mo = indices(_minute_start(minute))
        us = (event.timestamp - EPOCH) // timedelta(microseconds=1)
        self.out[event.workload_id].holds[hold_id_for(event.request_id, event.attempt)] = {
            "w": event.workload_id,
            "x": event.exception_id or "",
            "t": tokens,
            "c": event.reserved_cost_micros,
            "m": m,
            "d": d,
            "mo": mo,
            "g": event.gateway_instance or "",
            "at": str(us),
            "s": "active" if event.state == "reserved" else "kept",
        }


async def restore_payloads(history: BudgetHistory, now: datetime) -> dict[str, Restore]:
    """What to write back per workload, from the ledger, for the buckets live at ``now``."""
    builder = _Builder(now)
    month_start = builder.now.now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    async for total in history.spent_totals(month_start):
        builder.add(
            total.workload_id,
            total.exception_id,
            total.minute,
            total.tokens,
            total.cost_micros,
            total.requests,
        )
    async for event in history.held_rows():
        builder.hold(event)
    return builder.out
