"""Store operations per second, each backend against the embedded ones.

budgets: one reservation + its settlement per request (``reserve`` then ``settle``);
ledger:  one reserved row + its settlement update per request (``append`` then
``update``), the writes a request costs. ``--concurrency`` requests run at once, so
the group-commit backends batch as they do under a real gateway. Smoke-run with:

    python bench/store_ops.py --seconds 2 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import redis.asyncio as aioredis

from ncap.domain.budget import Amounts, BudgetWindows
from ncap.domain.events import LedgerEvent
from ncap.stores import (
    BudgetStore,
    LedgerStore,
    MemoryLedgerStore,
    budgets_from_url,
    ledger_from_url,
)

PG = "postgresql://postgres@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"
WINDOWS = BudgetWindows(
    tokens_per_minute=10**12,
    requests_per_minute=10**9,
    usd_per_day_micros=10**15,
    max_concurrency=10**6,
)


async def _run(
    op: Callable[[int], Awaitable[None]], seconds: float, concurrency: int
) -> dict[str, float]:
    """Requests per second, and this process's CPU per request (the gateway's share)."""
    done = 0
    deadline = time.perf_counter() + seconds
    start, cpu = time.perf_counter(), time.process_time()

    async def worker(w: int) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < deadline:
            await op(w * 10**9 + i)
            i += 1
            done += 1

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return {
        "per_s": round(done / (time.perf_counter() - start)),
        "client_cpu_us": round((time.process_time() - cpu) / max(done, 1) * 1e6),
    }


async def budget_ops(store: BudgetStore, seconds: float, concurrency: int) -> dict[str, float]:
    async def op(i: int) -> None:
        hold = await store.reserve("bench", WINDOWS, Amounts(1_000, 500))
        await store.settle(hold, 800, 400)

    return await _run(op, seconds, concurrency)


async def ledger_ops(store: LedgerStore, seconds: float, concurrency: int) -> dict[str, float]:
    run = uuid.uuid4().hex[:8]

    async def op(i: int) -> None:
        rid = f"{run}-{i}"
        await store.append(LedgerEvent(datetime.now(UTC), rid, 1, "bench", "prod"))
        await store.update(rid, 1, state="settled", cost_micros=400, input_tokens=10)

    return await _run(op, seconds, concurrency)


async def main(seconds: float, concurrency: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ncap-bench-"))
    prefix = f"ncap_bench_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(PG)
    out: dict[str, Any] = {"concurrency": concurrency, "budgets": {}, "ledger": {}}
    try:
        for name, url in (
            ("memory", "memory://"),
            ("sqlite", f"sqlite:///{tmp}/b.db"),
            ("redis", f"{REDIS}?prefix={prefix}"),
        ):
            # a new deployment: Redis counters are built from an (empty) ledger first
            budgets = budgets_from_url(url, gateway_instance="bench", history=MemoryLedgerStore())
            try:
                out["budgets"][name] = await budget_ops(budgets, seconds, concurrency)
            finally:
                await budgets.close()
        for name, url in (
            ("memory", "memory://"),
            ("sqlite", f"sqlite:///{tmp}/l.db"),
            ("postgresql", f"{PG}?schema={prefix}"),
        ):
            ledger = ledger_from_url(url)
            try:
                out["ledger"][name] = await ledger_ops(ledger, seconds, concurrency)
            finally:
                await ledger.close()
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{prefix}" CASCADE')
        await admin.close()
        client = aioredis.Redis.from_url(REDIS)
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    out["unit"] = "per_s: requests/s (reserve+settle, or append+update); client_cpu_us: CPU"
    out["unit"] += " of this process per request (SQLite's writer thread included)"
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.seconds, args.concurrency)), indent=2))
