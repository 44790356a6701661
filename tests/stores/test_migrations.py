"""Schema migrations on SQLite and PostgreSQL: an empty database is brought to the
current revision; one at the previous revision is upgraded with its rows intact."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import asyncpg
import pytest
from typer.testing import CliRunner, Result

import ncap.stores.postgres_ledger as pg
import ncap.stores.sqlite_ledger as lite
from ncap.cli.main import app as cli
from ncap.domain.events import LEDGER_COLUMNS
from ncap.stores import PostgresLedgerStore, SQLiteLedgerStore
from ncap.stores._migrations import latest
from ncap.stores._postgres import migrate as pg_migrate
from ncap.stores._postgres import postgres_target
from ncap.stores._sqlite import migrate as sqlite_migrate
from tests.services import pg_database, pg_schema
from tests.stores.test_sqlite_ledger import FULL_EVENT, event

OLD_ROWS = [FULL_EVENT, event("req-2", state="reserved", gateway_instance="old-gw")]
# revision 3 added these (issue 13); rows written at revision 1 have none of them
ADDED_LATER = (
    "denied_by",
    "denied_limit",
    "denied_amount",
    "upstream_status",
    "client_retry_count",
    "output_tokens_per_choice",
)
REV1_COLUMNS = tuple(c for c in LEDGER_COLUMNS if c not in ADDED_LATER)


def _rev1_insert() -> str:
    cols = ", ".join(REV1_COLUMNS)
    arrays = ", ".join(f"${i}::{pg._TYPES.get(c, 'text')}[]" for i, c in enumerate(REV1_COLUMNS, 1))
    return f"INSERT INTO ledger_events ({cols}) SELECT * FROM unnest({arrays})"


def test_revisions_are_numbered_alike_on_both_dialects() -> None:
    assert latest("postgresql") == latest("sqlite") == 5
    assert [v for v, _ in lite.MIGRATIONS] == [1, 2, 3, 4, 5]


def _tables(path: Path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        conn.close()


async def test_sqlite_empty_file_to_current(tmp_path: Path) -> None:
    store = SQLiteLedgerStore(tmp_path / "l.db")
    await store.close()
    assert {"ledger_events", "gateway_instances", "schema_version"} <= _tables(tmp_path / "l.db")


async def test_sqlite_previous_revision_is_upgraded_with_rows_intact(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert sqlite_migrate(conn, lite.MIGRATIONS[:1]) == 1
        marks = ", ".join("?" * len(REV1_COLUMNS))
        insert = f"INSERT INTO ledger_events ({', '.join(REV1_COLUMNS)}) VALUES ({marks})"
        for row in OLD_ROWS:
            values = dict(zip(LEDGER_COLUMNS, lite._encode_row(row), strict=True))
            conn.execute(insert, [values[c] for c in REV1_COLUMNS])
    finally:
        conn.close()
    assert "gateway_instances" not in _tables(path)
    store = SQLiteLedgerStore(path)
    try:
        assert await store.get("req-1") == [FULL_EVENT]
        assert await store.get("req-2") == [OLD_ROWS[1]]
        assert await store.mark_lost("old-gw") == 1  # the new partial index is usable
    finally:
        await store.close()
    assert "gateway_instances" in _tables(path)
    result = await _ncap_migrate(_config(tmp_path, path))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ledger"] == {"backend": "sqlite", "version": 5}


async def _ncap_migrate(config: Path) -> Result:
    """``ncap migrate`` runs its own event loop, so off this test's loop."""
    return await asyncio.to_thread(CliRunner().invoke, cli, ["migrate", "--config", str(config)])


def _config(tmp: Path, ledger: Path | str) -> Path:
    url = ledger if isinstance(ledger, str) else f"sqlite:///{ledger}"
    cfg = tmp / "ncap.yaml"
    cfg.write_text(f"stores:\n  ledger: '{url}'\n  budgets: 'sqlite:///{tmp}/b.db'\n")
    return cfg


@pytest.mark.postgresql
async def test_postgres_empty_database_to_current(tmp_path: Path) -> None:
    async with pg_database() as url:
        result = await _ncap_migrate(_config(tmp_path, url))
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["ledger"] == {"backend": "postgresql", "version": 5}
        conn = await asyncpg.connect(url)
        try:
            tables = {
                r[0]
                for r in await conn.fetch(
                    "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
                )
            }
            versions = [
                r[0]
                for r in await conn.fetch("SELECT version FROM schema_version ORDER BY version")
            ]
        finally:
            await conn.close()
        assert {"ledger_events", "gateway_instances", "schema_version"} <= tables
        assert versions == [1, 2, 3, 4, 5]


@pytest.mark.postgresql
async def test_postgres_previous_revision_is_upgraded_with_rows_intact() -> None:
    async with pg_schema() as url:
        dsn, schema = postgres_target(url)
        conn = await asyncpg.connect(dsn, server_settings={"search_path": schema or "public"})
        try:
            assert await pg_migrate(conn, schema, target=1) == 1
            rows = [tuple(pg._encode(c, getattr(e, c)) for c in REV1_COLUMNS) for e in OLD_ROWS]
            await conn.fetch(_rev1_insert(), *zip(*rows, strict=True))
            assert await conn.fetchval("SELECT to_regclass('gateway_instances')") is None
        finally:
            await conn.close()
        # three gateways starting together: the advisory lock applies revision 2 once
        stores = [PostgresLedgerStore(url) for _ in range(3)]
        try:
            got = await asyncio.gather(*(s.get("req-1") for s in stores))
            assert got == [[FULL_EVENT]] * 3
            assert await stores[0].get("req-2") == [OLD_ROWS[1]]
            assert {s.pool.version for s in stores} == {5}
            assert await stores[0].mark_lost("old-gw") == 1
        finally:
            for s in stores:
                await s.close()
