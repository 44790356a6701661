"""Budget counters lost (a Redis restarted empty) while a request is admitted: the
request gives up waiting for the rebuild (503), but the rebuild read the ledger while
that request's row still said ``reserved`` and restored its hold. The hold must not
outlive the row: it is released once the store answers, so the counters equal the
ledger again. Real Redis; the ledger in memory, slowed where the race needs it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from ncap.errors import StoreUnavailable
from ncap.stores import MemoryLedgerStore, RedisBudgetStore
from ncap.stores.ports import RowUpdate, update_each
from ncap.testing.scripted import ScriptedProvider
from tests.lifecycle.harness import harness, route
from tests.services import redis_prefix

pytestmark = pytest.mark.redis


class SlowCloseLedger(MemoryLedgerStore):
    """Row updates wait until the rebuild has read the ledger (the race's order)."""

    def __init__(self) -> None:
        super().__init__()
        self.read = asyncio.Event()

    async def update(self, *args: Any, **kwargs: Any) -> None:
        await asyncio.wait_for(self.read.wait(), timeout=5)
        await super().update(*args, **kwargs)

    async def update_many(self, updates: Sequence[RowUpdate]) -> None:
        await update_each(self, updates)

    def held_rows(self, *args: Any, **kwargs: Any) -> Any:
        self.read.set()
        return super().held_rows(*args, **kwargs)


async def test_a_hold_rebuilt_for_a_refused_request_is_released(tmp_path: Path) -> None:
    async with redis_prefix() as url:
        ledger = SlowCloseLedger()
        # a fresh prefix has no generation marker: the counters read as lost; the
        # request does not wait for the rebuild (wait 0), the rebuild runs beside it
        budgets = RedisBudgetStore(url, history=ledger, rebuild_grace_s=0, rebuild_wait_s=0)
        try:
            provider = ScriptedProvider([])
            h = harness(tmp_path, {"a": (route(), provider)}, ledger=ledger, budgets=budgets)
            with pytest.raises(StoreUnavailable):
                await h.chat()
            (row,) = await h.rows()
            assert (row.state, row.policy_reason) == ("denied", "store_unavailable")
            assert provider.sent == []
            for _ in range(100):  # the release waits for the rebuild's marker
                if not await budgets.outstanding() and h.gateway.accounting.settlement.pending == 0:
                    break
                await asyncio.sleep(0.05)
            assert budgets.rebuilds == 1  # the rebuild did restore something
            assert await budgets.outstanding() == []
            usage = await budgets.usage("default")
            assert (usage.tokens_day, usage.cost_day) == (0, 0)
        finally:
            await budgets.close()
