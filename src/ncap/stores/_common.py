"""Logic every backend shares, so the backends differ only in how they store things."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from datetime import datetime
from typing import Any, NamedTuple, Protocol
from uuid import uuid4

import msgspec

from ncap.config import Pricing
from ncap.domain.budget import Amounts, Buckets, BudgetWindows, Usage, admit
from ncap.domain.events import (
    LEDGER_COLUMNS,
    UNSETTLED_STATES,
    LedgerEvent,
    ReconciliationRow,
    reconcile,
)
from ncap.stores.ports import (
    BudgetHistory,
    Hold,
    ImportResult,
    LedgerStore,
    Settle,
    SpentTotal,
)

# (subject, window, bucket, amount): one counter a hold adds to
Entry = tuple[str, str, str, int]
Key = tuple[str, str, str]

LIFE_BUCKET = "life"
IMMUTABLE_COLUMNS = frozenset({"request_id", "attempt"})
_COLUMN_SET = frozenset(LEDGER_COLUMNS)
_UPDATABLE = _COLUMN_SET - IMMUTABLE_COLUMNS


def new_hold(
    workload_id: str,
    exception_id: str | None,
    amounts: Amounts,
    buckets: Buckets,
    gateway_instance: str,
    hold_id: str | None,
) -> Hold:
    return Hold(
        hold_id=hold_id or uuid4().hex,
        workload_id=workload_id,
        exception_id=exception_id,
        tokens=amounts.tokens,
        cost_micros=amounts.cost_micros,
        minute=buckets.minute,
        day=buckets.day,
        month=buckets.month,
        gateway_instance=gateway_instance,
        created_at=buckets.now,
    )


class TwoPhaseBudgets(ABC):
    """The ``reserve`` every budget backend shares; a backend supplies ``_reserve``,
    which must run ``Charge.admit`` and store its entries in one critical section."""

    _clock: Callable[[], datetime]

    def reserve(
        self,
        workload_id: str,
        windows: BudgetWindows,
        amounts: Amounts,
        *,
        exception_id: str | None = None,
        now: datetime | None = None,
        hold_id: str | None = None,
    ) -> Coroutine[Any, Any, Hold]:
        """The backend's ``_reserve`` coroutine for this charge (awaited by the caller:
        no coroutine of its own per reservation)."""
        buckets = Buckets.at(now or self._clock())
        return self._reserve(Charge(workload_id, exception_id, windows, amounts, buckets, hold_id))

    @abstractmethod
    async def settle(self, hold: Hold | str, actual_tokens: int, actual_cost_micros: int) -> bool:
        """Replace the reservation by actual usage; False if the hold is already gone."""

    async def settle_many(self, settles: Sequence[Settle]) -> None:
        await settle_together(self.settle, settles)

    @abstractmethod
    async def _reserve(self, charge: Charge) -> Hold:
        """The store's own atomic admit-and-hold (memory: under its lock; SQLite: in one
        immediate transaction); each store that builds on this class defines it."""


async def settle_together(
    settle: Callable[[Hold, int, int], Awaitable[bool]], settles: Sequence[Settle]
) -> None:
    """``settle_many`` as concurrent ``settle`` calls (a store's round trips overlap; the
    writes of SQLite's share one group commit); the first failure is raised once all
    are done."""
    if len(settles) == 1:
        await settle(*settles[0])
        return
    done = await asyncio.gather(*(settle(*s) for s in settles), return_exceptions=True)
    for outcome in done:
        if isinstance(outcome, BaseException):
            raise outcome


class Charge(msgspec.Struct, frozen=True, gc=False):
    """One reservation being decided: what is asked, against which windows, when."""

    workload_id: str
    exception_id: str | None
    windows: BudgetWindows
    amounts: Amounts
    buckets: Buckets
    hold_id: str | None

    def admit(self, usage: Usage, exists: bool, instance: str) -> tuple[Hold, list[Entry]]:
        """The new hold and the counters it adds to, or raise (nothing changed)."""
        hold = self.admit_hold(usage, exists, instance)
        return hold, hold_entries(hold, hold.tokens, hold.cost_micros, 1)

    def admit_hold(self, usage: Usage, exists: bool, instance: str) -> Hold:
        """The new hold, or raise (nothing changed): for a store that adds the hold's
        amounts to its counters its own way."""
        if exists:
            raise ValueError(f"hold {self.hold_id!r} already exists")
        admit(self.workload_id, self.exception_id, usage, self.windows, self.amounts, self.buckets)
        return new_hold(
            self.workload_id, self.exception_id, self.amounts, self.buckets, instance, self.hold_id
        )


def check_actuals(actual_tokens: int, actual_cost_micros: int) -> None:
    """Refuse negative usage before any hold is touched."""
    if actual_tokens < 0 or actual_cost_micros < 0:
        raise ValueError("actual usage cannot be negative")


class Held(Protocol):
    """What a hold's counters are: a ``Hold``, or a store's own row of these columns."""

    @property
    def workload_id(self) -> str: ...
    @property
    def exception_id(self) -> str | None: ...
    @property
    def tokens(self) -> int: ...
    @property
    def cost_micros(self) -> int: ...
    @property
    def minute(self) -> str: ...


class HeldRow(NamedTuple):
    """A stored hold's counter columns, read without building the whole ``Hold``."""

    workload_id: str
    exception_id: str | None
    tokens: int
    cost_micros: int
    minute: str


def settle_entries(hold: Held, actual_tokens: int, actual_cost_micros: int) -> list[Entry]:
    """The deltas that replace a hold's reservation by actual usage."""
    return hold_entries(hold, actual_tokens - hold.tokens, actual_cost_micros - hold.cost_micros, 0)


def release_entries(hold: Held) -> list[Entry]:
    """The deltas that give a never-dispatched hold back entirely."""
    return hold_entries(hold, -hold.tokens, -hold.cost_micros, -1)


def hold_entries(hold: Held, tokens: int, cost: int, requests: int) -> list[Entry]:
    """The counters a hold touches, each with the given amount (a delta when settling)."""
    return minute_entries(hold.workload_id, hold.exception_id, hold.minute, tokens, cost, requests)


def minute_entries(
    workload_id: str, exception_id: str | None, minute: str, tokens: int, cost: int, requests: int
) -> list[Entry]:
    """The counters of one minute's amounts (its day and month are its prefixes)."""
    w, day, month = workload_id, minute[:10], minute[:7]
    entries: list[Entry] = [
        (w, "tokens_minute", minute, tokens),
        (w, "requests_minute", minute, requests),
        (w, "tokens_day", day, tokens),
        (w, "cost_day", day, cost),
        (w, "cost_month", month, cost),
    ]
    if exception_id is not None:
        entries.append((exception_id, "cost_exception", LIFE_BUCKET, cost))
    return entries


HELD_STATES = frozenset({"reserved", *UNSETTLED_STATES})


def is_held(event: LedgerEvent) -> bool:
    """An admitted attempt whose reservation is still held."""
    return event.policy_result == "allow" and event.state in HELD_STATES


def spent_totals(events: Iterable[LedgerEvent], since: datetime) -> list[SpentTotal]:
    """``BudgetHistory.spent_totals`` computed from rows (backends without SQL for it)."""
    sums: dict[tuple[str, str | None, str], list[int]] = {}
    for e in events:
        spent = e.state in ("settled", "reconciled") and e.usage_source != "none"
        if not spent or e.policy_result != "allow":
            continue
        if e.timestamp < since and e.exception_id is None:
            continue
        key = (e.workload_id, e.exception_id, Buckets.at(e.timestamp).minute)
        total = sums.setdefault(key, [0, 0, 0])
        total[0] += e.total_tokens or 0
        total[1] += e.cost_micros or 0
        total[2] += 1
    return [SpentTotal(w, x, m, *amounts) for (w, x, m), amounts in sums.items()]


def usage_keys(workload_id: str, exception_id: str | None, b: Buckets) -> dict[str, Key]:
    """Which counter feeds each ``Usage`` field (in-flight is counted from holds)."""
    keys = {
        "tokens_minute": (workload_id, "tokens_minute", b.minute),
        "requests_minute": (workload_id, "requests_minute", b.minute),
        "tokens_day": (workload_id, "tokens_day", b.day),
        "cost_day": (workload_id, "cost_day", b.day),
        "cost_month": (workload_id, "cost_month", b.month),
    }
    if exception_id is not None:
        keys["cost_exception"] = (exception_id, "cost_exception", LIFE_BUCKET)
    return keys


def build_usage(keys: Mapping[str, Key], read: Callable[[Key], int], in_flight: int) -> Usage:
    return Usage(in_flight=in_flight, **{name: read(key) for name, key in keys.items()})


def encode_per_choice(tokens: tuple[int, ...] | list[int] | None) -> str | None:
    """``output_tokens_per_choice`` as stored: decimal counts joined by commas, in
    choice index order (no JSON: any SQL engine can read it with string functions)."""
    return None if tokens is None else ",".join(str(int(t)) for t in tokens)


def decode_per_choice(text: str | None) -> tuple[int, ...] | None:
    return None if text is None or text == "" else tuple(int(t) for t in text.split(","))


def hold_ref(hold: Hold | str) -> str:
    return hold if isinstance(hold, str) else hold.hold_id


def check_update_fields(fields: Mapping[str, object]) -> None:
    names = fields.keys()
    if names <= _UPDATABLE:
        return
    unknown = names - _COLUMN_SET
    if unknown:
        raise ValueError(f"unknown ledger columns: {sorted(unknown)}")
    raise ValueError("request_id and attempt identify a row and cannot be updated")


def is_lost(event: LedgerEvent, gateway_instance: str | None, before: datetime | None) -> bool:
    if event.state != "reserved":
        return False
    if gateway_instance is not None and event.gateway_instance != gateway_instance:
        return False
    return before is None or event.timestamp < before


def apply_import(
    rows: Iterable[ReconciliationRow],
    find: Callable[[str], list[LedgerEvent]],
    write: Callable[[LedgerEvent], None],
    pricing: Mapping[str, Pricing] | None,
) -> ImportResult:
    """Reconcile each row against the events ``find`` returns; ``write`` persists one."""
    result = ImportResult()
    prices = pricing or {}
    for row in rows:
        pid = row.provider_request_id
        events = find(pid)
        target = _target(events)
        if target is None:
            (result.ambiguous if events else result.unmatched).append(pid)
            continue
        outcome, updated = reconcile(target, row, prices.get(target.route_id or ""))
        if outcome == "reconciled":
            write(updated)
            result.reconciled.append(updated)
        else:
            getattr(result, _BUCKET[outcome]).append(pid)
    return result


_BUCKET = {
    "unchanged": "unchanged",
    "conflict": "conflicts",
    "not_pending": "not_pending",
    "unpriced": "unpriced",
}


def _target(events: list[LedgerEvent]) -> LedgerEvent | None:
    """The one event a provider id reconciles: unsettled first, else the reconciled one."""
    for states in (UNSETTLED_STATES, ("reconciled",)):
        hits = [e for e in events if e.state in states]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            return None
    return events[0] if events else None  # settled or denied only: not pending


def text_bucket(hourly: bool) -> str:
    """The report's hour or day of a fixed-width UTC text stamp, as SQL."""
    return f"substr(timestamp, 1, {13 if hourly else 10})"


def history_of(ledger: LedgerStore) -> BudgetHistory:
    """What in-process budgets rebuild from: the ledger's own query when it has one,
    else a full export filtered here (correct, slower on a large ledger)."""
    if isinstance(ledger, BudgetHistory):
        return ledger
    return _ExportHistory(ledger)


class _ExportHistory:
    def __init__(self, ledger: LedgerStore) -> None:
        self._ledger = ledger

    async def held_rows(self) -> AsyncIterator[LedgerEvent]:
        async for event in self._ledger.export():
            if is_held(event):
                yield event

    async def spent_totals(self, since: datetime) -> AsyncIterator[SpentTotal]:
        for total in spent_totals([e async for e in self._ledger.export()], since):
            yield total
