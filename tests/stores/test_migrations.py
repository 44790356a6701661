"""Schema migrations on SQLite and PostgreSQL: an empty database is brought to the
current revision; one at an older revision (1, and 5: before the admin tables) is
upgraded with its rows intact; both dialects' admin tables have the same columns."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest
from typer.testing import CliRunner, Result

import ncap.stores.postgres.ledger as pg
import ncap.stores.sqlite.ledger as lite
from ncap.cli.main import app as cli
from ncap.config import ExceptionGrant
from ncap.domain.events import LEDGER_COLUMNS, LedgerEvent
from ncap.domain.grants import GrantChanges
from ncap.stores import PostgresLedgerStore, SQLiteLedgerStore
from ncap.stores._migrations import latest, migrations
from ncap.stores.ports import AdminChange
from ncap.stores.postgres.admin import PostgresAdminStore
from ncap.stores.postgres.pool import migrate as pg_migrate
from ncap.stores.postgres.pool import postgres_target
from ncap.stores.sqlite.admin import SQLITE_DDL, SQLiteAdminStore
from ncap.stores.sqlite.connection import migrate as sqlite_migrate
from tests.services import pg_database, pg_schema
from tests.stores.test_sqlite_ledger import FULL_EVENT, event

OLD_ROWS = [FULL_EVENT, event("req-2", state="reserved", gateway_instance="old-gw")]
# revisions 3 to 5 added these; rows written at revision 1 have none of them
ADDED_LATER = (
    "denied_by",
    "denied_limit",
    "denied_amount",
    "upstream_status",
    "client_retry_count",
    "output_tokens_per_choice",
    "candidates_compared",
    "candidates_distinct",
    "candidates_majority",
    "candidates_tool_calls",
)
REV1_COLUMNS = tuple(c for c in LEDGER_COLUMNS if c not in ADDED_LATER)
# revision 8 added the candidate evidence: rows written at revisions 5 to 7 lack it
REV7_COLUMNS = tuple(c for c in LEDGER_COLUMNS if not c.startswith("candidates_"))
# the store inserts only a row's filled columns; this statement fills every one
_EVERY_COLUMN = lite._insert_statement((True,) * len(LEDGER_COLUMNS))
ADMIN_TABLES = ("admin_grants", "admin_audit", "budget_alerts")
AT = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
GRANT = ExceptionGrant(
    id="eval", workload="w", owner="o", max_candidates=4, expires="2030-01-01T00:00:00Z"
)


def _rev1_insert(columns: tuple[str, ...] = REV1_COLUMNS) -> str:
    cols = ", ".join(columns)
    arrays = ", ".join(f"${i}::{pg._TYPES.get(c, 'text')}[]" for i, c in enumerate(columns, 1))
    return f"INSERT INTO ledger_events ({cols}) SELECT * FROM unnest({arrays})"


def _sqlite_rev7_insert(conn: sqlite3.Connection, row: LedgerEvent) -> None:
    values = dict(zip(LEDGER_COLUMNS, lite._encode_row(row), strict=True))
    marks = ", ".join("?" * len(REV7_COLUMNS))
    insert = f"INSERT INTO ledger_events ({', '.join(REV7_COLUMNS)}) VALUES ({marks})"
    conn.execute(insert, [values[c] for c in REV7_COLUMNS])


def test_revisions_are_numbered_alike_on_both_dialects() -> None:
    # each dialect's revisions are the files of its backend's migrations/ folder
    assert latest("postgresql") == 9
    assert [v for v, _ in migrations("postgresql")] == [v for v, _ in lite.MIGRATIONS]
    assert [v for v, _ in lite.MIGRATIONS] == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def _tables(path: Path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        conn.close()


async def test_sqlite_empty_file_to_current(tmp_path: Path) -> None:
    store = SQLiteLedgerStore(tmp_path / "l.db")
    await store.close()
    assert {"ledger_events", "gateway_instances", "schema_version", *ADMIN_TABLES} <= _tables(
        tmp_path / "l.db"
    )


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
    assert json.loads(result.stdout)["ledger"] == {"backend": "sqlite", "version": 9}


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
        assert json.loads(result.stdout)["ledger"] == {"backend": "postgresql", "version": 9}
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
        assert {"ledger_events", "gateway_instances", "schema_version", *ADMIN_TABLES} <= tables
        assert versions == [1, 2, 3, 4, 5, 6, 7, 8, 9]


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
            assert {s.pool.version for s in stores} == {9}
            assert await stores[0].mark_lost("old-gw") == 1
        finally:
            for s in stores:
                await s.close()


async def test_sqlite_revision_5_with_admin_tables_is_upgraded_with_their_rows_intact(
    tmp_path: Path,
) -> None:
    """Before revision 6 ``SQLiteAdminStore`` created the admin tables itself: a file at
    revision 5 may have them, with rows; revision 6 (``IF NOT EXISTS``) keeps them."""
    path = tmp_path / "l.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert sqlite_migrate(conn, lite.MIGRATIONS[:5]) == 5
    finally:
        conn.close()
    before = SQLiteAdminStore(path)
    await before.record(AdminChange("alice", "create", "exception", "eval", GRANT), AT)
    await before.close()
    store = SQLiteLedgerStore(path)
    await store.close()
    conn = sqlite3.connect(path)
    try:
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_version")]
    finally:
        conn.close()
    assert versions == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    after = SQLiteAdminStore(path)
    try:
        assert await after.changes() == GrantChanges(exceptions=(GRANT,))
        assert [(e.seq, e.actor) for e in await after.audit()] == [(1, "alice")]
    finally:
        await after.close()


@pytest.mark.postgresql
async def test_postgres_revision_5_is_upgraded_to_the_admin_tables_with_rows_intact() -> None:
    async with pg_schema() as url:
        dsn, schema = postgres_target(url)
        conn = await asyncpg.connect(dsn, server_settings={"search_path": schema or "public"})
        try:
            assert await pg_migrate(conn, schema, target=5) == 5
            rows = [tuple(pg._encode(c, getattr(e, c)) for c in REV7_COLUMNS) for e in OLD_ROWS]
            await conn.fetch(_rev1_insert(REV7_COLUMNS), *zip(*rows, strict=True))
            assert await conn.fetchval("SELECT to_regclass('admin_grants')") is None
        finally:
            await conn.close()
        # the admin store and the ledger opening together: revisions 6 to 8 applied once
        admin, store = PostgresAdminStore(url), PostgresLedgerStore(url)
        try:
            changes, got = await asyncio.gather(admin.changes(), store.get("req-1"))
            assert changes == GrantChanges() and got == [FULL_EVENT]
            assert await store.get("req-2") == [OLD_ROWS[1]]
            assert (admin.pool.version, store.pool.version) == (9, 9)
            assert await store.mark_lost("old-gw") == 1
            await admin.record(AdminChange("alice", "create", "exception", "eval", GRANT), AT)
            assert await admin.changes() == GrantChanges(exceptions=(GRANT,))
            versions = await admin.pool.fetch("SELECT version FROM schema_version ORDER BY 1")
            assert [r[0] for r in versions] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
        finally:
            await admin.close()
            await store.close()


@pytest.mark.postgresql
async def test_the_admin_tables_have_the_same_columns_on_both_dialects(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "a.db")
    try:
        conn.executescript(SQLITE_DDL)
        lite_columns = {
            t: [r[1] for r in conn.execute(f"PRAGMA table_info({t})")] for t in ADMIN_TABLES
        }
    finally:
        conn.close()
    async with pg_schema() as url:
        admin = PostgresAdminStore(url)
        try:
            await admin.audit()  # opens the pool: migrated
            pg_columns = {
                t: [
                    r[0]
                    for r in await admin.pool.fetch(
                        "SELECT column_name FROM information_schema.columns"
                        " WHERE table_schema = current_schema() AND table_name = $1"
                        " ORDER BY ordinal_position",
                        t,
                    )
                ]
                for t in ADMIN_TABLES
            }
        finally:
            await admin.close()
    assert pg_columns == lite_columns


def _ephemeral_tables(conn: sqlite3.Connection, sql: str) -> int:
    """How many ephemeral b-trees a statement's program builds each time it runs."""
    plan = conn.execute("EXPLAIN " + sql, [None] * sql.count("?")).fetchall()
    return sum(1 for op in plan if op[1] == "OpenEphemeral")


