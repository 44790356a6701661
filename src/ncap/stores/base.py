"""The two store ports: the ledger and the budget counters.

Every backend (memory, SQLite; PostgreSQL and Redis later) implements one of these
Protocols and passes the same contract suite (``tests/stores``). Both are async
because the real backends do I/O; both raise on failure — a lost ledger write or a
lost budget update is never logged and forgotten.

Budgets are two-phase (see ``ncap.domain.budget``): ``reserve`` admits a whole
reservation atomically against every window or raises; the attempt then ends in
exactly one of ``settle`` (usage known: actuals replace the reservation), ``keep``
(usage pending reconciliation: amounts stay held, the concurrency slot is freed) or
``release`` (never dispatched: everything is given back). A kept hold is settled
later, by id, when its usage is reconciled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol, runtime_checkable

from ncap.config import Pricing
from ncap.domain.budget import Amounts, BudgetWindows, Usage
from ncap.domain.events import LedgerEvent, ReconciliationRow

__all__ = [
    "Amounts",
    "BudgetHistory",
    "BudgetStore",
    "BudgetWindows",
    "DuplicateAttempt",
    "Hold",
    "HoldState",
    "IdempotencyStore",
    "ImportResult",
    "LedgerStore",
    "SpentTotal",
    "Usage",
    "hold_id_for",
]

HoldState = Literal["active", "kept"]


def hold_id_for(request_id: str, attempt: int) -> str:
    """The budget hold of a ledger attempt, so a reconciled event finds its hold."""
    return f"{request_id}#{attempt}"


class DuplicateAttempt(ValueError):
    """A ledger row for this (request_id, attempt) exists: attempts are never overwritten."""

    def __init__(self, request_id: str, attempt: int) -> None:
        super().__init__(f"ledger already has request {request_id!r} attempt {attempt}")
        self.request_id = request_id
        self.attempt = attempt


@dataclass(frozen=True, slots=True)
class Hold:
    """One admitted reservation and the window buckets it was charged to."""

    hold_id: str
    workload_id: str
    exception_id: str | None
    tokens: int
    cost_micros: int
    minute: str
    day: str
    month: str
    gateway_instance: str
    created_at: datetime
    state: HoldState = "active"


@dataclass(slots=True)
class ImportResult:
    """What a reconciliation import did, row by row (provider request ids)."""

    reconciled: list[LedgerEvent] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)  # already reconciled, same usage
    conflicts: list[str] = field(default_factory=list)  # already reconciled, other usage
    unmatched: list[str] = field(default_factory=list)  # no ledger row with that id
    not_pending: list[str] = field(default_factory=list)  # settled/denied/reserved rows
    unpriced: list[str] = field(default_factory=list)  # no cost in the row, no route price
    ambiguous: list[str] = field(default_factory=list)  # several unsettled rows share the id


class LedgerStore(Protocol):
    """One durable row per attempt (its columns: docs/ledger.md)."""

    async def append(self, event: LedgerEvent) -> None:
        """Durable when it returns; raises on any write failure or a duplicate attempt."""
        ...

    async def update(self, request_id: str, attempt: int, /, **fields: Any) -> None:
        """Overwrite columns of one attempt; ``KeyError`` when the row does not exist."""
        ...

    async def get(self, request_id: str) -> list[LedgerEvent]:
        """Every attempt of a request, by attempt number."""
        ...

    def export(
        self, since: datetime | None = None, until: datetime | None = None
    ) -> AsyncIterator[LedgerEvent]:
        """Events with ``since <= timestamp < until``, oldest first, streamed."""
        ...

    async def pending(self, reserved_before: datetime | None = None) -> list[LedgerEvent]:
        """Events awaiting reconciliation (``pending`` or ``usage_reconciliation_required``),
        and with ``reserved_before`` also ``reserved`` rows older than it (left
        reserved past their attempt's time limit, not swept yet)."""
        ...

    async def mark_lost(
        self,
        gateway_instance: str | None = None,
        *,
        before: datetime | None = None,
        reason: str = "gateway_lost",
    ) -> int:
        """Turn ``reserved`` rows of a dead gateway (None: of any; ``before``: only rows
        older than that) into ``usage_reconciliation_required`` with ``reason``
        (``gateway_lost``, or ``reserved_timeout`` for rows left reserved past their
        attempt's time limit); returns how many."""
        ...

    async def import_reconciliation(
        self, rows: Iterable[ReconciliationRow], *, pricing: Mapping[str, Pricing] | None = None
    ) -> ImportResult:
        """Reconcile unsettled rows by provider request id; re-importing changes nothing.
        ``pricing`` maps route ids to prices for rows that carry no cost."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SpentTotal:
    """Actual spend of finished attempts in one minute (``YYYY-MM-DDTHH:MM``, UTC)."""

    workload_id: str
    exception_id: str | None
    minute: str
    tokens: int
    cost_micros: int
    requests: int


@runtime_checkable
class BudgetHistory(Protocol):
    """What in-process budgets rebuild their counters from at start-up (the ledger)."""

    def held_rows(self) -> AsyncIterator[LedgerEvent]:
        """Every admitted row still holding its reservation (reserved or unsettled)."""
        ...

    def spent_totals(self, since: datetime) -> AsyncIterator[SpentTotal]:
        """Settled and reconciled spend per minute: at or after ``since`` (the start of
        the month), and of any age for exceptions; refused attempts (released holds,
        ``usage_source=none``) excluded."""
        ...


class IdempotencyStore(Protocol):
    """Client ``Idempotency-Key`` records, kept beside the budgets so every replica that
    shares the budgets shares them (Redis: ``SET NX`` with an expiry). A record is an
    opaque byte string that expires ``ttl_s`` after it was last written."""

    async def claim(self, key: str, record: bytes, ttl_s: float) -> bytes | None:
        """Store ``record`` unless ``key`` holds an unexpired one: None when stored,
        else the record already there (atomic across replicas)."""
        ...

    async def get(self, key: str) -> bytes | None: ...

    async def swap(self, key: str, expected: bytes, record: bytes | None, ttl_s: float) -> bool:
        """If ``key`` still holds ``expected``, replace it by ``record`` (None deletes);
        False when another record is there (or none)."""
        ...


class BudgetStore(Protocol):
    """Per-workload windows; ``quota_scope`` says how far a counter reaches, and
    ``round_trip`` whether a reservation is a round trip to another server (the
    lifecycle then sends the first attempt's ledger row beside it)."""

    quota_scope: str
    round_trip: bool

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
        """Admit whole or raise ``BudgetExhausted``/``RateLimitExceeded``/
        ``ConcurrencyLimitExceeded``; a refused reservation changes no counter."""
        ...

    async def settle(self, hold: Hold | str, actual_tokens: int, actual_cost_micros: int) -> bool:
        """Replace the reservation by actual usage; False if the hold is already gone."""
        ...

    async def keep(self, hold: Hold | str) -> bool:
        """Keep the amounts held (usage pending) and free the concurrency slot."""
        ...

    async def release(self, hold: Hold | str) -> bool:
        """Give everything back: the attempt was never dispatched."""
        ...

    async def outstanding(self, workload_id: str | None = None) -> list[Hold]:
        """Holds not yet settled or released (active and kept)."""
        ...

    async def usage(
        self, workload_id: str, *, exception_id: str | None = None, now: datetime | None = None
    ) -> Usage:
        """The counters ``reserve`` would check at ``now``."""
        ...

    async def recover_lost(self, gateway_instance: str | None = None) -> int:
        """At start-up: a dead gateway's active holds become kept (slot freed)."""
        ...

    async def close(self) -> None: ...
