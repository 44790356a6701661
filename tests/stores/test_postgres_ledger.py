"""What the PostgreSQL ledger adds to the contract: group commit, duplicates that fail
alone, failing closed while the server is away, and resuming by itself."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import pytest

import ncap.stores.postgres_ledger as pg
from ncap.errors import StoreUnavailable
from ncap.stores import DuplicateAttempt, PostgresLedgerStore
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