async def test_sqlite_writes_build_no_ephemeral_tables_after_revision_7(tmp_path: Path) -> None:
    """Revision 7 wrote the CHECK constraints as OR chains: an IN list in a CHECK makes
    SQLite build (and zero) an ephemeral b-tree at every INSERT and UPDATE."""
    path = tmp_path / "l.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert sqlite_migrate(conn, lite.MIGRATIONS[:6]) == 6
        update = (
            "UPDATE ledger_events SET state = ?, usage_source = ?, policy_result = ?"
            " WHERE request_id = ? AND attempt = ?"
        )
        rev7_insert = (
            f"INSERT INTO ledger_events ({', '.join(REV7_COLUMNS)})"
            f" VALUES ({', '.join('?' * len(REV7_COLUMNS))})"
        )
        assert _ephemeral_tables(conn, rev7_insert) == 2  # revision 6: the IN lists
        assert sqlite_migrate(conn, lite.MIGRATIONS) == 9
        assert _ephemeral_tables(conn, _EVERY_COLUMN) == 0
        assert _ephemeral_tables(conn, update) == 0
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            conn.execute(_EVERY_COLUMN, lite._encode_row(event("bad", state="bogus")))
    finally:
        conn.close()


async def test_sqlite_revision_6_is_rebuilt_with_rows_and_indexes_intact(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert sqlite_migrate(conn, lite.MIGRATIONS[:6]) == 6
        for row in OLD_ROWS:
            _sqlite_rev7_insert(conn, row)
        indexes = "SELECT name, sql FROM sqlite_master WHERE type = 'index' ORDER BY name"
        before = conn.execute(indexes).fetchall()
    finally:
        conn.close()
    store = SQLiteLedgerStore(path)
    try:
        assert await store.get("req-1") == [FULL_EVENT]
        assert await store.get("req-2") == [OLD_ROWS[1]]
        assert await store.mark_lost("old-gw") == 1
    finally:
        await store.close()
    conn = sqlite3.connect(path)
    try:
        after = conn.execute(indexes).fetchall()
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        conn.close()
    # the same indexes (whitespace aside), on the rebuilt table; the provider id's now
    # leaves out the rows without one; revision 9 keeps the state of unsettled rows only
    partial = " WHERE provider_request_id IS NOT NULL"
    replaced = ("ledger_events_state", "ledger_events_unsettled_instance")
    unsettled = (
        "ledger_events_unsettled",
        "CREATE INDEX ledger_events_unsettled ON ledger_events (state) WHERE state <> 'settled'",
    )
    expected = sorted(
        [
            (n, " ".join((q or "").split()) + (partial if n.endswith("_request_id") else ""))
            for n, q in before
            if n not in replaced
        ]
        + [unsettled]
    )
    assert [(n, " ".join((q or "").split())) for n, q in after] == expected
    conn = sqlite3.connect(path)
    try:
        lookup = "SELECT * FROM ledger_events WHERE provider_request_id = ?"
        plan = conn.execute("EXPLAIN QUERY PLAN " + lookup, ("x",)).fetchall()
    finally:
        conn.close()
    assert "USING INDEX ledger_events_provider_request_id" in plan[-1][-1]


@pytest.mark.postgresql
async def test_postgres_revision_7_indexes_only_rows_with_a_provider_id() -> None:
    async with pg_schema() as url:
        store = PostgresLedgerStore(url)
        try:
            await store.append(FULL_EVENT)
            await store.append(event("req-2", state="reserved"))  # no provider id yet
            [row] = await store.pool.fetch(
                "SELECT indexdef FROM pg_indexes"
                " WHERE indexname = 'ledger_events_provider_request_id'"
                " AND schemaname = current_schema()"
            )
            assert row[0].endswith("WHERE (provider_request_id IS NOT NULL)"), row[0]
            pool = await store.pool.get()
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SET LOCAL enable_seqscan = off")
                plan = await conn.fetch(
                    "EXPLAIN SELECT * FROM ledger_events WHERE provider_request_id = ANY($1)",
                    [FULL_EVENT.provider_request_id],
                )
            assert any("ledger_events_provider_request_id" in r[0] for r in plan), plan
        finally:
            await store.close()


async def test_ncap_migrate_remakes_the_report_indexes_revision_7_drops(tmp_path: Path) -> None:
    """Revision 7 rebuilds the table, which drops the report's partial indexes with it;
    ``ncap migrate`` makes them again, so an audit run before the next gateway start-up
    reads them instead of scanning."""
    from ncap.stores.sqlite.report_indexes import (
        EXCEPTION_INDEX,
        PER_CHOICE_INDEX,
        ensure_report_indexes,
    )

    path = tmp_path / "l.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert sqlite_migrate(conn, lite.MIGRATIONS[:6]) == 6
    finally:
        conn.close()
    ensure_report_indexes(path)  # as a gateway at revision 6 made them
    assert {EXCEPTION_INDEX, PER_CHOICE_INDEX} <= _indexes(path)
    result = await _ncap_migrate(_config(tmp_path, path))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ledger"] == {"backend": "sqlite", "version": 9}
    assert {EXCEPTION_INDEX, PER_CHOICE_INDEX} <= _indexes(path)


def _indexes(path: Path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'").fetchall()
    finally:
        conn.close()
    return {name for (name,) in rows}
