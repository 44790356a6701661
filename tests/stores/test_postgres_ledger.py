"""What the PostgreSQL ledger adds to the contract: group commit, duplicates that fail
alone, batched updates, ``ledger_durability`` as ``synchronous_commit``, failing closed
while the server is away, and resuming by itself."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

import ncap.stores.postgres.ledger as pg
from ncap.errors import StoreUnavailable
from ncap.stores import DuplicateAttempt, PostgresLedgerStore, ledger_from_url
from tests.servers import free_port, tcp_proxy
from tests.services import PG_URL, pg_schema
from tests.stores.test_sqlite_ledger import event

pytestmark = pytest.mark.postgresql


async def test_concurrent_appends_share_one_insert_per_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batches: list[int] = []
    real = pg._run_batch

    async def counting(pool: Any, batch: list[Any]) -> Any:
        batches.append(len(batch))
        return await real(pool, batch)

    monkeypatch.setattr(pg, "_run_batch", counting)
    async with pg_schema() as url:
        store = PostgresLedgerStore(url)
        try:
            await store.append(event("warm-up"))
            batches.clear()
            await asyncio.gather(*(store.append(event(f"r{i}")) for i in range(300)))
            assert sum(batches) == 300 and len(batches) < 30, batches
            assert len([e async for e in store.export()]) == 301
        finally:
            await store.close()


async def test_a_duplicate_fails_alone_in_its_batch() -> None:
    async with pg_schema() as url:
        store = PostgresLedgerStore(url)
        try:
            await store.append(event("dup"))
            results = await asyncio.gather(
                store.append(event("a")),
                store.append(event("dup")),
                store.append(event("b")),
                store.append(event("b")),  # the same key twice in one batch
                return_exceptions=True,
            )
            assert results[0] is None and results[2] is None
            assert isinstance(results[1], DuplicateAttempt)
            assert isinstance(results[3], DuplicateAttempt)
            assert [len(await store.get(r)) for r in ("a", "b", "dup")] == [1, 1, 1]
        finally:
            await store.close()


async def test_unreachable_postgres_fails_closed_and_resumes_by_itself() -> None:
    nobody = PostgresLedgerStore(f"postgresql://postgres@127.0.0.1:{free_port()}/test")
    with pytest.raises(StoreUnavailable) as info:
        await nobody.append(event())
    assert info.value.status == 503 and info.value.store == "ledger"
    await nobody.close()
    target = urlsplit(PG_URL)
    async with pg_schema() as url:
        with tcp_proxy(target.hostname or "127.0.0.1", target.port or 5432) as proxy:
            proxied = url.replace(f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}")
            store = PostgresLedgerStore(proxied)
            try:
                await store.append(event("before"))
                proxy.cut()
                for rid in ("during-1", "during-2"):
                    with pytest.raises(StoreUnavailable):
                        await store.append(event(rid))
                with pytest.raises(StoreUnavailable):
                    await store.get("before")
                proxy.restore()
                await store.append(event("after"))
                assert [e.request_id async for e in store.export()] == ["after", "before"]
            finally:
                await store.close()


async def _server_default(url: str) -> str:
    conn = await asyncpg.connect(url.split("?")[0])
    try:
        return str(await conn.fetchval("SHOW synchronous_commit"))
    finally:
        await conn.close()


async def _settings_of(store: PostgresLedgerStore, rounds: int = 3) -> set[str]:
    """synchronous_commit on the ledger's own pooled connections (the writer's, which
    wrote, and the readers'), after they went back to their pool (several at once, so
    more than one connection is asked)."""
    seen: set[str] = set()
    for r in range(rounds):
        await asyncio.gather(*(store.append(event(f"s{r}-{i}")) for i in range(8)))
        # the writer keeps one connection of its pool between batches (idle now)
        held = store._conn
        assert held is not None
        seen.add(str(await held.fetchval("SHOW synchronous_commit")))
        writer, readers = await store.pool.writer(), await store.pool.get()
        for pool, free in ((writer, writer.get_max_size() - 1), (readers, 3)):
            conns = [await pool.acquire() for _ in range(min(free, pool.get_max_size()))]
            try:
                seen |= {str(await c.fetchval("SHOW synchronous_commit")) for c in conns}
            finally:
                for c in conns:
                    await pool.release(c)
    return seen


@pytest.mark.parametrize(
    ("durability", "query", "expected"),
    [
        ("normal", "", "off"),  # the default, as SQLite's synchronous=NORMAL
        ("full", "", None),  # the server's own setting (on, unless configured otherwise)
        ("normal", "&synchronous_commit=local", "local"),  # the URL's own wins
    ],
)
async def test_ledger_durability_sets_synchronous_commit_on_the_ledgers_connections(
    durability: Any, query: str, expected: str | None
) -> None:
    async with pg_schema() as url:
        store = ledger_from_url(url + query, durability=durability)
        assert isinstance(store, PostgresLedgerStore)
        try:
            want = expected if expected is not None else await _server_default(url)
            assert await _settings_of(store) == {want}
        finally:
            await store.close()


async def test_updates_in_one_batch_apply_as_each_would_alone() -> None:
    """Updates batched by the columns they set: each row gets its own values, a missing
    row fails alone, and a key updated twice in one batch ends with the later values."""
    async with pg_schema() as url:
        store = PostgresLedgerStore(url)
        try:
            for rid in ("a", "b", "c", "d"):
                await store.append(event(rid))
            results = await asyncio.gather(
                store.update("a", 0, state="settled", cost_micros=10, input_tokens=1),
                store.update("b", 0, state="settled", cost_micros=20, input_tokens=2),
                store.update("missing", 0, state="settled", cost_micros=1, input_tokens=1),
                store.update("c", 0, state="pending", finish_reasons={"stop": 1, "length": 1}),
                store.append(event("e")),
                return_exceptions=True,
            )
            assert [r is None for r in results] == [True, True, False, True, True]
            assert isinstance(results[2], KeyError)
            twice = await asyncio.gather(
                store.update("d", 0, state="pending", cost_micros=5),
                store.update("d", 0, state="settled", cost_micros=7),
                store.update("a", 0, latency_ms=1.5),
            )
            assert twice == [None, None, None]
            rows = {r: (await store.get(r))[0] for r in ("a", "b", "c", "d", "e")}
            assert (rows["a"].state, rows["a"].cost_micros, rows["a"].input_tokens) == (
                "settled",
                10,
                1,
            )
            assert rows["a"].latency_ms == 1.5
            assert (rows["b"].cost_micros, rows["b"].input_tokens) == (20, 2)
            assert (rows["c"].state, rows["c"].finish_reasons) == (
                "pending",
                {"stop": 1, "length": 1},
            )
            assert rows["c"].cost_micros is None
            assert (rows["d"].state, rows["d"].cost_micros) == ("settled", 7)
            assert rows["e"].state == event("e").state
        finally:
            await store.close()


async def test_a_batch_is_one_statement_without_begin_or_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Appends and updates that all touch distinct keys are one statement, so no
    BEGIN/COMMIT round trips; a key updated twice in a batch needs a transaction."""
    opened: list[int] = []
    batches: list[int] = []
    real, real_batch = asyncpg.connection.Connection.transaction, pg._run_batch

    def counting(self: Any, *args: Any, **kw: Any) -> Any:
        opened.append(1)
        return real(self, *args, **kw)

    async def batch_sizes(pool: Any, batch: list[Any]) -> Any:
        batches.append(len(batch))
        return await real_batch(pool, batch)

    async with pg_schema() as url:
        store = PostgresLedgerStore(url)
        try:
            await store.append(event("warm-up"))
            monkeypatch.setattr(asyncpg.connection.Connection, "transaction", counting)
            monkeypatch.setattr(pg, "_run_batch", batch_sizes)
            await store.append(event("x"))
            await store.append(event("y"))
            await asyncio.gather(
                store.update("x", 0, state="settled", cost_micros=1),
                store.update("y", 0, state="settled", cost_micros=2),
            )
            mixed = await asyncio.gather(
                store.append(event("z")),
                store.append(event("warm-up")),  # a duplicate, refused inside the statement
                store.update("x", 0, latency_ms=2.0),
                store.update("y", 0, state="pending", input_tokens=3),
                store.update("nobody", 0, latency_ms=1.0),
                return_exceptions=True,
            )
            assert opened == [] and batches == [1, 1, 2, 5]
            assert [type(r).__name__ for r in mixed] == [
                "NoneType",
                "DuplicateAttempt",
                "NoneType",
                "NoneType",
                "KeyError",
            ]
            await asyncio.gather(
                store.update("z", 0, cost_micros=4), store.update("z", 0, cost_micros=5)
            )
            assert opened == [1]
            x, y, z = [(await store.get(r))[0] for r in "xyz"]
            assert (x.cost_micros, x.latency_ms, x.state) == (1, 2.0, "settled")
            assert (y.cost_micros, y.input_tokens, y.state) == (2, 3, "pending")
            assert z.cost_micros == 5
        finally:
            await store.close()


