"""Settlements a store refused are kept and retried in order, bounded, resumed where
they stopped; recovery is not Accounting's (PeerWatch's), so it has no ``start``."""

from __future__ import annotations

import asyncio

import pytest

from ncap.errors import StoreUnavailable
from ncap.lifecycle import Accounting
from ncap.lifecycle.settlement import Deferred, Steps


class Flaky:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.done: list[str] = []

    def step(self, name: str):  # type: ignore[no-untyped-def]
        async def run() -> None:
            if self.failures:
                self.failures -= 1
                raise StoreUnavailable("budgets", "Redis", "ConnectionError")
            self.done.append(name)

        return run


async def _no_sleep(_: float) -> None:
    return None


async def test_kept_settlements_resume_in_order_until_the_store_answers() -> None:
    store = Flaky(failures=3)
    deferred = Deferred(sleep=_no_sleep)
    await deferred.run(Steps([store.step("hold-1"), store.step("row-1")]))
    await deferred.run(Steps([store.step("hold-2"), store.step("row-2")]))  # queued behind
    assert deferred.pending == 2 and store.done == []
    for _ in range(100):  # the retry task: fails twice more, then applies both
        if not deferred.pending:
            break
        await asyncio.sleep(0)
    assert store.done == ["hold-1", "row-1", "hold-2", "row-2"] and deferred.pending == 0


async def test_the_backlog_is_bounded() -> None:
    store = Flaky(failures=100)
    deferred = Deferred(max_pending=1, sleep=_no_sleep, first_delay_s=10)
    await deferred.run(Steps([store.step("a")]))
    with pytest.raises(StoreUnavailable):
        await deferred.run(Steps([store.step("b")]))
    assert deferred.pending == 1


def test_accounting_has_no_start_that_would_mark_every_instance_lost() -> None:
    assert not hasattr(Accounting, "start")
