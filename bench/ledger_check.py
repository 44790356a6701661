"""Ledger rows = requests: the gateway's SQLite ledger under load, counted afterwards.

Starts the fake upstream and ``ncap serve`` (durable SQLite ledger), sends exactly N
requests at concurrency C, stops the gateway gracefully (SIGTERM drains the
settlements), then opens the ledger file and checks that it holds exactly one
``settled`` row per answered request and that the upstream saw as many requests.

    .venv/bin/python bench/ledger_check.py [--requests 5000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import benchlib as bl
from gateway_bench import ncap_config_text


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--stores", default="ledger", choices=["ledger", "sqlite"])
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ncap-ledger-check-"))
    up_port, gw_port = bl.free_port(), bl.free_port()
    upstream = bl.start_server("upstream", bl.upstream_argv(up_port), work)
    config = work / "ncap.yaml"
    config.write_text(ncap_config_text(up_port, work, args.stores))
    gateway = bl.start_server(
        "ncap",
        [str(bl.ROOT / ".venv/bin/ncap"), "serve", "--config", str(config), "--port", str(gw_port)],
        work,
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
    rows = count_rows(work / "ledger.db")
    result = {
        "requests_sent": args.requests + 1,
        "answered_200": answered,
        "statuses": statuses,
        "ledger_rows_by_state": rows,
        "ledger_rows": sum(rows.values()),
        "throughput_rps": round(args.requests / elapsed, 1),
        "ok": rows == {"settled": answered} and answered == args.requests + 1,
    }
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
