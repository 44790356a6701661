"""Redis restarted empty mid-load under three gateways: the counters know they were
lost, every gateway refuses (503 ``store_unavailable``) until one has rebuilt them
from the ledger, and the budget is never spent twice."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ncap.domain.events import LedgerEvent
from ncap.stores import budgets_from_url
from ncap.testing.fake_upstream import FakeState
from tests.scale.support import Client, chat, client, gateways, rows, shared_config, wait_for
from tests.scale.test_shared_stores import CEILING
from tests.servers import private_redis
from tests.services import pg_schema

pytestmark = [pytest.mark.postgresql, pytest.mark.redis]
# a small output cap: each reservation is close to what the answer costs, so the
# budget is reached by spend, not by the worst cases of the requests in flight
BODY = {**chat(), "max_tokens": 12}


async def _load(http: Client, urls: list[str], until: float, out: list[tuple[float, int, Any]]):
    i = 0
    while time.monotonic() < until:
        reply = await http.post(urls[i % len(urls)] + "/v1/chat/completions", json=BODY)
        code = reply.json()["error"]["code"] if reply.status_code != 200 else None
        out.append((time.monotonic(), reply.status_code, code))
        i += 1


async def test_redis_restarted_empty_mid_load_with_three_gateways(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    # about 150 answers (7 micro-USD each on the fake): spent in about two seconds
    budget_micros = 150 * 7
    async with pg_schema() as ledger_url:
        with private_redis(tmp_path) as redis_server:  # no persistence: restarts empty
            budgets_url = redis_server.url + "?prefix=lost"
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
                routes={"fake": {"headers": {"x-fake-fault": "latency=150"}, "timeout_s": 10}},
            )
            fake[1].reset()
            with gateways(config, 3, tmp_path / "gw.log") as gws:
                urls = [gw.url for gw in gws]
                replies: list[tuple[float, int, Any]] = []
                async with client() as http:
                    start = time.monotonic()
                    load = [
                        asyncio.create_task(_load(http, urls, start + 7.0, replies))
                        for _ in range(12)
                    ]
                    await asyncio.sleep(1.5)  # requests in flight, spend under way
                    restarted_at = time.monotonic()
                    await asyncio.to_thread(redis_server.stop)
                    await asyncio.to_thread(redis_server.start)  # empty: no persistence
                    back_at = time.monotonic()
                    await asyncio.gather(*load)
                events = await wait_for(lambda: _all_closed(ledger_url), timeout=20)
            counters = await _counters(budgets_url)

    statuses = Counter(status for _, status, _ in replies)
    codes = Counter(code for _, _, code in replies if code is not None)
    assert set(statuses) <= {200, 429, 503}, (statuses, codes)
    assert set(codes) <= {"budget_exhausted", "store_unavailable"}, codes
    # refused while the counters were lost, then served (or refused by budget) again
    unavailable = [t for t, status, _ in replies if status == 503]
    assert unavailable and min(unavailable) >= restarted_at - 0.1
    after = [s for t, s, _ in replies if t > max(unavailable)]
    assert after and set(after) <= {200, 429}
    assert any(s == 200 for t, s, _ in replies if t < restarted_at)
    # overshoot 0 over the whole run: the forgotten spend was not spent again
    admitted = [e for e in events if e.policy_result == "allow"]
    spent = sum(e.cost_micros or 0 for e in admitted)
    assert 0 < spent <= budget_micros, (spent, budget_micros)
    assert 429 in statuses  # the budget was reached, so overshoot was possible
    assert len(admitted) == statuses[200] == fake[1].requests  # rows = upstream calls
    # the counters equal the ledger: rebuilt spend plus what was settled since
    assert counters == (
        sum(e.total_tokens or 0 for e in admitted),
        spent,
    ), (counters, back_at)


async def _all_closed(ledger_url: str) -> list[LedgerEvent] | None:
    events = await rows(ledger_url)
    return None if any(e.state == "reserved" for e in events) else events


async def _counters(budgets_url: str) -> tuple[int, int]:
    budgets = budgets_from_url(budgets_url)
    try:
        usage = await budgets.usage("default")
        assert await budgets.outstanding("default") == []
        return usage.tokens_day, usage.cost_day
    finally:
        await budgets.close()
