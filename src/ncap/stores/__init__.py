"""The stores, opened from their URLs (config ``stores:``, docs/configuration.md).

One folder per backend, each providing the ports it supports (``ports.py``) with its
own schema and migrations: ``memory/`` (``memory://``), ``sqlite/`` (``sqlite:///…``),
``postgres/`` (``postgresql://…``: the ledger) and ``redis/`` (``redis://…``: the
budgets). ``BACKENDS`` maps a URL scheme to its backend; the openers below are the only
code that reads a store URL's scheme, so that the rest of ncap receives opened stores.
A new backend is one folder and one line in ``BACKENDS``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlsplit

from ncap.config import LedgerDurability
from ncap.errors import ConfigError
from ncap.stores import memory, postgres, redis, sqlite
from ncap.stores._common import history_of
from ncap.stores.memory.admin import MemoryAdminStore
from ncap.stores.memory.budgets import MemoryBudgetStore
from ncap.stores.memory.ledger import MemoryLedgerStore
from ncap.stores.ports import (
    STORE_TIMEOUT_S,
    AdminStore,
    Backend,
    BudgetHistory,
    BudgetSide,
    BudgetStore,
    DuplicateAttempt,
    Hold,
    HoldState,
    IdempotencyStore,
    Identity,
    ImportResult,
    InstanceRegistry,
    LedgerSide,
    LedgerSource,
    LedgerStore,
    RowExport,
    StoreOptions,
    hold_id_for,
)
from ncap.stores.postgres.ledger import PostgresLedgerStore
from ncap.stores.postgres.report_source import PostgresSource
from ncap.stores.redis.budgets import RedisBudgetStore
from ncap.stores.sqlite import sqlite_target
from ncap.stores.sqlite.budgets import SQLiteBudgetStore
from ncap.stores.sqlite.ledger import SQLiteLedgerStore
from ncap.stores.sqlite.report_indexes import ensure_report_indexes
from ncap.stores.sqlite.report_source import SQLiteSource

__all__ = [
    "BACKENDS",
    "AdminStore",
    "Backend",
    "BudgetHistory",
    "BudgetSide",
    "BudgetStore",
    "DuplicateAttempt",
    "Hold",
    "HoldState",
    "IdempotencyStore",
    "Identity",
    "ImportResult",
    "InstanceRegistry",
    "LedgerSide",
    "LedgerSource",
    "LedgerStore",
    "MemoryBudgetStore",
    "MemoryLedgerStore",
    "PostgresLedgerStore",
    "PostgresSource",
    "RedisBudgetStore",
    "RowExport",
    "SQLiteBudgetStore",
    "SQLiteLedgerStore",
    "SQLiteSource",
    "StoreOptions",
    "Stores",
    "backend_name",
    "budgets_from_url",
    "check_store_urls",
    "ensure_report_indexes",
    "existing_admin",
    "history_of",
    "hold_id_for",
    "ledger_from_url",
    "migrate_stores",
    "open_admin",
    "open_budget_side",
    "open_ledger_side",
    "open_report_source",
    "open_stores",
    "shared_between_processes",
    "sqlite_target",
]

log = logging.getLogger("ncap.http")  # start-up warnings, as the gateway's own

# URL scheme -> backend: the one table that chooses a backend
BACKENDS: dict[str, Backend] = {
    "memory": memory.BACKEND,
    "sqlite": sqlite.BACKEND,
    "postgresql": postgres.BACKEND,
    "postgres": postgres.BACKEND,
    "redis": redis.BACKEND,
    "rediss": redis.BACKEND,
}


def _lookup(url: str) -> tuple[str, Backend | None]:
    """The scheme of ``url`` and its backend: the one place a store URL's scheme is read."""
    scheme = urlsplit(url).scheme.lower()
    return scheme, BACKENDS.get(scheme)


def _backend(url: str, store: str) -> Backend:
    """The backend of ``url``, which must provide ``store`` (``ledger``, ``budgets``)."""
    scheme, backend = _lookup(url)
    if backend is None:  # the scheme only: the rest of a URL may hold a password
        known = ", ".join(sorted({f"{s}://" for s in BACKENDS}))
        raise ConfigError(f"stores.{store}: unsupported store URL scheme {scheme!r} ({known})")
    if getattr(backend, store) is None:
        raise ConfigError(f"stores.{store}: {scheme}:// is not a {store} store")
    return backend


def check_store_urls(ledger_url: str, budgets_url: str) -> None:
    """Every problem with the two store URLs' schemes (each must name a backend that
    keeps that store) in one ``ConfigError``; nothing is opened (``ncap check-config``)."""
    problems: list[str] = []
    for url, store in ((ledger_url, "ledger"), (budgets_url, "budgets")):
        try:
            _backend(url, store)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(problems[0], problems)


def open_ledger_side(url: str, options: StoreOptions) -> LedgerSide:
    """The ledger ``url`` names and what lives beside it (``open_stores``, tests)."""
    opener = _backend(url, "ledger").ledger
    assert opener is not None  # checked by _backend
    return opener(url, options)


def open_budget_side(url: str, options: StoreOptions, history: BudgetHistory | None) -> BudgetSide:
    """The budgets ``url`` names and the records kept beside them (``open_stores``, tests)."""
    opener = _backend(url, "budgets").budgets
    assert opener is not None  # checked by _backend
    return opener(url, options, history)


