"""Ledger rows = requests: the gateway's SQLite ledger under load, counted afterwards.

Starts the fake upstream and ``ncap serve`` (by default the shipped default stores:
SQLite ledger, in-process budgets), sends exactly N requests at concurrency C, stops
the gateway gracefully (SIGTERM drains the settlements), then opens the ledger file
and checks that it holds exactly one ``settled`` row per answered request. Then it
checks the budgets against the ledger: in-process counters rebuilt from the file
(what a restarted gateway starts from) must equal the ledger's sums, and SQLite
budget counters (``--stores sqlite``) must too. The live in-process counters are
compared in tests/http/test_default_stores.py, which can reach into the process.

    .venv/bin/python bench/ledger_check.py [--requests 5000] [--concurrency 64]
        [--stores default|ledger-full|sqlite]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import benchlib as bl
from gateway_bench import ncap_config_text

from ncap.stores import MemoryBudgetStore, SQLiteBudgetStore, SQLiteLedgerStore


async def fire(url: str, body: bytes, total: int, concurrency: int) -> dict[int, int]:
    statuses: dict[int, int] = {}
    left = iter(range(total))
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:

        async def worker() -> None:
            for _ in left:
                async with s.post(url, data=body, headers=headers) as r:
                    await r.read()
                    statuses[r.status] = statuses.get(r.status, 0) + 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses


def count_rows(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        return dict(conn.execute("SELECT state, count(*) FROM ledger_events GROUP BY state"))


def ledger_sums(db: Path) -> dict[str, int]:
    """Today's tokens and spend by the ledger (settled rows: actuals)."""
    sql = (
        "SELECT COALESCE(SUM(total_tokens), 0), COALESCE(SUM(cost_micros), 0)"
        " FROM ledger_events WHERE state = 'settled' AND substr(timestamp, 1, 10) = ?"
    )
    with sqlite3.connect(db) as conn:
        tokens, cost = conn.execute(sql, (_today(),)).fetchone()
    return {"tokens_day": int(tokens), "cost_day": int(cost)}


def _today() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d")


async def rebuilt_counters(db: Path) -> dict[str, int]:
    """The in-process counters a gateway restarted on this ledger starts from."""
    ledger = SQLiteLedgerStore(db)
    try:
        budgets = MemoryBudgetStore(history=ledger)
        await budgets.recover_lost()
        usage = await budgets.usage("default")
        held = await budgets.outstanding()
    finally:
        await ledger.close()
    return {"tokens_day": usage.tokens_day, "cost_day": usage.cost_day, "held": len(held)}


async def sqlite_counters(db: Path) -> dict[str, int]:
    budgets = SQLiteBudgetStore(db, gateway_instance="ledger-check")
    try:
        usage = await budgets.usage("default")
        held = await budgets.outstanding()
    finally:
        await budgets.close()
    return {"tokens_day": usage.tokens_day, "cost_day": usage.cost_day, "held": len(held)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--stores", default="default", choices=["default", "ledger-full", "sqlite"])
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ncap-ledger-check-"))
    up_port, gw_port = bl.free_port(), bl.free_port()
    upstream = bl.start_server("upstream", bl.upstream_argv(up_port), work)
    config = work / "ncap.yaml"
    config.write_text(ncap_config_text(up_port, work, args.stores, 2 * args.concurrency))
    gateway = bl.start_server(
        "ncap",
        [str(bl.ROOT / ".venv/bin/ncap"), "serve", "--config", str(config), "--port", str(gw_port)],
        work,
        cwd=work,  # the shipped default's ledger: .ncap/ledger.db under it
    )
    url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
    try:
        bl.wait_ready(
            upstream, f"http://127.0.0.1:{up_port}/v1/chat/completions", bl.chat_body("fake-model")
        )
        bl.wait_ready(gateway, url, bl.chat_body("fake-model"))  # one request: counted below
        start = time.perf_counter()
        statuses = asyncio.run(
            fire(url, bl.chat_body("fake-model"), args.requests, args.concurrency)
        )
        elapsed = time.perf_counter() - start
    finally:
        bl.stop_server(gateway)
        bl.stop_server(upstream)
    answered = statuses.get(200, 0) + 1  # + the readiness probe
    db = work / (".ncap/ledger.db" if args.stores == "default" else "ledger.db")
    rows = count_rows(db)
    sums = ledger_sums(db)
    counters = asyncio.run(rebuilt_counters(db))
    if args.stores == "sqlite":
        counters = asyncio.run(sqlite_counters(work / "budgets.db"))
    counters_ok = counters == {**sums, "held": 0}
    result = {
        "requests_sent": args.requests + 1,
        "answered_200": answered,
        "statuses": statuses,
        "ledger_rows_by_state": rows,
        "ledger_rows": sum(rows.values()),
        "throughput_rps": round(args.requests / elapsed, 1),
        "ledger_sums": sums,
        "budget_counters": counters,
        "ok": rows == {"settled": answered} and answered == args.requests + 1 and counters_ok,
    }
    print(json.dumps(result, indent=2))
    bl.save_result(
        f"ledger-{args.stores}" if args.stores != "default" else "ledger",
        [table(result, args)],
        raw=result,
    )
    sys.exit(0 if result["ok"] else 1)


def table(result: dict[str, Any], args: argparse.Namespace) -> bl.Table:
    """One row: what was sent and answered, what the ledger and the counters hold."""
    columns = ["requests sent", "answered 200", "ledger rows", "rows by state", "req/s"]
    columns += ["ledger sums", "budget counters", "books agree"]
    keys = ["requests_sent", "answered_200", "ledger_rows", "ledger_rows_by_state"]
    keys += ["throughput_rps", "ledger_sums", "budget_counters", "ok"]
    title = f"{args.requests:,} requests at c={args.concurrency}, {args.stores} stores"
    return bl.Table(title, columns, [[result[k] for k in keys]])


if __name__ == "__main__":
    main()
