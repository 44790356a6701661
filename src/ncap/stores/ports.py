"""The store ports: what the rest of ncap asks of a store, whatever its backend.

``LedgerStore`` (one durable row per attempt), ``BudgetStore`` (two-phase counters),
``IdempotencyStore`` (client ``Idempotency-Key`` records beside the budgets),
``AdminStore`` (what the admin API changed, beside the ledger), ``InstanceRegistry``
(which gateways are alive, beside the ledger), ``BudgetHistory`` (what budgets rebuild
from) and ``LedgerSource`` (read-only aggregate SQL for the reports). Each backend
folder (``memory/``, ``sqlite/``, ``postgres/``, ``redis/``) implements the ports it
supports and describes them in one ``Backend`` value; ``ncap.stores.open_stores`` is the
only code that reads a store URL's scheme. Every backend passes the same contract suites
(``tests/stores``).

Budgets are two-phase (see ``ncap.domain.budget``): ``reserve`` admits a whole
reservation atomically against every window or raises; the attempt then ends in
exactly one of ``settle`` (usage known: actuals replace the reservation), ``keep``
(usage pending reconciliation: amounts stay held, the concurrency slot is freed) or
``release`` (never dispatched: everything is given back). A kept hold is settled
later, by id, when its usage is reconciled. Every port is async where the real
backends do I/O, and raises on failure: a lost ledger write or a lost budget update is
never logged and forgotten.
"""

from __future__ import annotations

import os
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from ncap.config import ExceptionGrant, KeyEntry, LedgerDurability, Pricing
from ncap.domain.budget import Amounts, BudgetWindows, Usage
from ncap.domain.events import LedgerEvent, ReconciliationRow
from ncap.domain.grants import GrantChanges

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
    "RowUpdate",
    "Settle",
    "SpentTotal",
    "Usage",
    "hold_id_for",
    "update_each",
]

HoldState = Literal["active", "kept"]

# one row's new columns: (request_id, attempt, {column: value})
RowUpdate = tuple[str, int, dict[str, Any]]


def hold_id_for(request_id: str, attempt: int) -> str:
    """The budget hold of a ledger attempt, so a reconciled event finds its hold."""
    return f"{request_id}#{attempt}"


class DuplicateAttempt(ValueError):
    """A ledger row for this (request_id, attempt) exists: attempts are never overwritten."""

    def __init__(self, request_id: str, attempt: int) -> None:
        super().__init__(f"ledger already has request {request_id!r} attempt {attempt}")
        self.request_id = request_id
        self.attempt = attempt


class Hold(msgspec.Struct, frozen=True, gc=False):
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


# a hold settled at its actual usage: (hold, actual_tokens, actual_cost_micros)
Settle = tuple[Hold, int, int]


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

    async def append_reserved(self, event: LedgerEvent) -> None:
        """``append`` of an attempt's ``reserved`` row whose key the gateway has just
        made (its own request id, the next attempt number), before that attempt is
        dispatched: durable when it returns, as ``append``, but the store may make it
        durable its own cheaper way and put it in its table a moment later (the
        embedded SQLite ledger: a line in a journal file, docs/decisions). A
        duplicate key cannot come from a key just made, so it is not raised here."""
        ...

    async def update(self, request_id: str, attempt: int, /, **fields: Any) -> None:
        """Overwrite columns of one attempt; ``KeyError`` when the row does not exist."""
        ...

    async def update_many(self, updates: Sequence[RowUpdate]) -> None:
        """``update`` of each row, in one call: one transaction (SQLite) or one batch
        (PostgreSQL) for a loop tick's settlements. Raises when any row failed; the
        others may or may not be written (SQLite undoes them all, PostgreSQL and the
        memory store keep each that succeeded): an update rewrites the same columns,
        so the caller may apply them again row by row."""
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


async def update_each(store: LedgerStore, updates: Sequence[RowUpdate]) -> None:
    """``update_many`` as one ``update`` per row (for a store with no batch of its own)."""
    for request_id, attempt, fields in updates:
        await store.update(request_id, attempt, **fields)


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

    async def settle_many(self, settles: Sequence[Settle]) -> None:
        """``settle`` of each ``(hold, actual_tokens, actual_cost_micros)`` in one call (a
        loop tick's answers). Raises when any failed; the ones applied stay applied (a
        settled hold is not settled twice, so the caller may settle each again)."""
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


# "session": the dashboard's sign-out, which ends every browser session signed in
# before it; only an audit row (the latest one's instant is read back by ``changes``)
Kind = Literal["exception", "key", "session"]


Action = Literal["create", "revoke"]


class DuplicateGrant(Exception):
    """An id already used by an entry the admin API created (ids are never reused, so
    the audit trail names one entry per id)."""


@dataclass(frozen=True, slots=True)
class AdminChange:
    """One admin change: ``entry`` for a create, None for a revoke of ``target``."""

    actor: str
    action: Action
    kind: Kind
    target: str
    entry: ExceptionGrant | KeyEntry | None = None
    # the name the request gave for whoever made it (``X-Ncap-Actor``): not verified,
    # so kept in the audit's detail beside the entry, never as its actor
    claimed_by: str | None = None


@dataclass(frozen=True, slots=True)
class AuditEntry:
    seq: int
    at: datetime
    actor: str
    action: str
    kind: str
    target: str
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True)
class BudgetAlertRow:
    """One threshold crossed in one window period (``budget_alerts``)."""

    subject: str  # workload id, or exception id for scope "exception"
    scope: str  # day | month | exception
    period: str  # 2026-12-01 | 2026-12 | life
    threshold_pct: int
    fired_at: datetime
    spent_micros: int
    limit_micros: int
    workload: str | None = None  # whose budget (for logs; not stored)


