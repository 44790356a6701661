"""PostgreSQL partitioned (packets dropped, nothing reset) under load: every request is
answered within ``stores.timeout_s`` + 1 s, and once the network heals no row is left
``reserved`` (not even one whose INSERT reached the server after its caller was told
nothing was sent), rows = upstream calls and the Redis counters equal the ledger."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from ncap.domain.events import LedgerEvent
from ncap.stores import budgets_from_url
from ncap.testing.fake_upstream import FakeState
from tests.scale.support import Client, chat, client, gateways, rows, shared_config, wait_for
from tests.servers import tcp_proxy
from tests.services import PG_URL, pg_schema, redis_prefix

pytestmark = [pytest.mark.postgresql, pytest.mark.redis]

BOUND_S = 2.0  # stores.timeout_s: the default


async def _load(http: Client, url: str, until: float, out: list[tuple[float, int, Any]]) -> None:
    while time.monotonic() < until:
        sent = time.monotonic()
        reply = await http.post(url + "/v1/chat/completions", json=chat())
        code = reply.json()["error"]["code"] if reply.status_code != 200 else None
        out.append((time.monotonic() - sent, reply.status_code, code))


@pytest.mark.parametrize("partition_s", [1, 8, 30])
async def test_postgresql_partitioned_under_load(
    fake: tuple[str, FakeState], tmp_path: Path, partition_s: float
) -> None:
    target = urlsplit(PG_URL)
    async with pg_schema() as ledger_url, redis_prefix() as budgets_url:
        with tcp_proxy(target.hostname or "127.0.0.1", target.port or 5432) as proxy:
            proxied = ledger_url.replace(
                f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}"
            )
            config = shared_config(
                fake[0],
                tmp_path,
                proxied,
                budgets_url,
                stores={"ledger": proxied, "budgets": budgets_url, "timeout_s": BOUND_S},
                # rows may stay reserved 5 + 2 s at most (then reserved_timeout)
                limits={"max_stream_s": 5},
                routes={"fake": {"headers": {"x-fake-fault": "latency=50"}, "retries": 0}},
            )
            fake[1].reset()
            with gateways(config, 1, tmp_path / "gw.log") as [gw]:
                replies: list[tuple[float, int, Any]] = []
                async with client() as http:
                    end = time.monotonic() + 1.0 + partition_s + 3.0
                    load = [
                        asyncio.create_task(_load(http, gw.url, end, replies)) for _ in range(8)
                    ]
                    await asyncio.sleep(1.0)
                    await asyncio.to_thread(proxy.partition)
                    await asyncio.sleep(partition_s)
                    await asyncio.to_thread(proxy.heal)
                    await asyncio.gather(*load)
                events = await wait_for(lambda: _none_reserved(ledger_url), timeout=30)
                assert events, "rows were left reserved after the partition healed"
            usage, held = await _counters(budgets_url)

    statuses = Counter(status for _, status, _ in replies)
    codes = Counter(code for _, _, code in replies if code is not None)
    slowest = max(seconds for seconds, _, _ in replies)
    assert slowest <= BOUND_S + 1.0, (slowest, statuses)
    assert set(statuses) <= {200, 503} and set(codes) <= {"store_unavailable"}, (statuses, codes)
    if partition_s > BOUND_S:  # a longer partition is refused, not waited out
        assert statuses[503] > 0, statuses
    admitted = [e for e in events if e.policy_result == "allow"]
    assert len(admitted) == fake[1].requests  # rows = upstream calls
    assert statuses[200] <= len(admitted)
    assert held == []  # no hold outlives its row, no reserved row is without its hold
    spent = [e for e in admitted if e.state == "settled"]
    assert len(spent) == len(admitted), Counter(e.state for e in admitted)
    assert usage == (
        sum(e.total_tokens or 0 for e in spent),
        sum(e.cost_micros or 0 for e in spent),
    )


async def _none_reserved(ledger_url: str) -> list[LedgerEvent] | None:
    events = await rows(ledger_url)
    return None if any(e.state == "reserved" for e in events) else events


async def _counters(budgets_url: str) -> tuple[tuple[int, int], list[Any]]:
    budgets = budgets_from_url(budgets_url)
    try:
        usage = await budgets.usage("default")
        return (usage.tokens_day, usage.cost_day), await budgets.outstanding()
    finally:
        await budgets.close()
