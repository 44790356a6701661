"""Store fixtures: every contract test runs once per backend (memory, SQLite, and the
real PostgreSQL / Redis servers, each test in its own schema / key prefix).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ncap.stores import (
    BudgetStore,
    LedgerStore,
    MemoryBudgetStore,
    MemoryLedgerStore,
    PostgresLedgerStore,
    RedisBudgetStore,
    SQLiteBudgetStore,
    SQLiteLedgerStore,
)
from tests.services import pg_schema, redis_prefix

BUDGET_BACKENDS = ["memory", "sqlite", pytest.param("redis", marks=pytest.mark.redis)]
LEDGER_BACKENDS = ["memory", "sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)]

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
    """Makes stores of one backend; stores made by one factory share a file / key prefix."""
    made: list[BudgetStore] = []
    async with redis_prefix() if request.param == "redis" else _nothing() as url:

        def make(gateway_instance: str = "g1") -> BudgetStore:
            store: BudgetStore
            if request.param == "memory":
                store = MemoryBudgetStore(gateway_instance=gateway_instance, clock=clock)
            elif request.param == "redis":
                # a new deployment: its counters are built from an empty ledger
                store = RedisBudgetStore(
                    url,
                    gateway_instance=gateway_instance,
                    clock=clock,
                    history=MemoryLedgerStore(),
                    rebuild_grace_s=0,
                )
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
    async with pg_schema() if request.param == "postgresql" else _nothing() as url:
        store: LedgerStore
        if request.param == "memory":
            store = MemoryLedgerStore()
        elif request.param == "postgresql":
            store = PostgresLedgerStore(url)
        else:
            store = SQLiteLedgerStore(tmp_path / "l.db")
        yield store
        await store.close()


@asynccontextmanager
async def _nothing() -> AsyncIterator[str]:
    yield ""
