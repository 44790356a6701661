"""The shipped default stores under load: SQLite ledger (durability normal) and
in-process budgets rebuilt from it. Every request is one settled row, and the
budget counters equal the sum of the ledger, live and after a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from ncap.config import Config
from ncap.domain.budget import Usage
from ncap.domain.events import LedgerEvent
from ncap.http.app import ACCOUNTING
from ncap.testing.fake_upstream import FakeState
from tests.http.test_accounting import final_rows
from tests.support import ServerThread, gateway, gateway_config

REQUESTS, CONCURRENCY = 5000, 64
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "Pick a number."}]}


def _default_config(upstream: str, tmp: Path) -> Config:
    config = gateway_config(
        upstream,
        tmp,
        server={"max_in_flight": 4096, "ramp": {"requests_per_second": 1e6, "burst": 1000000}},
        workloads={"default": {"max_concurrency": 2 * CONCURRENCY}},
    )
    raw = config.model_dump(mode="json", exclude_none=True)
    raw["stores"] = {"ledger": f"sqlite:///{tmp}/ledger.db"}  # budgets: the default
    return Config.model_validate(raw)


async def _fire(url: str) -> dict[int, int]:
    statuses: dict[int, int] = {}
    left = iter(range(REQUESTS))
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            for _ in left:
                async with session.post(url + "/v1/chat/completions", json=BODY) as resp:
                    await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return statuses


def _counters(server: ServerThread) -> tuple[Usage, list[Any]]:
    assert server.app is not None
    budgets = server.app[ACCOUNTING].budgets
    return server.call(budgets.usage("default")), server.call(budgets.outstanding())


def _ledger_sums(events: list[LedgerEvent]) -> tuple[int, int]:
    return sum(e.total_tokens or 0 for e in events), sum(e.cost_micros or 0 for e in events)


async def test_5000_requests_at_c64_one_settled_row_each_and_counters_equal_the_ledger(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    config = _default_config(fake[0], tmp_path)
    assert config.stores.budgets == "memory://"
    fake[1].reset()
    with gateway(config) as server:
        statuses = await _fire(server.url)
        events = await final_rows(tmp_path)
        live, held = _counters(server)
    assert statuses == {200: REQUESTS}
    assert fake[1].stats()["requests"] == REQUESTS
    assert len(events) == REQUESTS and {e.state for e in events} == {"settled"}
    assert len({e.request_id for e in events}) == REQUESTS
    tokens, cost = _ledger_sums(events)
    assert tokens > 0 and cost > 0
    assert (live.tokens_day, live.cost_day, live.cost_month) == (tokens, cost, cost)
    assert live.in_flight == 0 and held == []
    with gateway(config) as restarted:  # the counters rebuilt from the ledger alone
        rebuilt, held = _counters(restarted)
    assert (rebuilt.tokens_day, rebuilt.cost_day, rebuilt.cost_month) == (tokens, cost, cost)
    assert rebuilt.in_flight == 0 and held == []