class AdminStore(Protocol):
    async def changes(self) -> GrantChanges: ...

    async def record(self, change: AdminChange, at: datetime) -> None:
        """Apply one change and its audit row atomically."""
        ...

    async def audit(self, limit: int = 1000) -> list[AuditEntry]: ...

    async def claim_alert(self, alert: BudgetAlertRow) -> bool:
        """True for the first claim of (subject, scope, period, threshold) only."""
        ...

    async def mark_delivered(self, alert: BudgetAlertRow) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Identity:
    """This process: its instance id and where it runs (to tell a dead neighbour)."""

    instance: str
    host: str
    pid: int
    pid_namespace: int

    @classmethod
    def current(cls, instance: str) -> Identity:
        return cls(instance, os.uname().nodename, os.getpid(), _pid_namespace())


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    identity: Identity
    beat_age_s: float  # seconds since its last beat, by the store's clock
    timeout_s: float

    @property
    def expired(self) -> bool:
        return self.beat_age_s > self.timeout_s

    def dead_neighbour_of(self, me: Identity) -> bool:
        """Same host and PID namespace, and its process is gone: dead without waiting
        for the timeout (a restart after ``kill -9`` recovers at once)."""
        return self._beside(me) and not _process_alive(self.identity.pid)

    def live_twin_of(self, me: Identity) -> bool:
        """Another running process on this host uses ``me``'s instance id."""
        return self._beside(me) and not self.expired and _process_alive(self.identity.pid)

    def _beside(self, me: Identity) -> bool:
        them = self.identity
        same_place = (them.host, them.pid_namespace) == (me.host, me.pid_namespace)
        return same_place and them.pid != me.pid


class InstanceRegistry(Protocol):
    async def beat(self, me: Identity, timeout_s: float) -> None:
        """Register or refresh ``me``; raises ``StoreUnavailable`` when the store is down."""
        ...

    async def instances(self) -> list[InstanceInfo]: ...

    async def forget(self, instance: str) -> None: ...


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _process_alive(pid: int) -> bool:
    """A zombie (killed, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


Row = tuple[Any, ...]


class LedgerSource(Protocol):
    """Runs read-only aggregate SQL against one ledger (the reports' access to it)."""

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

    def stamp(self, value: datetime) -> Any: ...

    def scan(self, start: Any, end: Any) -> str:
        """The ``FROM`` target for reading the rows of ``[start, end)`` (stamped)."""
        ...

    def exception_scan(self) -> str:
        """The ``FROM`` target for queries over the rows that name an exception."""
        ...

    def per_choice_scan(self, start: Any, end: Any) -> str:
        """The ``FROM`` target for the rows of ``[start, end)`` with per-choice counts."""
        ...

    def bucket(self, hourly: bool) -> str:
        """An SQL expression: the row's UTC hour (``2026-12-01T14``) or day
        (``2026-12-01``) as text, the one date function the time views need."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class RowExport(Protocol):
    """A ledger that can stream its raw rows faster than events (``ncap ledger export``)."""

    def export_rows(
        self, since: datetime | None = None, until: datetime | None = None, *, select: str = ...
    ) -> Iterator[Row]: ...


STORE_TIMEOUT_S = 2.0  # the default bound of one store call (connect, checkout, statement)


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """How stores are opened, beside their URLs (config ``stores:``)."""

    gateway_instance: str = "local"  # holds and heartbeats are tagged with it
    durability: LedgerDurability = "normal"  # the ledger's commit level
    timeout_s: float = STORE_TIMEOUT_S  # the bound of one store call
    clock: Callable[[], datetime] | None = None  # budgets' time (tests); None: the store's


@dataclass(frozen=True, slots=True)
class LedgerSide:
    """An opened ledger and what lives beside it, sharing its connections."""

    ledger: LedgerStore
    instances: InstanceRegistry
    history: BudgetHistory  # what in-process budgets rebuild from


@dataclass(frozen=True, slots=True)
class BudgetSide:
    """Opened budgets and the ``Idempotency-Key`` records kept where they are."""

    budgets: BudgetStore
    idempotency: IdempotencyStore
    # before serving: report settings that lose counters (``warn``), make them whole
    prepare: Callable[[Iterable[str], Callable[[str], None]], Awaitable[None]] | None = None


@dataclass(frozen=True, slots=True)
class Backend:
    """What one backend folder provides, each port opened from the backend's URL.
    A port it does not support is None (Redis keeps no ledger, PostgreSQL no budgets)."""

    name: str  # reported by ``/readyz`` and ``ncap migrate``
    shared: bool  # several processes (workers, replicas) can share the store
    ledger: Callable[[str, StoreOptions], LedgerSide] | None = None
    budgets: Callable[[str, StoreOptions, BudgetHistory | None], BudgetSide] | None = None
    # the admin tables beside the ledger; with False only when they exist already (tools)
    admin: Callable[[str, bool], AdminStore | None] | None = None
    report_source: Callable[[str], LedgerSource] | None = None
    # the report's optional indexes on a ledger that has them (made at start-up)
    report_indexes: Callable[[str], Awaitable[None]] | None = None
    migrate: Callable[[str, str], Awaitable[dict[str, object]]] | None = None