@dataclass(slots=True)
class Stores:
    """The opened stores of one gateway: every port, and what the backends need done
    around them (made by ``open_stores``; the gateway closes them at shutdown)."""

    ledger: LedgerStore
    budgets: BudgetStore
    admin: AdminStore
    instances: InstanceRegistry
    idempotency: IdempotencyStore
    shared: bool  # other processes may write the ledger (admin tables re-read)
    backends: dict[str, str]  # "ledger"/"budgets" -> backend name (``/readyz``)
    _ledger_url: str = field(repr=False)
    _budget_side: BudgetSide = field(repr=False)

    async def prepare(self, workloads: Iterable[str]) -> None:
        """Before serving: budgets that keep counters apart from the ledger (Redis) warn
        about settings that lose them and make them whole."""
        if self._budget_side.prepare is not None:
            await self._budget_side.prepare(workloads, _warn)

    def report_source(self) -> LedgerSource:
        """A new read-only source on the ledger, for one report."""
        return open_report_source(self._ledger_url)

    async def index_for_reports(self) -> None:
        """The report's optional indexes on a ledger that has them (idempotent)."""
        indexes = _backend(self._ledger_url, "ledger").report_indexes
        if indexes is not None:
            await indexes(self._ledger_url)

    async def close(self) -> None:
        await self.ledger.close()
        await self.budgets.close()
        await self.admin.close()


def open_stores(ledger_url: str, budgets_url: str, options: StoreOptions) -> Stores:
    """Open the ledger, then the budgets that rebuild from it (at start-up when
    in-process, whenever Redis lost them), and every port beside them."""
    ledger_side = open_ledger_side(ledger_url, options)
    budget_side = open_budget_side(budgets_url, options, ledger_side.history)
    ledger_backend = _backend(ledger_url, "ledger")
    return Stores(
        ledger=ledger_side.ledger,
        budgets=budget_side.budgets,
        admin=open_admin(ledger_url),
        instances=ledger_side.instances,
        idempotency=budget_side.idempotency,
        shared=ledger_backend.shared,
        backends={"ledger": ledger_backend.name, "budgets": _backend(budgets_url, "budgets").name},
        _ledger_url=ledger_url,
        _budget_side=budget_side,
    )


def ledger_from_url(
    url: str, *, durability: LedgerDurability = "normal", timeout_s: float = STORE_TIMEOUT_S
) -> LedgerStore:
    """The ledger store ``url`` names alone (tools); ``ConfigError`` for anything unusable."""
    return open_ledger_side(url, StoreOptions(durability=durability, timeout_s=timeout_s)).ledger


def budgets_from_url(
    url: str,
    *,
    gateway_instance: str = "local",
    clock: Callable[[], datetime] | None = None,
    history: BudgetHistory | None = None,
    timeout_s: float = STORE_TIMEOUT_S,
) -> BudgetStore:
    """The budget store ``url`` names alone (tools); holds are tagged with
    ``gateway_instance``. Budgets given a ``history`` (the ledger) rebuild from it."""
    options = StoreOptions(gateway_instance=gateway_instance, clock=clock, timeout_s=timeout_s)
    return open_budget_side(url, options, history).budgets


def open_admin(ledger_url: str) -> AdminStore:
    """The admin store beside the ledger ``ledger_url`` names (its file, its database
    and schema, or memory)."""
    store = _admin(ledger_url, create=True)
    assert store is not None  # created when asked to
    return store


def existing_admin(ledger_url: str) -> AdminStore | None:
    """The admin tables a tool can read beside the ledger, None when there are none
    (a ``memory://`` ledger, a SQLite file not made yet)."""
    return _admin(ledger_url, create=False)


def _admin(ledger_url: str, *, create: bool) -> AdminStore | None:
    opener = _backend(ledger_url, "ledger").admin
    if opener is None:
        logging.getLogger("ncap.admin").warning(
            "admin changes are kept in memory only: no admin tables for this ledger"
        )
        return MemoryAdminStore() if create else None
    return opener(ledger_url, create)


def open_report_source(ledger_url: str) -> LedgerSource:
    """A read-only source on the ledger ``ledger_url`` names, for the reports."""
    opener = _backend(ledger_url, "ledger").report_source
    if opener is None:
        raise ConfigError("stores.ledger: this ledger cannot be read by the reports")
    return opener(ledger_url)


def backend_name(url: str) -> str:
    """The name of the backend ``url`` names (``postgres://`` is ``postgresql``), or its
    scheme when no backend has it."""
    scheme, backend = _lookup(url)
    return backend.name if backend is not None else scheme


def shared_between_processes(url: str) -> bool:
    """Whether several processes can share the store ``url`` names (not ``memory://``)."""
    backend = _lookup(url)[1]
    return backend is not None and backend.shared


async def migrate_stores(ledger_url: str, budgets_url: str) -> dict[str, dict[str, object]]:
    """Open each store (which applies its pending migrations) and report its revision."""
    return {
        "ledger": await _migrate(ledger_url, "ledger"),
        "budgets": await _migrate(budgets_url, "budgets"),
    }


async def _migrate(url: str, store: str) -> dict[str, object]:
    migrate = _backend(url, store).migrate
    if migrate is None:
        return {"backend": _backend(url, store).name, "version": None}
    return await migrate(url, store)


def _warn(message: str) -> None:
    log.warning("%s (docs/operations.md, Redis)", message)
