"""The SQLite ledger's journal of reserved rows: durable before the table has them, and
recovered from a process that ended without closing its ledger (sqlite/journal.py)."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest

from ncap.domain.events import LEDGER_COLUMNS, LedgerEvent
from ncap.stores import SQLiteLedgerStore
from ncap.stores.sqlite import journal as journal_module
from ncap.stores.sqlite.journal import SUFFIX


def _event(request_id: str, attempt: int = 1, **fields: object) -> LedgerEvent:
    return LedgerEvent(
        datetime.now(UTC),
        request_id,
        attempt,
        "wl",
        "prod",
        route_id="r",
        model_alias="m",
        reserved_input_tokens=10,
        reserved_output_tokens=20,
        reserved_cost_micros=30,
        gateway_instance="gw-a",
        **fields,  # type: ignore[arg-type]
    )


def _table(path: Path, sql: str = "SELECT request_id, state FROM ledger_events") -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return sorted(conn.execute(sql).fetchall())
    finally:
        conn.close()


def _journals(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}{SUFFIX}*"))


def _crash_after_appending(path: Path, ids: list[str]) -> None:
    """Another process appends reserved rows and dies before any commit: the rows are
    in its journal only."""
    code = textwrap.dedent(
        f"""
        import asyncio, os
        from datetime import UTC, datetime
        from ncap.domain.events import LedgerEvent
        from ncap.stores import SQLiteLedgerStore

        async def main():
            store = SQLiteLedgerStore({str(path)!r})
            for rid in {ids!r}:
                await store.append_reserved(LedgerEvent(
                    datetime.now(UTC), rid, 1, "wl", "prod", gateway_instance="gw-dead"))
            os._exit(0)  # no close, no commit: as kill -9 would leave it

        asyncio.run(main())
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_a_reserved_row_is_in_the_journal_before_the_table_and_then_in_the_table(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    store = SQLiteLedgerStore(path)
    try:
        await store.append_reserved(_event("req-1"))
        [journal] = _journals(path)
        lines = journal.read_bytes().splitlines()
        assert msgspec.json.decode(lines[0]) == list(LEDGER_COLUMNS)
        assert msgspec.json.decode(lines[1])[1] == "req-1"
        assert _table(path) == []  # its INSERT rides along with a later commit
        [row] = await store.get("req-1")  # a read commits what is queued first
        assert row.state == "reserved"
        assert _table(path) == [("req-1", "reserved")]
        for _ in range(5):  # the INSERT's done-callback empties the file
            await asyncio.sleep(0)
        assert journal.read_bytes() == b""
        await store.update("req-1", 1, state="settled", cost_micros=25)
        await store.append_reserved(_event("req-2"))
        await asyncio.sleep(0.05)  # past the ride-along bound: committed on its own
        assert _table(path) == [("req-1", "settled"), ("req-2", "reserved")]
    finally:
        await store.close()
    assert _journals(path) == []  # removed when the ledger closes


async def test_rows_of_a_process_killed_before_its_commit_are_recovered_at_the_next_open(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    await SQLiteLedgerStore(path).close()  # the file and its schema
    _crash_after_appending(path, ["req-a", "req-b", "req-c"])
    assert len(_journals(path)) == 1
    store = SQLiteLedgerStore(path)
    try:
        rows = _table(path, "SELECT request_id, state, gateway_instance FROM ledger_events")
        assert rows == [
            ("req-a", "reserved", "gw-dead"),
            ("req-b", "reserved", "gw-dead"),
            ("req-c", "reserved", "gw-dead"),
        ]
        # recovered rows are ordinary in-flight rows: recovery marks them lost
        assert await store.mark_lost("gw-dead") == 3
    finally:
        await store.close()


async def test_a_live_ledgers_journal_is_left_to_it(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    first = SQLiteLedgerStore(path)
    try:
        await first.append_reserved(_event("req-live"))
        second = SQLiteLedgerStore(path)  # opens while the first's row is journal-only
        try:
            assert _table(path) == []  # not recovered: its owner is alive
            await asyncio.sleep(0.05)  # the owner's own commit
            assert _table(path) == [("req-live", "reserved")]
        finally:
            await second.close()
    finally:
        await first.close()
    assert _journals(path) == []


async def test_a_sweep_recovers_a_dead_peers_journal_before_marking_rows_lost(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    store = SQLiteLedgerStore(path)  # opened before the peer dies: nothing to recover yet
    try:
        _crash_after_appending(path, ["req-p"])
        assert _table(path) == []
        assert await store.mark_lost("gw-dead") == 1
        assert _table(
            path, "SELECT request_id, state, reconciliation_reason FROM ledger_events"
        ) == [("req-p", "usage_reconciliation_required", "gateway_lost")]
    finally:
        await store.close()
    assert _journals(path) == []


async def test_recovery_keeps_a_row_settled_since_and_skips_a_line_cut_short(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    store = SQLiteLedgerStore(path)
    try:
        await store.append_reserved(_event("req-s"))
        await store.update("req-s", 1, state="settled", cost_micros=25)
        journal = _journals(path)[0]
    finally:
        await store.close()
    # a journal left behind holding that row as reserved, another row, and a last
    # line an OS crash cut short
    reserved = list(msgspec.structs.astuple(_event("req-s")))
    other = list(msgspec.structs.astuple(_event("req-t")))
    for row in (reserved, other):
        row[0] = "2026-12-05T00:00:00.000000Z"
        row[LEDGER_COLUMNS.index("finish_reasons")] = "{}"
        row[LEDGER_COLUMNS.index("stream_mode")] = 0
    cut = msgspec.json.encode(other)[:-9]
    journal.write_bytes(
        msgspec.json.encode(list(LEDGER_COLUMNS))
        + b"\n"
        + msgspec.json.encode(reserved)
        + b"\n"
        + msgspec.json.encode(other)
        + b"\n"
        + cut
    )
    store = SQLiteLedgerStore(path)
    try:
        assert _table(path) == [("req-s", "settled"), ("req-t", "reserved")]
    finally:
        await store.close()


async def test_at_full_durability_a_reserved_row_is_committed_before_it_returns(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    store = SQLiteLedgerStore(path, synchronous="FULL")
    try:
        await store.append_reserved(_event("req-f"))
        assert _journals(path) == []
        assert _table(path) == [("req-f", "reserved")]
    finally:
        await store.close()


async def test_under_steady_load_the_journal_moves_on_to_new_files_and_removes_old_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "ROTATE_BYTES", 300)
    path = tmp_path / "ledger.db"
    store = SQLiteLedgerStore(path)
    try:
        # rows keep coming while the earlier ones are still on their way to the table
        for i in range(12):
            await store.append_reserved(_event(f"req-{i:02d}"))
        assert len(_journals(path)) > 2
        await store.get("req-00")  # everything queued is committed
        for _ in range(5):  # the INSERTs' done-callbacks
            await asyncio.sleep(0)
        [left] = _journals(path)
        assert left.read_bytes() == b""
        assert [rid for rid, _ in _table(path)] == [f"req-{i:02d}" for i in range(12)]
    finally:
        await store.close()
    assert _journals(path) == []
