"""The Idempotency-Key records port over every budget backend: one claim wins, swaps are
compare-and-set, records expire; two stores on the same backend see each other's."""

from __future__ import annotations

import asyncio

from tests.stores.conftest import BudgetFactory


async def test_one_claim_wins_and_the_others_see_its_record(
    budget_factory: BudgetFactory,
) -> None:
    stores = [budget_factory.idempotency(budget_factory(f"g{i}")) for i in range(2)]
    if type(stores[0]).__name__ == "MemoryIdempotency":
        stores = [stores[0], stores[0]]  # one process's records: one store
    got = await asyncio.gather(
        *(stores[i % 2].claim("w:k", f"rec-{i}".encode(), 30) for i in range(8))
    )
    winners = [i for i, found in enumerate(got) if found is None]
    assert len(winners) == 1
    mine = f"rec-{winners[0]}".encode()
    assert all(found == mine for found in got if found is not None)
    assert await stores[1].get("w:k") == mine
    assert await stores[0].get("w:other") is None


async def test_swap_is_compare_and_set_and_none_deletes(budget_factory: BudgetFactory) -> None:
    store = budget_factory.idempotency(budget_factory())
    assert await store.claim("w:k", b"a", 30) is None
    assert not await store.swap("w:k", b"not-a", b"b", 30)
    assert await store.swap("w:k", b"a", b"done", 30)
    assert await store.get("w:k") == b"done"
    assert not await store.swap("w:k", b"a", None, 30)
    assert await store.swap("w:k", b"done", None, 30)
    assert await store.get("w:k") is None
    assert await store.claim("w:k", b"again", 30) is None


async def test_records_expire(budget_factory: BudgetFactory) -> None:
    store = budget_factory.idempotency(budget_factory())
    assert await store.claim("w:k", b"a", 0.2) is None
    assert await store.claim("w:k", b"b", 0.2) == b"a"
    await asyncio.sleep(0.4)
    assert await store.get("w:k") is None
    assert await store.claim("w:k", b"b", 30) is None
