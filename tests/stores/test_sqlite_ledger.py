"""The LedgerStore contract (every backend) and the SQLite ledger's durability."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import textwrap
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import ncap.stores.sqlite.connection as sqlite_plumbing
import ncap.stores.sqlite.ledger as ledger_module
from ncap.config import Pricing
from ncap.domain.events import LEDGER_COLUMNS, LedgerEvent, ReconciliationRow
from ncap.stores import DuplicateAttempt, LedgerStore, SQLiteLedgerStore

T0 = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
PRICING = {"primary-chat": Pricing(input_per_mtok=0.15, output_per_mtok=0.60)}


def event(request_id: str = "req-1", attempt: int = 0, **kw: Any) -> LedgerEvent:
    base: dict[str, Any] = {
        "timestamp": T0,
        "request_id": request_id,
        "attempt": attempt,
        "workload_id": "support-eval",
        "environment": "production",
        "route_id": "primary-chat",
        "model_alias": "approved-standard",
        "upstream_model": "gpt-4o-mini",
        "requested_candidate_count": 4,
        "effective_candidate_count": 4,
        "exception_id": "eval-q4",
        "reserved_input_tokens": 100,
        "reserved_output_tokens": 2048,
        "reserved_cost_micros": 1244,
        "stream_mode": True,
        "quota_scope": "host",
        "policy_reason": "within_exception",
        "gateway_instance": "g1",
    }
    return LedgerEvent(**(base | kw))


FULL_EVENT = event(
    provider_request_id="chatcmpl-9",
    returned_candidate_count=4,
    input_tokens=98,
    cached_input_tokens=64,
    output_tokens_total=1999,
    reasoning_tokens=0,
    total_tokens=2097,
    cost_micros=1215,
    finish_reasons={"stop": 3, "length": 1},
    usage_source="provider_stream",
    state="settled",
    latency_ms=812.5,
)


# --- contract: every backend ---------------------------------------------------------


async def test_append_get_roundtrips_every_column(ledger: LedgerStore) -> None:
    await ledger.append(FULL_EVENT)
    await ledger.append(event(requested_candidate_count=None, attempt=1, stream_mode=False))
    got = await ledger.get("req-1")
    assert got[0] == FULL_EVENT
    assert got[0].timestamp.tzinfo is not None and got[1].requested_candidate_count is None
    assert got[1].stream_mode is False and got[1].finish_reasons == {}
    assert await ledger.get("nope") == []


DENIED_EVENT = event(
    "req-d",
    state="denied",
    policy_result="deny",
    policy_reason="budget_exhausted",
    denied_by="tokens_day",
    denied_limit=1200,
    denied_amount=318,
)


async def test_denial_details_and_upstream_status_roundtrip(ledger: LedgerStore) -> None:
    await ledger.append(DENIED_EVENT)
    await ledger.append(event("req-a"))
    (denied,) = await ledger.get("req-d")
    assert denied == DENIED_EVENT
    (allowed,) = await ledger.get("req-a")
    assert (allowed.denied_by, allowed.denied_limit, allowed.denied_amount) == (None, None, None)
    await ledger.update("req-a", 0, state="settled", upstream_status=500)
    assert (await ledger.get("req-a"))[0].upstream_status == 500


async def test_every_attempt_is_its_own_row_and_never_overwritten(ledger: LedgerStore) -> None:
    await ledger.append(event(attempt=0, state="usage_reconciliation_required"))
    await ledger.append(event(attempt=1, route_id="secondary-chat", state="settled"))
    with pytest.raises(DuplicateAttempt):
        await ledger.append(event(attempt=0, state="settled"))
    got = await ledger.get("req-1")
    assert [(e.attempt, e.state) for e in got] == [
        (0, "usage_reconciliation_required"),
        (1, "settled"),
    ]


async def test_update(ledger: LedgerStore) -> None:
    await ledger.append(event())
    await ledger.update(
        "req-1",
        0,
        state="settled",
        input_tokens=90,
        finish_reasons={"stop": 4},
        stream_mode=False,
        timestamp=T0 + timedelta(seconds=1),
    )
    (got,) = await ledger.get("req-1")
    assert (got.state, got.input_tokens, got.finish_reasons, got.stream_mode) == (
        "settled",
        90,
        {"stop": 4},
        False,
    )
    assert got.timestamp == T0 + timedelta(seconds=1)
    with pytest.raises(KeyError):
        await ledger.update("req-1", 7, state="settled")
    with pytest.raises(ValueError):
        await ledger.update("req-1", 0, prompt="never stored")
    with pytest.raises(ValueError):
        await ledger.update("req-1", 0, request_id="other")


async def test_update_many_writes_each_row_as_update_would(ledger: LedgerStore) -> None:
    for request_id in ("req-1", "req-2", "req-3"):
        await ledger.append(event(request_id))
    later = T0 + timedelta(seconds=1)
    await ledger.update_many(
        [
            ("req-1", 0, {"state": "settled", "input_tokens": 90, "finish_reasons": {"stop": 4}}),
            ("req-2", 0, {"state": "pending", "timestamp": later}),
            ("req-3", 0, {}),
        ]
    )
    one, two, three = [(await ledger.get(r))[0] for r in ("req-1", "req-2", "req-3")]
    assert (one.state, one.input_tokens, one.finish_reasons) == ("settled", 90, {"stop": 4})
    assert (two.state, two.timestamp, two.input_tokens) == ("pending", later, None)
    assert three == event("req-3")
    await ledger.update_many([("req-2", 0, {"state": "settled"})])  # one row alone
    assert (await ledger.get("req-2"))[0].state == "settled"
    with pytest.raises(KeyError):  # a missing row fails the call
        await ledger.update_many(
            [("req-3", 0, {"state": "settled"}), ("req-9", 0, {"state": "settled"})]
        )
    with pytest.raises(KeyError):
        await ledger.update_many([("req-9", 0, {"state": "settled"})])
    with pytest.raises(ValueError):
        await ledger.update_many([("req-1", 0, {"prompt": "never stored"})])
    # the batch applied again row by row (the settlement's retry) gives the same rows
    for request_id, attempt, fields in [("req-1", 0, {"state": "settled", "input_tokens": 90})]:
        await ledger.update(request_id, attempt, **fields)
    assert (await ledger.get("req-1"))[0] == one


async def test_export_is_ordered_and_bounded(ledger: LedgerStore) -> None:
    for i in range(5):
        await ledger.append(event(f"req-{4 - i}", timestamp=T0 + timedelta(minutes=4 - i)))
    everything = [e.request_id async for e in ledger.export()]
    assert everything == [f"req-{i}" for i in range(5)]
    window = ledger.export(since=T0 + timedelta(minutes=1), until=T0 + timedelta(minutes=3))
    assert [e.request_id async for e in window] == ["req-1", "req-2"]


async def test_pending_lists_what_awaits_reconciliation(ledger: LedgerStore) -> None:
    states = ["reserved", "settled", "pending", "usage_reconciliation_required", "denied"]
    for i, state in enumerate(states):
        await ledger.append(event(f"req-{i}", state=state))
    assert [e.state for e in await ledger.pending()] == ["pending", "usage_reconciliation_required"]


async def test_rows_reserved_past_their_time_limit_are_listed_then_swept(
    ledger: LedgerStore,
) -> None:
    """A row left ``reserved`` (whatever the cause) shows in the pending list once it is
    older than the limit, and the sweep turns it into a visible reserved_timeout row."""
    await ledger.append(event("old", gateway_instance="g1"))
    await ledger.append(event("new", gateway_instance="g1", timestamp=T0 + timedelta(hours=1)))
    await ledger.append(event("p", state="pending"))
    limit = T0 + timedelta(minutes=30)
    assert [e.request_id for e in await ledger.pending()] == ["p"]
    assert [e.request_id for e in await ledger.pending(limit)] == ["old", "p"]
    assert await ledger.mark_lost(None, before=limit, reason="reserved_timeout") == 1
    (old,) = await ledger.get("old")
    assert (old.state, old.reconciliation_reason) == (
        "usage_reconciliation_required",
        "reserved_timeout",
    )
    assert (await ledger.get("new"))[0].state == "reserved"
    assert [e.request_id for e in await ledger.pending(limit)] == ["old", "p"]


async def test_mark_lost(ledger: LedgerStore) -> None:
    await ledger.append(event("a", gateway_instance="g1"))
    await ledger.append(event("b", gateway_instance="g1", state="settled"))
    await ledger.append(event("c", gateway_instance="g2"))
    await ledger.append(event("d", gateway_instance="g2", timestamp=T0 + timedelta(hours=1)))
    assert await ledger.mark_lost("g1") == 1
    (a,) = await ledger.get("a")
    assert (a.state, a.reconciliation_reason) == ("usage_reconciliation_required", "gateway_lost")
    assert (await ledger.get("b"))[0].state == "settled"
    assert await ledger.mark_lost(before=T0 + timedelta(minutes=30)) == 1  # c, not d
    assert (await ledger.get("d"))[0].state == "reserved"
    assert await ledger.mark_lost() == 1
    assert await ledger.mark_lost() == 0


async def test_mark_lost_follows_the_rows_updates(ledger: LedgerStore) -> None:
    """A sweep sees a row's state as its updates left it: a row settled by ``update``
    or ``update_many`` is not lost, one still reserved is (once)."""
    for rid in ("settled", "many", "left", "touched"):
        await ledger.append(event(rid, 1, gateway_instance="g1"))
    await ledger.update("settled", 1, state="settled", cost_micros=5)
    await ledger.update_many([("many", 1, {"state": "pending"})])
    await ledger.update("touched", 1, latency_ms=1.5)  # no state: still reserved
    assert await ledger.mark_lost("g1") == 2
    states = {rid: (await ledger.get(rid))[0].state for rid in ("settled", "many", "left")}
    assert states == {
        "settled": "settled",
        "many": "pending",
        "left": "usage_reconciliation_required",
    }
    assert (await ledger.get("touched"))[0].latency_ms == 1.5
    assert await ledger.mark_lost("g1") == 0


async def test_import_reconciliation_is_idempotent(ledger: LedgerStore) -> None:
    await ledger.append(event("a", provider_request_id="p-a", state="pending"))
    await ledger.append(
        event("b", provider_request_id="p-b", state="usage_reconciliation_required")
    )
    await ledger.append(event("c", provider_request_id="p-c", state="settled"))
    await ledger.append(event("d", provider_request_id="p-d", state="pending", route_id="gone"))
    rows = [
        ReconciliationRow("p-a", input_tokens=1000, output_tokens=500),
        ReconciliationRow("p-b", input_tokens=10, output_tokens=20, cost_micros=99),
        ReconciliationRow("p-c", input_tokens=1, output_tokens=1),
        ReconciliationRow("p-d", input_tokens=1, output_tokens=1),
        ReconciliationRow("p-zzz", input_tokens=1, output_tokens=1),
    ]
    first = await ledger.import_reconciliation(rows, pricing=PRICING)
    assert [e.request_id for e in first.reconciled] == ["a", "b"]
    assert (first.not_pending, first.unpriced, first.unmatched) == (["p-c"], ["p-d"], ["p-zzz"])
    (a,) = await ledger.get("a")
    assert (a.state, a.usage_source, a.input_tokens, a.output_tokens_total, a.total_tokens) == (
        "reconciled",
        "reconciliation_import",
        1000,
        500,
        1500,
    )
    assert a.cost_micros == 150 + 300
    assert (await ledger.get("b"))[0].cost_micros == 99
    snapshot = [e async for e in ledger.export()]

    again = await ledger.import_reconciliation(rows, pricing=PRICING)
    assert again.reconciled == [] and again.unchanged == ["p-a", "p-b"]
    changed = [replace(rows[0], output_tokens=501)]
    conflict = await ledger.import_reconciliation(changed, pricing=PRICING)
    assert conflict.conflicts == ["p-a"] and conflict.reconciled == []
    assert [e async for e in ledger.export()] == snapshot
    assert await ledger.pending() == [(await ledger.get("d"))[0]]


async def test_import_refuses_an_ambiguous_provider_id(ledger: LedgerStore) -> None:
    await ledger.append(event("a", provider_request_id="p", state="pending"))
    await ledger.append(event("b", provider_request_id="p", state="pending"))
    result = await ledger.import_reconciliation([ReconciliationRow("p", 1, 1)], pricing=PRICING)
    assert result.ambiguous == ["p"] and len(await ledger.pending()) == 2


async def test_closed_store_refuses_writes(ledger: LedgerStore) -> None:
    await ledger.close()
    with pytest.raises(RuntimeError):
        await ledger.append(event())


# --- SQLite: group commit and durability ---------------------------------------------


def count_rows(path: Path) -> int:
    """Read through a brand-new connection, as another process would."""
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM ledger_events").fetchone()[0])
    finally:
        conn.close()


async def test_an_acknowledged_append_is_visible_to_a_new_connection(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    store = SQLiteLedgerStore(path)
    try:
        await store.append(event("only"))
        assert count_rows(path) == 1
        await asyncio.gather(*(store.append(event(f"r{i}")) for i in range(200)))
        assert count_rows(path) == 201
    finally:
        await store.close()


async def test_none_is_bound_through_the_registered_adapter_and_stored_as_null(
    tmp_path: Path,
) -> None:
    """The store registers an adapter for None (a hit in sqlite3's adapter table
    instead of a failed lookup per parameter); the columns it binds still hold NULL."""
    path = tmp_path / "ledger.db"
    store = SQLiteLedgerStore(path)
    try:
        assert sqlite3.adapters.get((type(None), sqlite3.PrepareProtocol)) is not None
        await store.append(event("nulls", requested_candidate_count=None))
        (got,) = await store.get("nulls")
    finally:
        await store.close()
    assert got.requested_candidate_count is None and got.provider_request_id is None
    conn = sqlite3.connect(path)
    try:
        kinds = conn.execute(
            "SELECT typeof(requested_candidate_count), typeof(provider_request_id),"
            " typeof(cost_micros) FROM ledger_events WHERE request_id = 'nulls'"
        ).fetchone()
    finally:
        conn.close()
    assert kinds == ("null", "null", "null")


async def test_concurrent_appends_share_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[int] = []
    real_commit = sqlite_plumbing._commit

    def counting(conn: sqlite3.Connection, batch: list[Any], **kw: Any) -> None:
        batches.append(len(batch))
        real_commit(conn, batch, **kw)

    monkeypatch.setattr(sqlite_plumbing, "_commit", counting)
    store = SQLiteLedgerStore(tmp_path / "ledger.db")
    try:
        await asyncio.gather(*(store.append(event(f"r{i}")) for i in range(256)))
    finally:
        await store.close()
    assert sum(batches) == 256 + 0 and max(batches) > 1
    assert len(batches) < 256


def test_rows_survive_a_process_that_dies_without_closing(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    script = textwrap.dedent(
        f"""
        import asyncio, os
        from datetime import UTC, datetime
        from ncap.domain.events import LedgerEvent
        from ncap.stores import SQLiteLedgerStore

        async def main():
            store = SQLiteLedgerStore({str(path)!r})
            now = datetime.now(UTC)
            await asyncio.gather(*(store.append(LedgerEvent(
                timestamp=now, request_id=f"r{{i}}", attempt=0, workload_id="w",
                environment="p")) for i in range(64)))
            print("acknowledged", flush=True)
            os._exit(0)  # no close(), no checkpoint

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "acknowledged", done.stderr
    assert count_rows(path) == 64


