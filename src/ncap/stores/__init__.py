"""Ledger and budget stores, chosen by URL scheme (config ``stores:``, docs/configuration.md).

``memory://``            in-process: budgets rebuilt from the ledger at start-up (the
                         embedded default); a ledger bounded to its newest rows
                         (``?max_rows=N``), nothing persisted (tests, benchmarks)
``sqlite:///rel/path``   a file relative to the working directory (parent created)
``sqlite:////abs/path``  an absolute path; the ledger's ``synchronous`` level follows
                         ``stores.ledger_durability`` (``?synchronous=`` overrides it)
``postgresql://…``       ledger shared by every replica; ``?schema=name`` picks a schema;
                         ``stores.ledger_durability`` sets ``synchronous_commit``
                         (``normal``: off; ``full``: the server's), as does
                         ``?synchronous_commit=`` (which overrides it)
``redis://…``            budgets shared by every replica (``quota_scope=global``);
                         ``?prefix=name`` namespaces the keys
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from ncap.config import LedgerDurability, utcnow
from ncap.domain.events import LedgerEvent
from ncap.errors import ConfigError
from ncap.stores._common import is_held, spent_totals
from ncap.stores._postgres import STORE_TIMEOUT_S, PostgresPool, postgres_target
from ncap.stores._sqlite import Synchronous, sqlite_version
from ncap.stores.base import (
    BudgetHistory,
    BudgetStore,
    DuplicateAttempt,
    Hold,
    HoldState,
    IdempotencyStore,
    ImportResult,
    LedgerStore,
    SpentTotal,
    hold_id_for,
)
from ncap.stores.idempotency import idempotency_for
from ncap.stores.instances import (
    Identity,
    InstanceRegistry,
    MemoryInstanceRegistry,
    PostgresInstanceRegistry,
    SQLiteInstanceRegistry,
)
from ncap.stores.memory_budget import MemoryBudgetStore
from ncap.stores.memory_ledger import DEFAULT_MAX_ROWS, MemoryLedgerStore
from ncap.stores.peers import PeerWatch
from ncap.stores.postgres_ledger import PostgresLedgerStore
from ncap.stores.redis_budget import SCRIPT_VERSION, RedisBudgetStore
from ncap.stores.sqlite_budget import SQLiteBudgetStore
from ncap.stores.sqlite_ledger import SQLiteLedgerStore

__all__ = [
    "BudgetHistory",
    "BudgetStore",
    "DuplicateAttempt",
    "Hold",
    "HoldState",
    "IdempotencyStore",
    "Identity",
    "ImportResult",
    "InstanceRegistry",
    "LedgerStore",
    "MemoryBudgetStore",
    "MemoryLedgerStore",
    "PeerWatch",
    "PostgresLedgerStore",
    "RedisBudgetStore",
    "SQLiteBudgetStore",
    "SQLiteLedgerStore",
    "budgets_from_url",
    "history_of",
    "hold_id_for",
    "idempotency_for",
    "instances_for",
    "ledger_from_url",
    "migrate_stores",
    "shared_between_processes",
    "sqlite_target",
]


_SYNCHRONOUS: dict[LedgerDurability, Synchronous] = {"normal": "NORMAL", "full": "FULL"}


def ledger_from_url(
    url: str, *, durability: LedgerDurability = "normal", timeout_s: float = STORE_TIMEOUT_S
) -> LedgerStore:
    """The ledger store ``url`` names; ``ConfigError`` for anything unusable."""
    scheme = _scheme(url, "ledger")
    if scheme == "memory":
        return MemoryLedgerStore(max_rows=_max_rows(url))
    if scheme == "sqlite":
        path, synchronous = sqlite_target(url, default=_SYNCHRONOUS[durability])
        return SQLiteLedgerStore(path, synchronous=synchronous)
    if scheme in ("postgresql", "postgres"):
        return PostgresLedgerStore(
            _checked(url, "ledger"), durability=durability, timeout_s=timeout_s
        )
    raise _unsupported(url, "ledger")


def budgets_from_url(
    url: str,
    *,
    gateway_instance: str = "local",
    clock: Callable[[], datetime] | None = None,
    history: BudgetHistory | None = None,
    timeout_s: float = STORE_TIMEOUT_S,
) -> BudgetStore:
    """The budget store ``url`` names; holds are tagged with ``gateway_instance``.
    In-process budgets given a ``history`` (the ledger) rebuild from it at start-up,
    Redis ones whenever Redis lost their counters; Redis keeps the server's time
    unless a ``clock`` is given (tests)."""
    scheme = _scheme(url, "budgets")
    if scheme == "memory":
        return MemoryBudgetStore(
            gateway_instance=gateway_instance, clock=clock or utcnow, history=history
        )
    if scheme == "sqlite":
        path, synchronous = sqlite_target(url)
        return SQLiteBudgetStore(
            path, gateway_instance=gateway_instance, clock=clock or utcnow, synchronous=synchronous
        )
    if scheme in ("redis", "rediss"):
        # the counters are a cache of the ledger: rebuilt from it when Redis lost them
        return RedisBudgetStore(
            url,
            gateway_instance=gateway_instance,
            clock=clock,
            history=history,
            connect_timeout_s=timeout_s,
            timeout_s=timeout_s,
            pool_timeout_s=timeout_s,
        )
    raise _unsupported(url, "budgets")


async def migrate_stores(ledger_url: str, budgets_url: str) -> dict[str, dict[str, object]]:
    """Open each store (which applies its pending migrations) and report its revision."""
    return {
        "ledger": await _migrate(ledger_url, "ledger"),
        "budgets": await _migrate(budgets_url, "budgets"),
    }


async def _migrate(url: str, store: str) -> dict[str, object]:
    scheme = _scheme(url, store)
    if scheme in ("postgresql", "postgres"):
        pool = PostgresPool(_checked(url, store), store=store)
        try:
            await pool.get()
            return {"backend": "postgresql", "version": pool.version}
        finally:
            await pool.close()
    if scheme == "sqlite":
        opened = ledger_from_url(url) if store == "ledger" else budgets_from_url(url)
        await opened.close()
        path = sqlite_target(url)[0]
        if store == "ledger":
            # a revision that rebuilds the table (7) drops the report's partial indexes
            # with it; made here too, so `ncap audit` run before the next start-up of a
            # gateway reads them instead of scanning
            from ncap.reports.indexes import ensure_report_indexes

            await asyncio.to_thread(ensure_report_indexes, path)
        return {"backend": "sqlite", "version": sqlite_version(path)}
    if scheme in ("redis", "rediss"):
        return {"backend": "redis", "version": SCRIPT_VERSION}
    return {"backend": scheme, "version": None}


def instances_for(ledger: LedgerStore) -> InstanceRegistry:
    """The heartbeat registry lives beside the ledger, the store every gateway shares."""
    if isinstance(ledger, PostgresLedgerStore):
        return PostgresInstanceRegistry(ledger.pool)
    if isinstance(ledger, SQLiteLedgerStore):
        return SQLiteInstanceRegistry(ledger.path)
    return MemoryInstanceRegistry()


def shared_between_processes(url: str) -> bool:
    """Whether several processes can share the store ``url`` names (not ``memory://``)."""
    return urlsplit(url).scheme.lower() != "memory"


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


def _max_rows(url: str) -> int:
    raw = parse_qs(urlsplit(url).query).get("max_rows", [str(DEFAULT_MAX_ROWS)])[-1]
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{url!r}: max_rows must be a positive integer")
    return int(raw)


def sqlite_target(url: str, *, default: Synchronous = "FULL") -> tuple[Path, Synchronous]:
    """``sqlite:///rel`` / ``sqlite:////abs`` -> (path, synchronous); creates the parent."""
    parts = urlsplit(url)
    if parts.netloc or not parts.path.startswith("/") or parts.path in ("/", "/:memory:"):
        raise ConfigError(
            f"{url!r}: use sqlite:///relative/path or sqlite:////absolute/path "
            "(memory:// for a store that is not persisted)"
        )
    path = Path(parts.path[1:])
    sync = parse_qs(parts.query).get("synchronous", [default])[-1].upper()
    if sync not in ("FULL", "NORMAL"):
        raise ConfigError(f"{url!r}: synchronous must be full or normal")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{url!r}: cannot create {path.parent}: {exc.strerror}") from exc
    return path, "FULL" if sync == "FULL" else "NORMAL"


def _scheme(url: str, store: str) -> str:
    scheme = urlsplit(url).scheme.lower()
    wrong = {"ledger": ("redis", "rediss"), "budgets": ("postgresql", "postgres")}[store]
    if scheme in wrong:
        raise ConfigError(f"stores.{store}: {scheme}:// is not a {store} store")
    return scheme


def _checked(url: str, store: str) -> str:
    try:
        postgres_target(url)
    except ValueError as exc:
        raise ConfigError(f"stores.{store}: {exc}") from exc
    return url


def _unsupported(url: str, store: str) -> ConfigError:
    return ConfigError(f"stores.{store}: unsupported store URL {url!r}")
