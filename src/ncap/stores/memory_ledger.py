"""A ledger in a dict (``memory://``): for tests and throw-away runs, never durable."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

from ncap.config import Pricing
from ncap.domain.events import UNSETTLED_STATES, LedgerEvent, ReconciliationRow
from ncap.stores._common import apply_import, check_update_fields, is_lost
from ncap.stores.base import DuplicateAttempt, ImportResult

__all__ = ["MemoryLedgerStore"]


class MemoryLedgerStore:
    """``LedgerStore`` held in this process; same contract as the SQLite one."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, int], LedgerEvent] = {}
        self._updates: dict[tuple[str, int], dict[str, Any]] = {}
        self._closed = False

    def _merged(self) -> dict[tuple[str, int], LedgerEvent]:
        """The rows with their pending updates applied (reads are rare, writes hot)."""
        for key, fields in self._updates.items():
            self._rows[key] = replace(self._rows[key], **fields)
        self._updates.clear()
        return self._rows

    async def append(self, event: LedgerEvent) -> None:
        self._check_open()
        key = (event.request_id, event.attempt)
        if key in self._rows:
            raise DuplicateAttempt(event.request_id, event.attempt)
        # events are frozen and their finish_reasons are never mutated after creation
        # (the lifecycle builds a new dict per attempt), so the event is stored as given
        self._rows[key] = event

    async def update(self, request_id: str, attempt: int, /, **fields: Any) -> None:
        self._check_open()
        check_update_fields(fields)
        key = (request_id, attempt)
        if key not in self._rows:
            raise KeyError(f"no ledger row for request {request_id!r} attempt {attempt}")
        pending = self._updates.setdefault(key, {})
        pending.update(fields)  # merged into the row when it is read: updates stay cheap

    async def get(self, request_id: str) -> list[LedgerEvent]:
        return sorted(
            (e for (rid, _), e in self._merged().items() if rid == request_id),
            key=lambda e: e.attempt,
        )

    async def export(
        self, since: datetime | None = None, until: datetime | None = None
    ) -> AsyncIterator[LedgerEvent]:
        for event in sorted(self._merged().values(), key=_order):
            if (since is None or event.timestamp >= since) and (
                until is None or event.timestamp < until
            ):
                yield event

    async def pending(self) -> list[LedgerEvent]:
        return sorted(
            (e for e in self._merged().values() if e.state in UNSETTLED_STATES), key=_order
        )

    async def mark_lost(
        self, gateway_instance: str | None = None, *, before: datetime | None = None
    ) -> int:
        lost = [k for k, e in self._merged().items() if is_lost(e, gateway_instance, before)]
        for key in lost:
            self._rows[key] = replace(
                self._rows[key],
                state="usage_reconciliation_required",
                reconciliation_reason="gateway_lost",
            )
        return len(lost)

    async def import_reconciliation(
        self, rows: Iterable[ReconciliationRow], *, pricing: Mapping[str, Pricing] | None = None
    ) -> ImportResult:
        def find(pid: str) -> list[LedgerEvent]:
            return sorted(
                (e for e in self._merged().values() if e.provider_request_id == pid), key=_order
            )

        def write(event: LedgerEvent) -> None:
            self._rows[(event.request_id, event.attempt)] = event

        return apply_import(rows, find, write, pricing)

    async def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("memory ledger is closed")


def _order(event: LedgerEvent) -> tuple[datetime, str, int]:
    return (event.timestamp, event.request_id, event.attempt)
