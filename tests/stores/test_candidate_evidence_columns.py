"""The ``candidates_*`` evidence columns: written, updated and read back by every
ledger; a database at the revision before them (7) is migrated in place, its rows
intact and reading None, on both dialects; the stored values are plain integers."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

import ncap.stores.sqlite.ledger as lite
from ncap.domain.events import LedgerEvent
from ncap.stores import LedgerStore, MemoryLedgerStore, PostgresLedgerStore, SQLiteLedgerStore
from ncap.stores.postgres.pool import migrate as pg_migrate
from ncap.stores.postgres.pool import postgres_target
from ncap.stores.sqlite.connection import migrate as sqlite_migrate
from tests.services import pg_schema

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
COLUMNS = (
    "candidates_compared",
    "candidates_distinct",
    "candidates_majority",
    "candidates_tool_calls",
)
EVIDENCE = {
    "candidates_compared": 5,
    "candidates_distinct": 3,
    "candidates_majority": 3,
    "candidates_tool_calls": 1,
}


@pytest.fixture(
    params=["memory", "sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)]
)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LedgerStore]:
    if request.param == "memory":
        ledger: LedgerStore = MemoryLedgerStore()
        yield ledger
        return
    if request.param == "sqlite":
        ledger = SQLiteLedgerStore(tmp_path / "l.db")
        try:
            yield ledger
        finally:
            await ledger.close()
        return
    async with pg_schema() as url:
        ledger = PostgresLedgerStore(url)
        try:
            yield ledger
        finally:
            await ledger.close()


async def test_round_trip(store: LedgerStore) -> None:
    await store.append(LedgerEvent(NOW, "r1", 1, "w", "e"))
    await store.append(LedgerEvent(NOW, "r2", 1, "w", "e", **EVIDENCE))
    await store.update("r1", 1, state="settled", **EVIDENCE)
    [r1], [r2] = await store.get("r1"), await store.get("r2")
    assert {c: getattr(r1, c) for c in COLUMNS} == EVIDENCE
    assert {c: getattr(r2, c) for c in COLUMNS} == EVIDENCE
    exported = [e async for e in store.export()]
    assert {c: getattr(exported[0], c) for c in COLUMNS} == EVIDENCE


def _old_row(request_id: str) -> LedgerEvent:
    return LedgerEvent(NOW, request_id, 1, "w", "e", state="settled", returned_candidate_count=5)


async def test_sqlite_revision_7_is_upgraded_with_rows_intact(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert sqlite_migrate(conn, lite.MIGRATIONS[:7]) == 7
        columns = [r[1] for r in conn.execute("PRAGMA table_info(ledger_events)")]
        assert not set(COLUMNS) & set(columns)
        old = _old_row("old")
        values = dict(zip(lite.LEDGER_COLUMNS, lite._encode_row(old), strict=True))
        marks = ", ".join("?" * len(columns))
        conn.execute(
            f"INSERT INTO ledger_events ({', '.join(columns)}) VALUES ({marks})",
            [values[c] for c in columns],
        )
    finally:
        conn.close()
    store = SQLiteLedgerStore(path)
    try:
        assert await store.get("old") == [_old_row("old")]
        await store.update("old", 1, **EVIDENCE)
    finally:
        await store.close()
    with sqlite3.connect(path) as conn:
        cells = conn.execute(f"SELECT {', '.join(COLUMNS)} FROM ledger_events").fetchone()
        types = conn.execute(
            f"SELECT {', '.join(f'typeof({c})' for c in COLUMNS)} FROM ledger_events"
        ).fetchone()
    assert cells == (5, 3, 3, 1)
    assert set(types) == {"integer"}


@pytest.mark.postgresql
async def test_postgres_revision_7_is_upgraded_with_rows_intact() -> None:
    async with pg_schema() as url:
        dsn, schema = postgres_target(url)
        conn = await asyncpg.connect(dsn, server_settings={"search_path": schema or "public"})
        try:
            assert await pg_migrate(conn, schema, target=7) == 7
            await conn.execute(
                "INSERT INTO ledger_events (timestamp, request_id, attempt, workload_id,"
                " environment, effective_candidate_count, returned_candidate_count,"
                " reserved_input_tokens, reserved_output_tokens, reserved_cost_micros,"
                " finish_reasons, stream_mode, usage_source, quota_scope, policy_result,"
                " policy_reason, state, gateway_instance) VALUES ($1, 'old', 1, 'w', 'e', 1,"
                " 5, 0, 0, 0, '{}', false, 'none', 'instance', 'allow', 'within_default',"
                " 'settled', '')",
                NOW,
            )
        finally:
            await conn.close()
        store = PostgresLedgerStore(url)
        try:
            assert await store.get("old") == [_old_row("old")]
            await store.update("old", 1, **EVIDENCE)
            [row] = await store.get("old")
            assert {c: getattr(row, c) for c in COLUMNS} == EVIDENCE
            assert store.pool.version == 9
        finally:
            await store.close()
        conn = await asyncpg.connect(dsn, server_settings={"search_path": schema or "public"})
        try:
            types = await conn.fetch(
                "SELECT data_type FROM information_schema.columns WHERE table_name ="
                " 'ledger_events' AND column_name LIKE 'candidates_%' AND table_schema = $1",
                schema or "public",
            )
        finally:
            await conn.close()
        assert [r[0] for r in types] == ["integer"] * 4
