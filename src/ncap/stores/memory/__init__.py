"""In-process stores (``memory://``): nothing persisted, nothing shared.

Budgets rebuild from the ledger at start-up (the embedded default); the ledger is
bounded to its newest rows (``?max_rows=N``): tests and benchmarks.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from ncap.config import utcnow
from ncap.errors import ConfigError
from ncap.stores._common import history_of
from ncap.stores.memory.admin import MemoryAdminStore
from ncap.stores.memory.budgets import MemoryBudgetStore
from ncap.stores.memory.idempotency import MemoryIdempotency
from ncap.stores.memory.instances import MemoryInstanceRegistry
from ncap.stores.memory.ledger import DEFAULT_MAX_ROWS, MemoryLedgerStore
from ncap.stores.ports import (
    AdminStore,
    Backend,
    BudgetHistory,
    BudgetSide,
    LedgerSide,
    LedgerSource,
    StoreOptions,
)

__all__ = ["BACKEND"]


def open_ledger(url: str, options: StoreOptions) -> LedgerSide:
    ledger = MemoryLedgerStore(max_rows=_max_rows(url))
    return LedgerSide(ledger, MemoryInstanceRegistry(), history_of(ledger))


def open_budgets(url: str, options: StoreOptions, history: BudgetHistory | None) -> BudgetSide:
    budgets = MemoryBudgetStore(
        gateway_instance=options.gateway_instance, clock=options.clock or utcnow, history=history
    )
    return BudgetSide(budgets, MemoryIdempotency())


def open_admin(url: str, create: bool) -> AdminStore | None:
    """Admin changes made through the API live in the gateway only: nothing to read
    from outside it (``create=False``)."""
    return MemoryAdminStore() if create else None


def open_report_source(url: str) -> LedgerSource:
    raise ConfigError("a memory:// ledger is gone when its gateway stops; nothing to report")


async def migrate(url: str, store: str) -> dict[str, object]:
    return {"backend": "memory", "version": None}


def _max_rows(url: str) -> int:
    raw = parse_qs(urlsplit(url).query).get("max_rows", [str(DEFAULT_MAX_ROWS)])[-1]
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{url!r}: max_rows must be a positive integer")
    return int(raw)


BACKEND = Backend(
    "memory",
    shared=False,
    ledger=open_ledger,
    budgets=open_budgets,
    admin=open_admin,
    report_source=open_report_source,
    migrate=migrate,
)
