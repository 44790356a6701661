"""Which PostgreSQL driver for the ledger: asyncpg or psycopg 3 (async), measured.

Two shapes the ledger does: (1) group commit — one transaction per batch holding one
multi-row insert of ``--batch`` rows; (2) a lone reserved row committed on its own
(the latency a request waits for at c=1). Each driver writes the same 32-column rows
into its own temporary schema. Run with small numbers to smoke it:

    python bench/pg_driver.py --seconds 2 --batch 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import psycopg

from ncap.domain.events import LEDGER_COLUMNS, LedgerEvent
from ncap.stores.postgres import ledger as pg
from ncap.stores.postgres import pool as _postgres

URL = "postgresql://postgres@127.0.0.1:5432/test"


def _rows(n: int, tag: str) -> list[tuple[Any, ...]]:
    now = datetime.now(UTC)
    return [
        tuple(
            pg._encode(c, getattr(LedgerEvent(now, f"{tag}-{i}", 1, "w", "prod"), c))
            for c in LEDGER_COLUMNS
        )
        for i in range(n)
    ]


async def _asyncpg(url: str, schema: str) -> tuple[Callable[[int, str], Awaitable[None]], Any]:
    conn = await asyncpg.connect(url, server_settings={"search_path": schema})
    await _postgres.migrate(conn, schema)

    async def write(n: int, tag: str) -> None:
        rows = _rows(n, tag)
        async with conn.transaction():
            await conn.fetch(pg._INSERT, *zip(*rows, strict=True))

    return write, conn.close


async def _psycopg(url: str, schema: str) -> tuple[Callable[[int, str], Awaitable[None]], Any]:
    conn = await psycopg.AsyncConnection.connect(url, options=f"-csearch_path={schema}")
    columns = ", ".join(LEDGER_COLUMNS)
    one = "(" + ", ".join(["%s"] * len(LEDGER_COLUMNS)) + ")"

    async def write(n: int, tag: str) -> None:
        rows = _rows(n, tag)
        sql = f"INSERT INTO ledger_events ({columns}) VALUES " + ", ".join([one] * n)
        async with conn.transaction():
            await conn.execute(sql, [v for row in rows for v in row])  # type: ignore[arg-type]

    return write, conn.close


async def _measure(
    write: Callable[[int, str], Awaitable[None]], n: int, seconds: float
) -> dict[str, float]:
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    count = 0
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        await write(n, uuid.uuid4().hex)
        latencies.append(time.perf_counter() - t)
        count += n
    elapsed = sum(latencies)
    return {
        "rows_per_s": round(count / elapsed),
        "p50_ms": round(statistics.median(latencies) * 1000, 3),
    }


async def main(url: str, seconds: float, batch: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    admin = await asyncpg.connect(url)
    for name, opener in (("asyncpg", _asyncpg), ("psycopg3", _psycopg)):
        schema = f"ncap_bench_{uuid.uuid4().hex[:8]}"
        await admin.execute(f'CREATE SCHEMA "{schema}"')
        try:
            setup = await asyncpg.connect(url, server_settings={"search_path": schema})
            await _postgres.migrate(setup, schema)
            await setup.close()
            write, close = await opener(url, schema)
            try:
                results[name] = {
                    f"batch_{batch}": await _measure(write, batch, seconds),
                    "single_row_commit": await _measure(write, 1, seconds),
                }
            finally:
                await close()
        finally:
            await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
    await admin.close()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default=URL)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.url, args.seconds, args.batch)), indent=2))
