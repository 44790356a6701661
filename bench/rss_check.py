"""Resident memory after many requests: RSS after N requests within 10 % of after N/10.

For every store set-up (the ncap targets of gateway_bench.py) it starts the fake
upstream and ``ncap serve``, sends ``--small`` requests (default 20,000) at
``--concurrency``, reads the gateway's RSS (VmRSS of its process tree), sends more
until ``--large`` (default 200,000) and reads it again. A gateway that keeps
something per request (an unbounded memory ledger, a label per request id) grows
with the count; a bounded one stays flat. Results go to stdout as markdown and to
bench/results/rss.json.

    .venv/bin/python bench/rss_check.py [--setups ncap,ncap-memory,...]
        [--small 20000] [--large 200000] [--concurrency 16] [--tolerance 0.10]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib as bl
import gateway_bench as gb


def send(target: gb.Target, count: int, concurrency: int) -> dict[str, Any]:
    """``count`` requests through loadgen's count mode, after a 6 s warm-up: the shipped
    default's ramp limiter answers 429 ``slow_down`` while load steps up from idle (its
    job); the warm-up's answers are not counted, errors after it are."""
    argv = [str(bl.VENV_PY), str(bl.BENCH / "loadgen.py"), target.url, "-c", str(concurrency)]
    argv += ["--requests", str(count), "--warmup", "6", "--json"]
    out = subprocess.run(argv, capture_output=True, timeout=3600)
    if not out.stdout:
        raise RuntimeError(out.stderr.decode(errors="replace")[-2000:])
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def check(run: gb.Run, name: str, args: argparse.Namespace) -> dict[str, Any]:
    target = gb.ncap_target(run, name)
    if isinstance(target, str):
        return {"setup": name, "skipped": target}
    try:
        first = send(target, args.small, args.concurrency)
        time.sleep(0.5)  # settlements of the last requests
        rss_small = bl.rss_mib(target.server.pid)
        second = send(target, args.large - args.small, args.concurrency)
        time.sleep(0.5)
        rss_large = bl.rss_mib(target.server.pid)
    finally:
        bl.stop_server(target.server)
    growth = rss_large / rss_small - 1
    return {
        "setup": name,
        "stores": gb.NCAP_STORES[name],
        "rss_mib_after_small": rss_small,
        "rss_mib_after_large": rss_large,
        "growth": round(growth, 3),
        "errors": first["errors"] + second["errors"],
        "ok": growth <= args.tolerance and not (first["errors"] or second["errors"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--setups", default=",".join(gb.NCAP_STORES))
    p.add_argument("--small", type=int, default=20_000)
    p.add_argument("--large", type=int, default=200_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tolerance", type=float, default=0.10)
    args = p.parse_args(argv)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    bench_args = gb.parse_args(["--concurrency", str(args.concurrency)])
    work = Path(tempfile.mkdtemp(prefix="ncap-rss-"))
    upstream, port = gb.start_upstream(work, bench_args)
    run = gb.Run(bench_args, work, upstream, port)
    try:
        rows = [check(run, name, args) for name in setups]
    finally:
        bl.stop_server(upstream)
        shutil.rmtree(work, ignore_errors=True)
    doc = {"machine": bl.machine_info(), "small": args.small, "large": args.large, "rows": rows}
    headers = ["setup", f"RSS MiB after {args.small}", f"after {args.large}", "growth", "ok"]
    keys = ("rss_mib_after_small", "rss_mib_after_large")
    body = [
        [
            r["setup"],
            *(r.get(k, "n/a") for k in keys),
            r.get("growth", r.get("skipped")),
            r.get("ok"),
        ]
        for r in rows
    ]
    print(bl.md_table(headers, body))
    title = f"Resident memory after {args.small:,} and {args.large:,} requests"
    table = bl.Table(
        title,
        headers,
        body,
        notes=f"c={args.concurrency}; ok: growth ≤ {args.tolerance:.0%} and no errors.",
    )
    bl.save_result("rss", [table], raw=doc)
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
