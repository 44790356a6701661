"""The measurements behind the gateway's stack choice, all in one run.

(a) A bare pass-through proxy built on each candidate server/client stack
    (bench/proxies.py) against the same fake upstream: throughput, p50, p99 and
    the proxy's CPU per request at concurrency 1 and 16. Every proxy is started
    up front and the stacks are measured round-robin for --rounds rounds, taking
    the median per point, so a burst of background load hits all stacks alike.
(b) Request-validation cost for a ~1 KB chat body (bench/validation_bench.py).

Layout as in gateway_bench.py: fake upstream on CPU 1, load generator on CPU 0,
proxy unpinned. Results: markdown on stdout, JSON in bench/results/stack.json.

Usage: .venv/bin/python bench/stack_choice.py [--rounds 3] [--duration 4] [--warmup 1]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import benchlib as bl
import validation_bench
from gateway_bench import PIN_LOADGEN, PIN_UPSTREAM, busy_fraction
from proxies import KINDS

CONCURRENCY = (1, 16)
VERSIONS = (
    "aiohttp",
    "httpx",
    "uvicorn",
    "httptools",
    "granian",
    "uvloop",
    "msgspec",
    "pydantic",
    "orjson",
)


def start_proxies(
    work: Path, upstream_url: str, args: argparse.Namespace
) -> dict[str, tuple[bl.Server, str]]:
    """Start one proxy per stack; returns kind -> (server, url)."""
    out: dict[str, tuple[bl.Server, str]] = {}
    for kind in args.stacks:
        port = bl.free_port()
        argv = [*bl.pin_prefix(args.pin_target), str(bl.VENV_PY), str(bl.BENCH / "proxies.py")]
        argv += [kind, "--port", str(port)]
        argv += ["--upstream", upstream_url]
        server = bl.start_server(kind.replace("+", "_"), argv, work)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        out[kind] = (server, url)
    for kind, (server, url) in out.items():
        bl.wait_ready(server, url, bl.chat_body("fake-model"), timeout_s=30)
        print(f"{kind}: ready", file=sys.stderr, flush=True)
    return out


def one_point(
    server: bl.Server, url: str, c: int, args: argparse.Namespace, upstream_pid: int
) -> dict[str, Any]:
    with bl.measured(server.pid, [upstream_pid]) as cpu:
        res = bl.run_loadgen(
            url, "fake-model", c, args.duration, args.warmup, cpus=args.pin_loadgen
        )
    rps = float(res["throughput_rps"])  # type: ignore[arg-type]
    loaded = args.duration + args.warmup
    res["cpu_ms_per_req"] = round(1000 * cpu["cpu_s"] / (rps * loaded), 3) if rps else None
    res["rss_mib"] = bl.rss_mib(server.pid)
    res["foreign_cpu_share"] = round(cpu["foreign_share"], 3)
    return res


def run_rounds(
    targets: dict[str, tuple[bl.Server, str]], args: argparse.Namespace, upstream_pid: int
) -> dict[tuple[str, int], list[dict[str, Any]]]:
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for kind, (server, url) in targets.items():
            for c in CONCURRENCY:
                res = one_point(server, url, c, args, upstream_pid)
                samples.setdefault((kind, c), []).append(res)
                print(
                    f"round {r + 1} {kind:<22} c={c:<3} {res['throughput_rps']:>8} req/s "
                    f"p50={res['p50_ms']} ms cpu/req={res['cpu_ms_per_req']} ms "
                    f"foreign={res['foreign_cpu_share']:.0%}",
                    file=sys.stderr,
                    flush=True,
                )
    return samples


def _median(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


def summarise(samples: dict[tuple[str, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for (kind, c), runs in samples.items():
        rows.append(
            {
                "stack": kind,
                "concurrency": c,
                "throughput_rps": _median([r["throughput_rps"] for r in runs]),
                "p50_ms": _median([r["p50_ms"] for r in runs]),
                "p99_ms": _median([r["p99_ms"] for r in runs]),
                "cpu_ms_per_req": _median([r["cpu_ms_per_req"] for r in runs]),
                "rss_mib": max(r["rss_mib"] for r in runs),
                "errors": sum(r["errors"] for r in runs),
                "foreign_cpu_share": _median([r["foreign_cpu_share"] for r in runs]),
                "throughput_each_round": [r["throughput_rps"] for r in runs],
            }
        )
    return rows


def proxy_table(rows: list[dict[str, Any]]) -> bl.Table:
    headers = ["stack (server+client)", "c", "req/s", "p50 ms", "p99 ms", "CPU ms/req"]
    headers += ["RSS MiB", "errors", "foreign CPU"]
    keys = ("stack", "concurrency", "throughput_rps", "p50_ms", "p99_ms", "cpu_ms_per_req")
    body = [
        [r[k] for k in (*keys, "rss_mib", "errors")] + [f"{r['foreign_cpu_share']:.0%}"]
        for r in rows
    ]
    return bl.Table("Pass-through proxies on each stack", headers, body)


def validation_table(rows: list[dict[str, Any]]) -> bl.Table:
    headers = ["validator", "valid body µs/call", "unknown-field body µs/call", "body bytes"]
    body = [
        [r["implementation"], r["valid_us"], r["invalid_unknown_field_us"], r["body_bytes"]]
        for r in rows
    ]
    return bl.Table("Request validation", headers, body)


def versions() -> dict[str, str]:
    out = {}
    for name in VERSIONS:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "missing"
    return out


def measure_proxies(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    port = bl.free_port()
    argv = [*bl.pin_prefix(args.pin_upstream), *bl.upstream_argv(port, args.upstream_module)]
    upstream = bl.start_server("upstream", argv, work)
    upstream_url = f"http://127.0.0.1:{port}/v1/chat/completions"
    targets: dict[str, tuple[bl.Server, str]] = {}
    try:
        bl.wait_ready(upstream, upstream_url, bl.chat_body("fake-model"), timeout_s=30)
        targets = {"direct (fake upstream)": (upstream, upstream_url)}
        targets.update(start_proxies(work, upstream_url, args))
        return summarise(run_rounds(targets, args, upstream.pid))
    finally:
        for server, _ in targets.values():
            bl.stop_server(server)
        bl.stop_server(upstream)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--validation-calls", type=int, default=20000)
    p.add_argument("--skip-proxies", action="store_true")
    p.add_argument("--upstream-module", help="force 'ncap.testing.fake_upstream' or 'standin'")
    p.add_argument("--pin-upstream", default=PIN_UPSTREAM)
    p.add_argument("--pin-loadgen", default=PIN_LOADGEN)
    p.add_argument("--pin-target", default="", help="taskset CPU list for the proxies")
    p.add_argument("--stacks", default=",".join(KINDS), help="comma list of proxies.KINDS")
    args = p.parse_args(argv)
    args.stacks = [k for k in args.stacks.split(",") if k]
    unknown = set(args.stacks) - set(KINDS)
    if unknown:
        p.error(f"unknown stacks {sorted(unknown)}; choose from {KINDS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = bl.machine_info()
    info["busy_fraction_before"] = busy_fraction()
    work = Path(tempfile.mkdtemp(prefix="ncap-stack-"))
    try:
        proxy_rows = [] if args.skip_proxies else measure_proxies(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    validation_rows = validation_bench.run(args.validation_calls)
    info["loadavg_at_end"] = bl.loadavg()
    doc = {
        "machine": info,
        "versions": versions(),
        "settings": vars(args) | {"upstream": args.upstream_module or bl.fake_upstream_module()},
        "proxies": proxy_rows,
        "validation": validation_rows,
    }
    tables = [proxy_table(proxy_rows)] if proxy_rows else []
    tables.append(validation_table(validation_rows))
    for table in tables:
        print(bl.md_table(table.columns, table.rows) + "\n")
    bl.save_result("stack", tables, raw=doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