async def test_a_row_appended_and_updated_in_one_batch_gets_its_update() -> None:
    """Inside one statement an update cannot see a row the same statement inserts:
    such a batch runs statement by statement (the row is updated, not 'missing')."""
    async with pg_schema() as url:
        store = PostgresLedgerStore(url)
        try:
            await store.append(event("warm-up"))
            results = await asyncio.gather(
                store.append(event("fresh")),
                store.update("fresh", 0, state="settled", cost_micros=9),
                return_exceptions=True,
            )
            assert results == [None, None]
            assert (await store.get("fresh"))[0].cost_micros == 9
        finally:
            await store.close()


async def test_the_writer_plans_once_and_looks_rows_up_by_primary_key_even_on_an_empty_table() -> (
    None
):
    """The writer's connections use generic plans (no re-planning per batch), and the
    plan made while the table was empty is still the primary-key lookup."""
    async with pg_schema() as url:
        store = PostgresLedgerStore(url)
        try:
            writer = await store.pool.writer()
            async with writer.acquire() as conn:
                assert await conn.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
                names = ("state", "latency_ms")
                update = pg._update_many(names, 1)
                await conn.execute(f"PREPARE u AS {update}")
                plan = "\n".join(
                    r[0]
                    for r in await conn.fetch(
                        "EXPLAIN EXECUTE u('{a}', '{1}', '{settled}', '{1.0}')"
                    )
                )
                await conn.execute("DEALLOCATE u")
            assert "ledger_events_pkey" in plan and "Seq Scan" not in plan, plan
            await asyncio.gather(*(store.append(event(f"p{i}")) for i in range(20)))
            await asyncio.gather(
                *(store.update(f"p{i}", 0, state="settled", latency_ms=1.0) for i in range(20))
            )
            assert {e.state for e in await store.pending()} == set()
            assert (await store.get("p7"))[0].state == "settled"
        finally:
            await store.close()
