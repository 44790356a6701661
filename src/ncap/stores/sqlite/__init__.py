"""SQLite stores: one file per store, shared by the processes of one host.

``sqlite:///rel/path`` is relative to the working directory (parent created),
``sqlite:////abs/path`` absolute. The ledger's file also holds the instance registry,
the admin tables and the report's indexes; the budgets' file the ``Idempotency-Key``
records. The ledger's ``synchronous`` level follows ``stores.ledger_durability``
(``?synchronous=`` overrides it). The schema of each file: ``migrations/``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from ncap.config import LedgerDurability, utcnow
from ncap.errors import ConfigError
from ncap.stores._common import history_of
from ncap.stores.ports import (
    AdminStore,
    Backend,
    BudgetHistory,
    BudgetSide,
    LedgerSide,
    LedgerSource,
    StoreOptions,
)
from ncap.stores.sqlite.admin import SQLiteAdminStore
from ncap.stores.sqlite.budgets import SQLiteBudgetStore
from ncap.stores.sqlite.connection import Synchronous, sqlite_version
from ncap.stores.sqlite.idempotency import SQLiteIdempotency
from ncap.stores.sqlite.instances import SQLiteInstanceRegistry
from ncap.stores.sqlite.ledger import SQLiteLedgerStore
from ncap.stores.sqlite.report_indexes import ensure_report_indexes
from ncap.stores.sqlite.report_source import SQLiteSource

__all__ = ["BACKEND", "sqlite_target"]

_SYNCHRONOUS: dict[LedgerDurability, Synchronous] = {"normal": "NORMAL", "full": "FULL"}


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


def open_ledger(url: str, options: StoreOptions) -> LedgerSide:
    path, synchronous = sqlite_target(url, default=_SYNCHRONOUS[options.durability])
    ledger = SQLiteLedgerStore(path, synchronous=synchronous)
    return LedgerSide(ledger, SQLiteInstanceRegistry(ledger.path), history_of(ledger))


def open_budgets(url: str, options: StoreOptions, history: BudgetHistory | None) -> BudgetSide:
    path, synchronous = sqlite_target(url)
    budgets = SQLiteBudgetStore(
        path,
        gateway_instance=options.gateway_instance,
        clock=options.clock or utcnow,
        synchronous=synchronous,
    )
    return BudgetSide(budgets, SQLiteIdempotency(budgets))


def open_admin(url: str, create: bool) -> AdminStore | None:
    """The admin tables in the ledger's file; without ``create``, only a file that exists."""
    path = sqlite_target(url)[0]
    return SQLiteAdminStore(path) if create or path.exists() else None


def open_report_source(url: str) -> LedgerSource:
    return SQLiteSource(sqlite_target(url)[0])


async def report_indexes(url: str) -> None:
    await asyncio.to_thread(ensure_report_indexes, sqlite_target(url)[0])


async def migrate(url: str, store: str) -> dict[str, object]:
    """Opening a store migrates its file. A revision that rebuilds the ledger table (7)
    drops the report's partial indexes with it: made again here, so that ``ncap audit``
    run before the next start-up of a gateway reads them instead of scanning."""
    if store == "ledger":
        await open_ledger(url, StoreOptions()).ledger.close()
        await report_indexes(url)
    else:
        await open_budgets(url, StoreOptions(), None).budgets.close()
    return {"backend": "sqlite", "version": sqlite_version(sqlite_target(url)[0])}


BACKEND = Backend(
    "sqlite",
    shared=True,
    ledger=open_ledger,
    budgets=open_budgets,
    admin=open_admin,
    report_source=open_report_source,
    report_indexes=report_indexes,
    migrate=migrate,
)
