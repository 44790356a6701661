"""Budgets on another server (``round_trip``): the first attempt's hold and its
``reserved`` row are sent together, so their round trips overlap, and every outcome
still leaves exactly one row per request that says what happened."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from ncap.domain.events import LedgerEvent
from ncap.errors import BudgetExhausted, StoreUnavailable
from ncap.stores import MemoryBudgetStore, MemoryLedgerStore
from ncap.stores.ports import Hold
from ncap.testing.scripted import Answer, ScriptedProvider, chat_body
from tests.lifecycle.harness import EMULATE, harness, route, settled


class RoundTripBudgets(MemoryBudgetStore):
    """In-memory counters that say they are a round trip away, as Redis is; a
    reservation waits for the ledger's insert to have started, so it can only succeed
    when the two are in flight together."""

    quota_scope = "global"
    round_trip = True

    def __init__(self, ledger: OverlapLedger, fail: BaseException | None = None) -> None:
        super().__init__()
        self.ledger = ledger
        self.fail = fail
        self.reserving = asyncio.Event()

    async def reserve(self, *args: Any, **kwargs: Any) -> Hold:
        self.reserving.set()
        await asyncio.wait_for(self.ledger.appending.wait(), timeout=2)
        if self.fail is not None:
            raise self.fail
        return await super().reserve(*args, **kwargs)


class OverlapLedger(MemoryLedgerStore):
    def __init__(self, fail: BaseException | None = None) -> None:
        super().__init__()
        self.fail = fail
        self.appending = asyncio.Event()
        self.budgets: RoundTripBudgets | None = None

    async def append(self, event: LedgerEvent) -> None:
        self.appending.set()
        if event.attempt == 1 and self.budgets is not None:  # the reserve is in flight too
            await asyncio.wait_for(self.budgets.reserving.wait(), timeout=2)
        if self.fail is not None:
            raise self.fail
        await super().append(event)


def _stores(
    budgets_fail: BaseException | None = None, ledger_fail: BaseException | None = None
) -> tuple[OverlapLedger, RoundTripBudgets]:
    ledger = OverlapLedger(ledger_fail)
    budgets = RoundTripBudgets(ledger, budgets_fail)
    ledger.budgets = budgets
    return ledger, budgets


async def test_the_hold_and_the_row_are_in_flight_together_and_the_row_is_written_once(
    tmp_path: Path,
) -> None:
    ledger, budgets = _stores()
    provider = ScriptedProvider([Answer(chat_body("x"))])
    h = harness(tmp_path, {"a": (route(), provider)}, ledger=ledger, budgets=budgets)
    reply = await h.chat()
    assert reply.status == 200 and reply.settling
    await settled(h.gateway)
    (row,) = await h.rows()  # begin() did not write a second reserved row
    assert (row.attempt, row.state, row.policy_result) == (1, "settled", "allow")
    assert row.quota_scope == "global"
    assert await h.outstanding() == []


async def test_a_refused_reservation_turns_the_written_row_into_the_denial(
    tmp_path: Path,
) -> None:
    ledger, budgets = _stores()
    day = {"workloads": {"default": {"tokens_per_day": 100}}}
    provider = ScriptedProvider([])
    h = harness(tmp_path, {"a": (route(), provider)}, ledger=ledger, budgets=budgets, **day)
    with pytest.raises(BudgetExhausted):
        await h.chat()
    (row,) = await h.rows()
    assert (row.attempt, row.state, row.policy_result) == (1, "denied", "deny")
    assert (row.policy_reason, row.quota_scope) == ("budget_exhausted", "global")
    needed = row.reserved_input_tokens + row.reserved_output_tokens
    assert (row.denied_by, row.denied_limit, row.denied_amount) == ("tokens_day", 100, needed)
    assert row.reserved_cost_micros == 0
    assert provider.sent == [] and await h.outstanding() == []


async def test_a_budget_store_outage_leaves_a_refused_row_not_a_reserved_one(
    tmp_path: Path,
) -> None:
    ledger, budgets = _stores(budgets_fail=StoreUnavailable("budgets", "redis down"))
    provider = ScriptedProvider([])
    h = harness(tmp_path, {"a": (route(), provider)}, ledger=ledger, budgets=budgets)
    with pytest.raises(StoreUnavailable):
        await h.chat()
    (row,) = await h.rows()
    assert (row.attempt, row.state, row.policy_reason) == (1, "denied", "store_unavailable")
    assert row.reserved_cost_micros == 0
    assert provider.sent == [] and await h.outstanding() == []


async def test_a_ledger_failure_gives_the_granted_hold_back(tmp_path: Path) -> None:
    ledger, budgets = _stores(ledger_fail=StoreUnavailable("ledger", "postgresql down"))
    provider = ScriptedProvider([])
    h = harness(tmp_path, {"a": (route(), provider)}, ledger=ledger, budgets=budgets)
    with pytest.raises(StoreUnavailable):
        await h.chat()
    assert await h.rows() == []
    assert provider.sent == [] and await h.outstanding() == []


async def test_a_fan_out_reserves_its_branches_as_before(tmp_path: Path) -> None:
    """Emulated branches each write their row when dispatched (``begin``)."""
    ledger, budgets = MemoryLedgerStore(), MemoryBudgetStore()
    budgets.round_trip = True  # type: ignore[misc]
    answers = [Answer(chat_body("x")), Answer(chat_body("y"))]
    h = harness(
        tmp_path, {"a": (route(EMULATE), ScriptedProvider(answers))}, ledger=ledger, budgets=budgets
    )
    reply = await h.chat(n=2, temperature=1.0)
    if reply.settling:
        await settled(h.gateway)
    assert [(r.attempt, r.state) for r in await h.rows()] == [(1, "settled"), (2, "settled")]


class LostReplyBudgets(MemoryBudgetStore):
    """Reservations the store applies but whose reply is lost (a timeout or a dropped
    connection after the script ran), from reservation number ``from_number`` on; the
    releases fail ``release_failures`` times first (the store still away)."""

    def __init__(self, *, round_trip: bool, from_number: int, release_failures: int = 0):
        super().__init__()
        self.round_trip = round_trip  # type: ignore[misc]
        self.quota_scope = "global" if round_trip else "local"  # type: ignore[misc]
        self.from_number = from_number
        self.release_failures = release_failures
        self.reserved = 0

    async def reserve(self, *args: Any, **kwargs: Any) -> Hold:
        hold = await super().reserve(*args, **kwargs)
        self.reserved += 1
        if self.reserved >= self.from_number:
            raise StoreUnavailable("budgets", "Redis", "timed out")
        return hold

    async def release(self, hold: Hold | str) -> bool:
        if self.release_failures:
            self.release_failures -= 1
            raise StoreUnavailable("budgets", "Redis", "connection refused")
        return await super().release(hold)


async def _no_holds_left(h: Any) -> None:
    for _ in range(100):
        if not await h.outstanding() and h.gateway.accounting.settlement.pending == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(await h.outstanding())


async def test_a_reservation_applied_but_unanswered_is_given_back(tmp_path: Path) -> None:
    """The store ran the reservation and the reply never came: the client gets 503, the
    row says store_unavailable, and the hold the store kept is released once it answers
    (here after two refused releases), so no budget stays held for nothing."""
    budgets = LostReplyBudgets(round_trip=True, from_number=1, release_failures=2)
    provider = ScriptedProvider([])
    h = harness(tmp_path, {"a": (route(), provider)}, ledger=MemoryLedgerStore(), budgets=budgets)
    with pytest.raises(StoreUnavailable):
        await h.chat()
    (row,) = await h.rows()
    assert (row.state, row.policy_reason) == ("denied", "store_unavailable")
    assert len(await budgets.outstanding()) == 1  # held by the store, unknown to the request
    await _no_holds_left(h)
    assert provider.sent == [] and budgets.release_failures == 0
    usage = await budgets.usage("default")
    assert (usage.tokens_day, usage.cost_day) == (0, 0)


async def test_a_fan_out_admitted_in_part_gives_back_every_branch(tmp_path: Path) -> None:
    """Branch 1 reserved, branch 2's reply lost: both holds are released."""
    budgets = LostReplyBudgets(round_trip=False, from_number=2)
    provider = ScriptedProvider([])
    h = harness(
        tmp_path, {"a": (route(EMULATE), provider)}, ledger=MemoryLedgerStore(), budgets=budgets
    )
    with pytest.raises(StoreUnavailable):
        await h.chat(n=3, temperature=1.0)
    await _no_holds_left(h)
    assert budgets.reserved == 2 and provider.sent == []
    outstanding = h.metrics.registry.get_sample_value("ncap_reservations_outstanding")
    assert outstanding == 0  # inc at reserve, dec at release
