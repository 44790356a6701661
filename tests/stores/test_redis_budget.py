"""What the Redis budget store adds to the contract: the script by SHA, server time,
expiring hash-tagged keys, pipelined calls, and failing closed while Redis is away."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

import ncap.stores.redis.budgets as rb
from ncap.domain.budget import Amounts, BudgetWindows
from ncap.errors import StoreUnavailable
from ncap.stores import MemoryLedgerStore, RedisBudgetStore
from tests.servers import free_port, private_redis
from tests.services import REDIS_URL, redis_prefix

pytestmark = pytest.mark.redis

W = "team{a}"  # braces in a workload id must not break the hash tag
WINDOWS = BudgetWindows(usd_per_day_micros=1_000_000, max_concurrency=4)
# a new deployment: counters built from an empty ledger on first use
FRESH: dict[str, Any] = {"history": MemoryLedgerStore(), "rebuild_grace_s": 0}


async def test_script_is_called_by_sha_and_reloaded_after_a_flush() -> None:
    async with redis_prefix() as url:
        store = RedisBudgetStore(url, **FRESH)
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            await store.reserve("w", WINDOWS, Amounts(10, 10))
            sha = store._script.sha
            assert (await client.script_exists(sha)) == [True]
            await client.script_flush()
            assert (await client.script_exists(sha)) == [False]
            await store.reserve("w", WINDOWS, Amounts(10, 10))  # NOSCRIPT -> load -> retry
            assert (await client.script_exists(sha)) == [True]
            assert (await store.usage("w")).in_flight == 2
        finally:
            await store.close()
            await client.aclose()


async def test_windows_use_the_server_clock_and_keys_expire_under_one_hash_tag() -> None:
    async with redis_prefix() as url:
        store = RedisBudgetStore(url, **FRESH)  # no clock: the server's TIME
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            seconds, _ = await client.time()
            hold = await store.reserve(W, WINDOWS, Amounts(10, 10), exception_id="x1")
            assert abs(hold.created_at.timestamp() - seconds) < 5
            prefix = store.prefix
            keys = sorted([k.decode() async for k in client.scan_iter(match=f"{prefix}:*")])
            tagged = [k for k in keys if not k.endswith(":workloads")]
            tags = {k.split("{", 1)[1].split("}", 1)[0] for k in tagged}
            assert len(tags) == 1 and "{" not in next(iter(tags))  # one slot per workload
            ttls = {k.split("}:", 1)[1].split(":")[0]: await client.ttl(k) for k in tagged}
            assert 0 < ttls["tm"] <= 120 and 0 < ttls["rm"] <= 120
            assert 86_400 < ttls["td"] <= 172_800 and 86_400 < ttls["cd"] <= 172_800
            assert 28 * 86_400 < ttls["cm"] <= 35 * 86_400
            holds_key = next(k for k in tagged if k.endswith(":h"))
            assert await client.ttl(holds_key) == -1  # holds live until settled
            assert await store.settle(hold, 5, 5)
            assert (await store.usage(W, exception_id="x1")).cost_exception == 5
        finally:
            await store.close()
            await client.aclose()


async def test_unreachable_redis_fails_closed_and_recovers_by_itself(tmp_path: Path) -> None:
    nobody = RedisBudgetStore(f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=0.5)
    with pytest.raises(StoreUnavailable) as info:
        await nobody.reserve("w", WINDOWS, Amounts(1, 1))
    assert info.value.status == 503 and info.value.store == "budgets"
    await nobody.close()
    with private_redis(tmp_path) as server:
        store = RedisBudgetStore(server.url, connect_timeout_s=0.5, timeout_s=1, **FRESH)
        try:
            await store.reserve("w", WINDOWS, Amounts(1, 1))
            server.stop()
            for _ in range(2):
                with pytest.raises(StoreUnavailable):
                    await store.reserve("w", WINDOWS, Amounts(1, 1))
            server.start()  # an empty Redis: the script is reloaded on NOSCRIPT, and the
            # counters, lost, are rebuilt (503 until they are)
            hold = None
            for _ in range(20):
                try:
                    hold = await store.reserve("w", WINDOWS, Amounts(1, 1))
                    break
                except StoreUnavailable:
                    await asyncio.sleep(0.1)
            assert hold is not None and await store.release(hold)
            assert store.rebuilds == 2  # at first use (a new deployment), then after the restart
        finally:
            await store.close()


async def test_calls_made_while_one_is_in_flight_share_the_next_pipeline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes: list[int] = []
    real = rb._Pipelined._pipeline

    async def counting(self: Any, calls: list[Any]) -> Any:
        sizes.append(len(calls))
        return await real(self, calls)

    monkeypatch.setattr(rb._Pipelined, "_pipeline", counting)
    many = BudgetWindows(usd_per_day_micros=10**9, max_concurrency=1000)
    async with redis_prefix() as url:
        store = RedisBudgetStore(url, **FRESH)
        try:
            await store.reserve("w", many, Amounts(1, 1))  # alone: sent at once, by itself
            assert sizes == []
            holds = await asyncio.gather(
                *(store.reserve("w", many, Amounts(1, 1)) for _ in range(60))
            )
            # the first goes by itself; the rest wait for it and go in a few pipelines
            assert sum(sizes) == 59 and len(sizes) < 10, sizes
            assert len({h.hold_id for h in holds}) == 60
            assert (await store.usage("w")).in_flight == 61
            settled = await asyncio.gather(*(store.settle(h, 0, 0) for h in holds))
            assert settled == [True] * 60
            assert (await store.usage("w")).in_flight == 1
        finally:
            await store.close()


async def test_noscript_in_a_pipeline_reloads_once_and_runs_each_call_once() -> None:
    many = BudgetWindows(usd_per_day_micros=10**9, max_concurrency=1000)
    async with redis_prefix() as url:
        store = RedisBudgetStore(url, **FRESH)
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            await store.reserve("w", many, Amounts(1, 1))
            await client.script_flush()
            loop = asyncio.get_running_loop()
            batch = [
                (
                    store._base("w"),
                    tuple(store._reserve_args("w", many, Amounts(1, 1), None, None, f"h{i}")),
                    loop.create_future(),
                )
                for i in range(5)
            ]
            await store._calls._resolve(batch)  # one pipeline: every call meets NOSCRIPT
            assert [int(f.result()[0]) for _, _, f in batch] == [1] * 5
            assert (await client.script_exists(store._script.sha)) == [True]
            assert (await store.usage("w")).in_flight == 6
        finally:
            await store.close()
            await client.aclose()


async def test_a_failing_call_fails_alone_in_its_pipeline() -> None:
    many = BudgetWindows(usd_per_day_micros=10**9, max_concurrency=1000)
    async with redis_prefix() as url:
        store = RedisBudgetStore(url, **FRESH)
        try:
            await store.reserve("w", many, Amounts(1, 1))
            results = await asyncio.gather(
                store.reserve("w", many, Amounts(1, 1)),
                store._call("w", "no-such-op"),  # the script refuses it
                store.reserve("w", many, Amounts(1, 1)),
                return_exceptions=True,
            )
            assert isinstance(results[1], StoreUnavailable)
            assert not isinstance(results[0], BaseException)
            assert not isinstance(results[2], BaseException)
            assert (await store.usage("w")).in_flight == 3
        finally:
            await store.close()


async def test_a_sender_cancelled_before_it_ran_does_not_stall_later_calls() -> None:
    async with redis_prefix() as url:
        store = RedisBudgetStore(url, **FRESH)
        calls = store._calls
        try:
            await store.usage("w")
            waiting: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            calls._queue.append((store._base("w"), ("usage", "", ""), waiting))
            calls._send_later()
            assert calls._sender is not None
            calls._sender.cancel()  # before its first step
            usage = await asyncio.wait_for(waiting, 5)  # another sender took it
            assert int(usage[-1]) == 0
            assert (await asyncio.wait_for(store.usage("w"), 5)).in_flight == 0
        finally:
            await store.close()
