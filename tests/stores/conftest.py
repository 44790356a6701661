"""Store fixtures: every contract test runs once per backend (memory, sqlite).

PostgreSQL and Redis join the ``BACKENDS`` lists when their adapters exist.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ncap.stores import (
    BudgetStore,
    LedgerStore,
    MemoryBudgetStore,
    MemoryLedgerStore,
    SQLiteBudgetStore,
    SQLiteLedgerStore,
)

BUDGET_BACKENDS = ["memory", "sqlite"]
LEDGER_BACKENDS = ["memory", "sqlite"]

BudgetFactory = Callable[..., BudgetStore]


class Clock:
    """A settable clock for stores that read the time themselves."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock(datetime(2026, 11, 29, 10, 15, 30, tzinfo=UTC))


@pytest.fixture(params=BUDGET_BACKENDS)
async def budget_factory(
    request: pytest.FixtureRequest, tmp_path: Path, clock: Clock
) -> AsyncIterator[BudgetFactory]:
    """Makes stores of one backend; sqlite stores made by one factory share a file."""
    made: list[BudgetStore] = []

    def make(gateway_instance: str = "g1") -> BudgetStore:
        store: BudgetStore
        if request.param == "memory":
            store = MemoryBudgetStore(gateway_instance=gateway_instance, clock=clock)
        else:
            store = SQLiteBudgetStore(
                tmp_path / "budgets.db", gateway_instance=gateway_instance, clock=clock
            )
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


@pytest.fixture
async def budgets(budget_factory: BudgetFactory) -> BudgetStore:
    return budget_factory()


@pytest.fixture(params=LEDGER_BACKENDS)
async def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LedgerStore]:
    store: LedgerStore = (
        MemoryLedgerStore() if request.param == "memory" else SQLiteLedgerStore(tmp_path / "l.db")
    )
    yield store
    await store.close()
