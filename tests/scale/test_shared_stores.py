"""Three ``ncap serve`` processes on one PostgreSQL ledger and one Redis budget store:
one global budget, one ledger, and peers that survive each other."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ncap.config import Pricing
from ncap.domain.money import format_usd
from ncap.domain.reservation import estimate_input_tokens, reservation_for
from ncap.testing.fake_upstream import FakeState
from tests.scale.support import (
    chat,
    client,
    gateways,
    holds,
    rows,
    shared_config,
    start,
    stop,
    wait_for,
    wait_ready,
)
from tests.services import pg_schema, redis_prefix

pytestmark = [pytest.mark.postgresql, pytest.mark.redis]

CEILING = 256
PRICING = Pricing(input_per_mtok=0.15, output_per_mtok=0.6)


@pytest.fixture
async def stores() -> AsyncIterator[tuple[str, str]]:
    async with pg_schema() as ledger, redis_prefix() as budgets:
        yield ledger, budgets


def _reserved_cost() -> int:
    """What one ``chat()`` request reserves on the fake route (the gateway's own rule)."""
    messages = chat()["messages"]
    return reservation_for(
        estimated_input_tokens=estimate_input_tokens(messages),
        effective_n=1,
        per_candidate_ceiling=CEILING,
        output_cap="per_candidate",
        candidates_mode="native",
        pricing=PRICING,
    ).cost_micros


async def test_600_requests_on_three_gateways_against_a_global_budget_of_150(
    fake: tuple[str, FakeState], tmp_path: Path, stores: tuple[str, str]
) -> None:
    ledger_url, budgets_url = stores
    cost = _reserved_cost()
    budget_micros = 150 * cost
    config = shared_config(
        fake[0],
        tmp_path,
        ledger_url,
        budgets_url,
        workloads={
            "default": {
                "output_ceiling": CEILING,
                "max_concurrency": 10_000,
                "usd_per_day": budget_micros / 1_000_000,
            }
        },
        # every admission is decided while the first 150 are still in flight upstream
        routes={"fake": {"headers": {"x-fake-fault": "latency=4000"}, "timeout_s": 60}},
    )
    fake[1].reset()
    with gateways(config, 3, tmp_path / "gw.log") as gws:
        async with client() as http:
            replies = await asyncio.gather(
                *(
                    http.post(gws[i % 3].url + "/v1/chat/completions", json=chat())
                    for i in range(600)
                )
            )
        # settlements run just after the answers
        events = await wait_for(lambda: _settled(ledger_url, 150), timeout=20)
    statuses = Counter(r.status_code for r in replies)
    codes = Counter(r.json()["error"]["code"] for r in replies if r.status_code != 200)
    assert statuses == {200: 150, 429: 450}, (statuses, codes)
    assert codes == {"budget_exhausted": 450}
    assert fake[1].requests == 150  # exactly 150 dispatched, counted at the upstream
    assert len(events) == 600
    assert len({(e.request_id, e.attempt) for e in events}) == 600  # no duplicates
    assert Counter(e.state for e in events) == {"settled": 150, "denied": 450}
    spent = sum(e.cost_micros or 0 for e in events)
    assert 0 < spent <= budget_micros, (format_usd(spent), format_usd(budget_micros))
    admitted = [e for e in events if e.state == "settled"]
    assert {e.quota_scope for e in admitted} == {"global"}
    assert len({e.gateway_instance for e in events}) == 3  # spread over all three
    assert await holds(budgets_url) == []


async def _settled(ledger_url: str, count: int) -> list[Any] | None:
    events = await rows(ledger_url)
    return events if sum(e.state == "settled" for e in events) >= count else None


async def test_denied_rows_carry_the_budget_stores_scope(
    fake: tuple[str, FakeState], tmp_path: Path, stores: tuple[str, str]
) -> None:
    config = shared_config(fake[0], tmp_path, *stores, workloads={"default": {"usd_per_day": 0}})
    with gateways(config, 1, tmp_path / "gw.log") as [gw]:
        async with client() as http:
            reply = await http.post(gw.url + "/v1/chat/completions", json=chat())
    assert reply.status_code == 429
    [row] = await rows(stores[0])
    assert (row.state, row.quota_scope) == ("denied", "global")
    # its reserved row, written beside the Redis reservation, became the denial
    assert (row.attempt, row.policy_result, row.policy_reason) == (1, "deny", "budget_exhausted")
    assert (row.denied_by, row.denied_limit, row.reserved_cost_micros) == ("usd_micros_day", 0, 0)


async def test_a_peer_leaves_in_flight_requests_alone_and_a_killed_one_is_swept(
    fake: tuple[str, FakeState], tmp_path: Path, stores: tuple[str, str]
) -> None:
    ledger_url, budgets_url = stores
    config = shared_config(
        fake[0],
        tmp_path,
        ledger_url,
        budgets_url,
        workloads={"default": {"max_concurrency": 6}},
        models={"fake-model": ["fake"], "slow-model": ["slow"]},
        routes={"slow": _slow_route(fake[0])},
    )
    fake[1].reset()
    log = tmp_path / "gw.log"
    first = start(config, log)
    others: list[Any] = []
    try:
        wait_ready(first)
        async with client() as http:
            doomed = [
                asyncio.create_task(
                    http.post(first.url + "/v1/chat/completions", json=chat("slow-model"))
                )
                for _ in range(5)
            ]
            assert await wait_for(lambda: _upstream_in_flight(fake[1], 5), timeout=20)
            others = [start(config, log), start(config, log)]
            for gw in others:
                wait_ready(gw)
            # the newcomers left the first gateway's rows, holds and slots alone
            in_flight = await rows(ledger_url)
            assert [(e.state, e.reconciliation_reason) for e in in_flight] == [
                ("reserved", None)
            ] * 5
            assert [h.state for h in await holds(budgets_url)] == ["active"] * 5
            survivor = asyncio.create_task(
                http.post(others[0].url + "/v1/chat/completions", json=chat("slow-model"))
            )
            assert await wait_for(lambda: _upstream_in_flight(fake[1], 6), timeout=20)
            full = await http.post(others[1].url + "/v1/chat/completions", json=chat())
            assert full.status_code == 429
            assert full.json()["error"]["code"] == "concurrency_limit_exceeded"

            first.proc.send_signal(signal.SIGKILL)  # mid-load
            first.proc.wait(10)
            await asyncio.gather(*doomed, return_exceptions=True)
            lost = await wait_for(lambda: _lost(ledger_url, 5), timeout=20)
            assert lost, "the killed gateway's rows were not swept"
            # the other two keep serving: the slots the dead one held are free again
            served = await http.post(others[1].url + "/v1/chat/completions", json=chat())
            assert served.status_code == 200, served.text
            assert (await survivor).status_code == 200
    finally:
        for gw in [first, *others]:
            stop(gw)
    events = await rows(ledger_url)
    dead = {e.gateway_instance for e in lost}
    assert len(dead) == 1 and all(
        e.gateway_instance not in dead for e in events if e.state == "settled"
    )
    kept = [h for h in await holds(budgets_url) if h.gateway_instance in dead]
    assert len(kept) == 5 and {h.state for h in kept} == {"kept"}
    assert {h.hold_id for h in kept} == {f"{e.request_id}#{e.attempt}" for e in lost}
    assert sum(h.cost_micros for h in kept) == sum(e.reserved_cost_micros for e in lost) > 0


def _slow_route(fake_url: str) -> dict[str, Any]:
    return {
        "provider": "openai",
        "base_url": fake_url,
        "upstream_model": "fake-model",
        "api_key_env": "NCAP_TEST_UPSTREAM_KEY",
        "timeout_s": 60,
        "retries": 0,
        "headers": {"x-fake-fault": "latency=12000"},
        "pricing": {"input_per_mtok": 0.15, "output_per_mtok": 0.6},
    }


async def _upstream_in_flight(fake: FakeState, count: int) -> bool:
    return int(fake.stats()["in_flight"]) >= count


async def _lost(ledger_url: str, count: int) -> list[Any] | None:
    lost = [e for e in await rows(ledger_url) if e.reconciliation_reason == "gateway_lost"]
    if len(lost) < count:
        return None
    assert {e.state for e in lost} == {"usage_reconciliation_required"}
    return lost