async def test_one_failing_append_does_not_fail_its_batch(tmp_path: Path) -> None:
    store = SQLiteLedgerStore(tmp_path / "ledger.db")
    try:
        await store.append(event("dup"))
        results = await asyncio.gather(
            *(store.append(event(f"r{i}")) for i in range(20)),
            store.append(event("dup")),
            return_exceptions=True,
        )
        assert [type(r) for r in results if r is not None] == [DuplicateAttempt]
        assert count_rows(store.path) == 21
    finally:
        await store.close()


async def test_write_failures_reach_the_caller(tmp_path: Path) -> None:
    store = SQLiteLedgerStore(tmp_path / "ledger.db")
    try:
        with pytest.raises(sqlite3.IntegrityError):
            await store.append(event(state="lost-in-space"))  # type: ignore[arg-type]
        # a full disk: cap the file at its current size, then keep writing
        pages = await store._writer.run(
            lambda c: c.execute("PRAGMA page_count").fetchone()[0], single_statement=True
        )
        await store._writer.run(
            lambda c: c.execute(f"PRAGMA max_page_count = {pages + 1}"), single_statement=True
        )
        results = await asyncio.gather(
            *(store.append(event(f"big{i}", finish_reasons={"x" * 4000: i})) for i in range(50)),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, sqlite3.OperationalError)]
        assert failures and "full" in str(failures[0])
        assert count_rows(store.path) == sum(r is None for r in results)
    finally:
        await store.close()


