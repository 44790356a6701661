"""``output_tokens_per_choice``: written, updated and read back by the SQLite and the
memory ledger; a version-1 SQLite file is migrated in place (old rows read as None)."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ncap.domain.events import LedgerEvent
from ncap.stores import LedgerStore, MemoryLedgerStore, SQLiteLedgerStore
from ncap.stores.sqlite.connection import SQLiteWriter
from ncap.stores.sqlite.ledger import MIGRATIONS

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def _store(kind: str, tmp: Path) -> LedgerStore:
    return SQLiteLedgerStore(tmp / "l.db") if kind == "sqlite" else MemoryLedgerStore()


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
async def test_round_trip(kind: str, tmp_path: Path) -> None:
    store = _store(kind, tmp_path)
    try:
        await store.append(LedgerEvent(NOW, "r1", 1, "w", "e"))
        await store.append(LedgerEvent(NOW, "r2", 1, "w", "e", output_tokens_per_choice=(3,)))
        await store.update("r1", 1, output_tokens_per_choice=(12, 40, 7), state="settled")
        [r1] = await store.get("r1")
        [r2] = await store.get("r2")
        assert r1.output_tokens_per_choice == (12, 40, 7)
        assert r2.output_tokens_per_choice == (3,)
        await store.update("r2", 1, output_tokens_per_choice=None)
        assert (await store.get("r2"))[0].output_tokens_per_choice is None
    finally:
        await store.close()


async def test_stored_as_plain_text_and_old_files_migrate(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    writer = SQLiteWriter(path, MIGRATIONS[:1])  # a ledger made before the column
    await writer.close()
    conn = sqlite3.connect(path)
    conn.execute(
        "INSERT INTO ledger_events (timestamp, request_id, attempt, workload_id, environment,"
        " effective_candidate_count, reserved_input_tokens, reserved_output_tokens,"
        " reserved_cost_micros, finish_reasons, stream_mode, usage_source, quota_scope,"
        " policy_result, policy_reason, state, gateway_instance) VALUES"
        " ('2026-12-01T09:00:00.000000Z', 'old', 1, 'w', 'e', 1, 0, 0, 0, '{}', 0, 'none',"
        " 'instance', 'allow', 'within_default', 'settled', 'g')"
    )
    conn.commit()
    conn.close()
    store = SQLiteLedgerStore(path)
    try:
        assert (await store.get("old"))[0].output_tokens_per_choice is None
        await store.append(LedgerEvent(NOW, "new", 1, "w", "e", output_tokens_per_choice=(5, 6)))
    finally:
        await store.close()
    with sqlite3.connect(path) as conn:
        cell = conn.execute(
            "SELECT output_tokens_per_choice FROM ledger_events WHERE request_id = 'new'"
        ).fetchone()
    assert cell == ("5,6",)
