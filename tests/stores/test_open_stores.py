"""open_stores: every port opened once from the two URLs, and the gateway built on them."""

from __future__ import annotations

from pathlib import Path

import pytest

from ncap.errors import ConfigError
from ncap.http.admin import ADMIN_STORE
from ncap.http.app import ACCOUNTING, GATEWAY, PEERS, STORES, create_app
from ncap.stores import (
    MemoryBudgetStore,
    MemoryLedgerStore,
    SQLiteBudgetStore,
    SQLiteLedgerStore,
    StoreOptions,
    backend_name,
    open_stores,
)
from ncap.stores.memory.idempotency import MemoryIdempotency
from ncap.stores.sqlite.admin import SQLiteAdminStore
from ncap.stores.sqlite.idempotency import SQLiteIdempotency
from ncap.stores.sqlite.instances import SQLiteInstanceRegistry
from tests.support import gateway_config


async def test_sqlite_urls_open_every_port_beside_their_files(tmp_path: Path) -> None:
    stores = open_stores(
        f"sqlite:///{tmp_path}/l.db", f"sqlite:///{tmp_path}/b.db", StoreOptions("g1")
    )
    try:
        assert isinstance(stores.ledger, SQLiteLedgerStore)
        assert isinstance(stores.budgets, SQLiteBudgetStore)
        assert isinstance(stores.admin, SQLiteAdminStore)
        assert stores.admin.path == tmp_path / "l.db"
        assert isinstance(stores.instances, SQLiteInstanceRegistry)
        assert isinstance(stores.idempotency, SQLiteIdempotency)
        assert stores.shared and stores.backends == {"ledger": "sqlite", "budgets": "sqlite"}
        await stores.prepare(["w"])  # nothing to make whole beside a SQLite file
    finally:
        await stores.close()


async def test_memory_urls_are_not_shared_and_keep_no_report(tmp_path: Path) -> None:
    stores = open_stores("memory://", "memory://", StoreOptions())
    assert isinstance(stores.ledger, MemoryLedgerStore)
    assert isinstance(stores.budgets, MemoryBudgetStore)
    assert isinstance(stores.idempotency, MemoryIdempotency)
    assert not stores.shared
    with pytest.raises(ConfigError, match="memory:// ledger is gone"):
        stores.report_source()
    await stores.close()


def test_an_unknown_scheme_is_a_configuration_error() -> None:
    unknown = r"^stores\.ledger: unsupported store URL scheme 'mysql' \("
    with pytest.raises(ConfigError, match=unknown):
        open_stores("mysql://x", "memory://", StoreOptions())
    with pytest.raises(ConfigError, match=r"^stores\.budgets: postgresql:// is not a budgets"):
        open_stores("memory://", "postgresql://h/db", StoreOptions())
    assert backend_name("postgres://h/db") == "postgresql"
    assert backend_name("rediss://h") == "redis"
    assert backend_name("mysql://x") == "mysql"


async def test_the_gateway_runs_on_the_stores_it_is_given(tmp_path: Path) -> None:
    config = gateway_config("http://127.0.0.1:9", tmp_path)
    stores = open_stores("memory://", "memory://", StoreOptions("given"))
    app = create_app(config, instance_id="given", stores=stores)
    assert app[STORES] is stores
    assert app[ADMIN_STORE] is stores.admin
    assert app[ACCOUNTING].budgets is stores.budgets
    records = app[GATEWAY]._idempotency  # the lifecycle's service over the records port
    assert records is not None and records._store is stores.idempotency
    assert app[PEERS].registry is stores.instances
    await stores.close()