async def test_schema_is_versioned_and_reopening_keeps_rows(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    store = SQLiteLedgerStore(path)
    await store.append(event())
    await store.close()
    store = SQLiteLedgerStore(path)
    try:
        assert len(await store.get("req-1")) == 1
    finally:
        await store.close()
    conn = sqlite3.connect(path)
    try:
        versions = conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
        assert versions == [(1,), (2,), (3,), (4,), (5,), (6,), (7,), (8,), (9,)]
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


async def test_a_version_1_file_gains_the_denial_columns(tmp_path: Path) -> None:
    """A ledger written before migration 2 opens, keeps its rows (denial details null)
    and takes new rows with them."""
    from ncap.stores.sqlite.ledger import MIGRATIONS

    path = tmp_path / "ledger.db"
    conn = sqlite_plumbing.connect(path)
    try:
        assert sqlite_plumbing.migrate(conn, MIGRATIONS[:1]) == 1
        new = {"denied_by", "denied_limit", "denied_amount", "upstream_status"}
        new |= {"output_tokens_per_choice", "client_retry_count"}
        new |= {c for c in LEDGER_COLUMNS if c.startswith("candidates_")}
        spec = [c for c in LEDGER_COLUMNS if c not in new]
        old = event("req-old")
        values = [getattr(old, c) for c in spec]
        values[spec.index("timestamp")] = "2026-11-29T10:00:00.000000Z"
        values[spec.index("finish_reasons")] = "{}"
        conn.execute(
            f"INSERT INTO ledger_events ({', '.join(spec)}) VALUES ({', '.join('?' * len(spec))})",
            values,
        )
    finally:
        conn.close()
    store = SQLiteLedgerStore(path)
    try:
        await store.append(DENIED_EVENT)
        assert await store.get("req-old") == [old]
        assert await store.get("req-d") == [DENIED_EVENT]
    finally:
        await store.close()


async def test_export_pages_through_large_ledgers(tmp_path: Path) -> None:
    store = SQLiteLedgerStore(tmp_path / "ledger.db")
    try:
        same_time = [store.append(event(f"r{i:05d}")) for i in range(2_500)]
        await asyncio.gather(*same_time)
        ids = [e.request_id async for e in store.export()]
        assert ids == [f"r{i:05d}" for i in range(2_500)]
    finally:
        await store.close()


async def test_a_row_is_inserted_with_its_filled_columns_only(tmp_path: Path) -> None:
    """The INSERT names only the columns a row fills (the others are NULL by default,
    never bound one by one) and reads back equal, empty columns included."""
    path = tmp_path / "ledger.db"
    store = SQLiteLedgerStore(path)
    row = event(provider_request_id=None, cost_micros=None, upstream_status=None)
    try:
        await store.append(row)
        assert await store.get("req-1") == [row]
    finally:
        await store.close()
    statements: list[str] = []
    conn = sqlite3.connect(path, isolation_level=None)
    conn.set_trace_callback(statements.append)
    try:
        values = ledger_module._encode_row(event("req-2", provider_request_id=None))
        ledger_module._insert(conn, row, values)
    finally:
        conn.close()
    (insert,) = statements
    named = insert.split("(", 1)[1].split(")", 1)[0].split(", ")
    filled = [c for c, v in zip(LEDGER_COLUMNS, values, strict=True) if v is not None]
    assert named == filled and "NULL" not in insert
    assert "provider_request_id" not in named and "workload_id" in named


async def test_lookups_by_state_read_the_index_of_rows_not_settled(tmp_path: Path) -> None:
    """Every lookup by state says the partial index's condition, so SQLite reads the few
    rows not settled through it instead of scanning the ledger (revision 9)."""
    from ncap.reports import build, timeline

    path = tmp_path / "ledger.db"
    store = SQLiteLedgerStore(path)
    await store.close()
    conn = sqlite3.connect(path)
    try:
        (index,) = conn.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND sql LIKE '%(state)%'"
        ).fetchone()
        assert index.strip().endswith("WHERE state <> 'settled'")
        lookups = [
            (ledger_module._HELD_ROWS, ()),
            (ledger_module._PENDING, ("x", "x")),
            (ledger_module._MARK_LOST, ("lost", "gw", "gw", None, None)),
            (build._PENDING_SQL, ("x",)),
            (timeline._PENDING_SQL, ("x",)),
        ]
        for sql, params in lookups:
            plan = " ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, params))
            assert "USING INDEX ledger_events_unsettled (state=?)" in plan, sql
    finally:
        conn.close()
