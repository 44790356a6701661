"""Store fixtures: every contract test runs once per store URL of ``LEDGER_URLS`` /
``BUDGET_URLS`` (memory, SQLite, and the real PostgreSQL / Redis servers, each test in
its own file, schema or key prefix), opened as the gateway opens them (``ncap.stores``'
scheme table). A backend is tested by adding its URL here, with a mark to deselect it
(``-m "not redis"``); its extra arguments beside the URL are the second value.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from ncap.stores import (
    BACKENDS,
    BudgetSide,
    BudgetStore,
    IdempotencyStore,
    LedgerStore,
    MemoryLedgerStore,
    StoreOptions,
    open_budget_side,
    open_ledger_side,
)
from tests.services import PG_URL, REDIS_URL, pg_schema, redis_prefix
from tests.stores.dict_backend import DICT_BACKEND

# the throwaway dict-backed ledger of dict_backend.py, registered like a shipped backend
BACKENDS.setdefault("dict", DICT_BACKEND)

# (URL, arguments beside it), as the limits library's ALL_STORAGES; {tmp} is the test's
# own directory
LEDGER_URLS = [
    pytest.param(("memory://", {}), id="memory"),
    pytest.param(("sqlite:///{tmp}/l.db", {}), id="sqlite"),
    pytest.param((PG_URL, {}), marks=pytest.mark.postgresql, id="postgresql"),
    pytest.param(("dict://", {}), id="dict"),
]
BUDGET_URLS = [
    pytest.param(("memory://", {}), id="memory"),
    pytest.param(("sqlite:///{tmp}/budgets.db", {}), id="sqlite"),
    # a new deployment: its counters are built from an empty ledger
    pytest.param((REDIS_URL, {"history": "empty"}), marks=pytest.mark.redis, id="redis"),
]


@asynccontextmanager
async def isolated(url: str, tmp_path: Path) -> AsyncIterator[str]:
    """``url`` for one test: its own file, PostgreSQL schema or Redis key prefix."""
    if url.startswith("postgresql://"):
        async with pg_schema(url) as own:
            yield own
    elif url.startswith("redis://"):
        async with redis_prefix(url) as own:
            yield own
    else:
        yield url.format(tmp=tmp_path)


class BudgetFactory:
    """Makes budget stores on one URL; stores made by one factory share it (a file, a
    key prefix), and each keeps its ``Idempotency-Key`` records beside it."""

    def __init__(self, url: str, args: dict[str, Any], clock: Clock) -> None:
        self._url, self._args, self._clock = url, args, clock
        self._sides: dict[int, BudgetSide] = {}

    def __call__(self, gateway_instance: str = "g1") -> BudgetStore:
        history = MemoryLedgerStore() if self._args.get("history") == "empty" else None
        options = StoreOptions(gateway_instance=gateway_instance, clock=self._clock)
        side = open_budget_side(self._url, options, history)
        self._sides[id(side.budgets)] = side
        return side.budgets

    def idempotency(self, budgets: BudgetStore) -> IdempotencyStore:
        """The records kept beside ``budgets``."""
        return self._sides[id(budgets)].idempotency

    async def close(self) -> None:
        for side in self._sides.values():
            await side.budgets.close()


class Clock:
    """A settable clock for stores that read the time themselves."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock(datetime(2026, 11, 29, 10, 15, 30, tzinfo=UTC))


@pytest.fixture(params=BUDGET_URLS)
async def budget_factory(
    request: pytest.FixtureRequest, tmp_path: Path, clock: Clock
) -> AsyncIterator[BudgetFactory]:
    """Makes stores of one backend; stores made by one factory share a file / key prefix."""
    url, args = request.param
    async with isolated(url, tmp_path) as own:
        factory = BudgetFactory(own, args, clock)
        yield factory
        await factory.close()


@pytest.fixture
async def budgets(budget_factory: BudgetFactory) -> BudgetStore:
    return budget_factory()


@pytest.fixture(params=LEDGER_URLS)
async def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LedgerStore]:
    url, _ = request.param
    async with isolated(url, tmp_path) as own:
        store = open_ledger_side(own, StoreOptions()).ledger
        yield store
        await store.close()
