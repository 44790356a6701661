"""A throwaway backend: a ledger kept in one plain dict, registered under ``dict://``.

It exists to show what a new backend costs: this module (the store and its ``Backend``
value), one line registering it in ``ncap.stores.BACKENDS`` and one URL in the test
matrix (``conftest.LEDGER_URLS``) run the whole ledger contract over it. It keeps no
order of its own and no pending updates: every read sorts, every update replaces.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from msgspec.structs import replace

from ncap.config import Pricing
from ncap.domain.events import UNSETTLED_STATES, LedgerEvent, ReconciliationRow
from ncap.stores import history_of
from ncap.stores._common import apply_import, check_update_fields, is_lost
from ncap.stores.memory.admin import MemoryAdminStore
from ncap.stores.memory.instances import MemoryInstanceRegistry
from ncap.stores.ports import (
    AdminStore,
    Backend,
    DuplicateAttempt,
    ImportResult,
    LedgerSide,
    RowUpdate,
    StoreOptions,
    update_each,
)


class DictLedgerStore:
    """``LedgerStore`` as ``{(request_id, attempt): event}``."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], LedgerEvent] = {}
        self.closed = False

    def _sorted(self) -> list[LedgerEvent]:
        return sorted(self.rows.values(), key=lambda e: (e.timestamp, e.request_id, e.attempt))

    async def append(self, event: LedgerEvent) -> None:
        self._check_open()
        key = (event.request_id, event.attempt)
        if key in self.rows:
            raise DuplicateAttempt(event.request_id, event.attempt)
        self.rows[key] = event

    async def append_reserved(self, event: LedgerEvent) -> None:
        await self.append(event)

    async def update(self, request_id: str, attempt: int, /, **fields: Any) -> None:
        self._check_open()
        check_update_fields(fields)
        key = (request_id, attempt)
        if key not in self.rows:
            raise KeyError(f"no ledger row for request {request_id!r} attempt {attempt}")
        self.rows[key] = replace(self.rows[key], **fields)

    async def update_many(self, updates: Sequence[RowUpdate]) -> None:
        await update_each(self, updates)

    async def get(self, request_id: str) -> list[LedgerEvent]:
        return sorted(
            (e for e in self.rows.values() if e.request_id == request_id), key=lambda e: e.attempt
        )

    async def export(
        self, since: datetime | None = None, until: datetime | None = None
    ) -> AsyncIterator[LedgerEvent]:
        for event in self._sorted():
            if (since is None or event.timestamp >= since) and (
                until is None or event.timestamp < until
            ):
                yield event

    async def pending(self, reserved_before: datetime | None = None) -> list[LedgerEvent]:
        return [
            e
            for e in self._sorted()
            if e.state in UNSETTLED_STATES
            or (reserved_before is not None and is_lost(e, None, reserved_before))
        ]

    async def mark_lost(
        self,
        gateway_instance: str | None = None,
        *,
        before: datetime | None = None,
        reason: str = "gateway_lost",
    ) -> int:
        lost = [k for k, e in self.rows.items() if is_lost(e, gateway_instance, before)]
        for key in lost:
            self.rows[key] = replace(
                self.rows[key], state="usage_reconciliation_required", reconciliation_reason=reason
            )
        return len(lost)

    async def import_reconciliation(
        self, rows: Iterable[ReconciliationRow], *, pricing: Mapping[str, Pricing] | None = None
    ) -> ImportResult:
        def find(pid: str) -> list[LedgerEvent]:
            return [e for e in self._sorted() if e.provider_request_id == pid]

        def write(event: LedgerEvent) -> None:
            self.rows[(event.request_id, event.attempt)] = event

        return apply_import(rows, find, write, pricing)

    async def close(self) -> None:
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("dict ledger is closed")


def _open_ledger(url: str, options: StoreOptions) -> LedgerSide:
    ledger = DictLedgerStore()
    return LedgerSide(ledger, MemoryInstanceRegistry(), history_of(ledger))


def _open_admin(url: str, create: bool) -> AdminStore | None:
    return MemoryAdminStore() if create else None


DICT_BACKEND = Backend("dict", shared=False, ledger=_open_ledger, admin=_open_admin)
