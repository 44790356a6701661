"""Gateway overhead benchmark: the fake upstream direct, through a bare aiohttp
pass-through, through ncap on each store set-up, through Portkey and through LiteLLM.

Targets: ``direct`` (the fake upstream itself: the base of "added" latency), ``bare``
(bench/proxies.py aiohttp+aiohttp: Python's floor, the base of the × ratios),
``ncap-memory`` (memory ledger and budgets, limits lifted), ``ncap-ledger`` (SQLite
ledger with ``ledger_durability: full`` and in-process budgets, limits lifted),
``ncap`` (the shipped default: a config with only the route to the fake upstream and
a workload ``max_concurrency`` above the load's concurrency; run from its own working
directory so ``.ncap/ledger.db`` lands there), ``ncap-sqlite`` (SQLite ledger and
SQLite budgets, both ``synchronous=FULL``: the earlier default), ``portkey``
(``@portkey-ai/gateway`` from npm, scripts/setup-portkey.sh) and ``litellm``.
``ncap-shared`` is one gateway on the shared stores (PostgreSQL ledger + Redis budgets,
``NCAP_BENCH_POSTGRES`` / ``NCAP_BENCH_REDIS``, a database and key prefix of the run's
own, dropped afterwards) and ``ncap-shared-2w`` the same with ``ncap serve --workers 2``:
the ratios give shared over the embedded default, and 2 workers over 1.

One run starts the fake upstream and every target up front (idle targets cost
next to nothing), warms each, then measures round-robin: every round visits every
target at every concurrency with a warm-up and a closed-loop measurement by
bench/loadgen.py, and the table reports the median over rounds. Per point it also
records the target's resident memory (VmRSS of its process tree), its CPU per
request, and the share of the machine used by *foreign* processes meanwhile (the
noise indicator: other work on a shared 2-core machine). Results go to stdout as
markdown and to bench/results/gateway.json (the result envelope that BENCHMARKS.md
is rendered from).

The shipped default keeps its ramp limiter, which lets a load grow by 500 requests a
second and starts again from its burst after 10 idle seconds (the other targets'
turns): before each of its points it is loaded in steps of 2 s until one passes with
no 429, so the point measures its steady state, not its growth limit.

CPU layout (2 cores; see the PIN_* defaults): the fake upstream is pinned to CPU 1,
the load generator to CPU 0, and the gateway under test is left to the scheduler,
so every target competes with the same two fixed processes in the same places.
Measured for an aiohttp pass-through at c=16: this layout 2,300 req/s, nothing
pinned 2,570, gateway alone on CPU 0 with upstream and load generator sharing CPU 1
only 1,810 (that shared core saturates first and caps every fast target). Only
ratios measured side by side in one run are meaningful; absolute numbers depend on
this machine and its load.

Usage:
    .venv/bin/python bench/gateway_bench.py [--targets direct,ncap,litellm]
        [--concurrency 1,16,64] [--rounds 3] [--duration 5] [--warmup 1]
        [--stream] [--ncap-config FILE] [--output RAW.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import benchlib as bl

TARGETS = (
    "direct",
    "bare",
    "ncap-memory",
    "ncap-ledger",
    "ncap",
    "ncap-sqlite",
    "ncap-shared",
    "ncap-shared-2w",
    "ncap-host-2w",
    "portkey",
    "litellm",
)
# ncap target -> its stores (see ncap_config_text); "default" is the shipped default
NCAP_STORES = {
    "ncap-memory": "memory",
    "ncap-ledger": "ledger-full",
    "ncap": "default",
    "ncap-sqlite": "sqlite",
    "ncap-shared": "shared",
    "ncap-shared-2w": "shared",
    "ncap-host-2w": "host",
}
NCAP_WORKERS = {"ncap-shared-2w": 2, "ncap-host-2w": 2}
BENCH_POSTGRES = os.environ.get("NCAP_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
BENCH_REDIS = os.environ.get("NCAP_BENCH_REDIS", "redis://127.0.0.1:6379/0")
DEFAULT_TARGETS = (
    "direct,bare,ncap-memory,ncap-ledger,ncap,ncap-shared,ncap-shared-2w,portkey,litellm"
)
PORTKEY_DIR = bl.BENCH / "portkey"
PORTKEY_BIN = PORTKEY_DIR / "node_modules" / ".bin" / "gateway"
PIN_UPSTREAM = "1"
PIN_LOADGEN = "0"
LITELLM_BIN = bl.ROOT / ".venv-litellm" / "bin" / "litellm"
NCAP_BIN = bl.ROOT / ".venv" / "bin" / "ncap"

# Everything LiteLLM would otherwise fetch at start-up (cost map, beta headers, blog
# posts, presets, policy templates) comes from its bundled copies; telemetry is off.
LITELLM_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
    "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
    "LITELLM_TELEMETRY_DISABLED": "true",
    "LITELLM_MODE": "PRODUCTION",  # DEV would load a .env file from the working dir
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "NO_PROXY": "127.0.0.1,localhost",
}

NCAP_CONFIG = """\
# Generated by bench/gateway_bench.py. Limits that would turn a benchmark into 429s
# (ramp, workload concurrency, in-flight ceiling) are lifted; everything else is the
# default, including the durable SQLite ledger and budget store.
server:
  host: 127.0.0.1
  max_in_flight: 4096
  ramp: {{requests_per_second: 1000000, burst: 1000000}}
stores:
  ledger: {ledger}
  budgets: {budgets}
workloads:
  default:
    max_candidates: 4
    max_concurrency: null
models:
  fake-model: [fake]
routes:
  fake:
    provider: openai
    base_url: http://127.0.0.1:{upstream_port}/v1
    upstream_model: fake-model
    api_key_env: NCAP_BENCH_UPSTREAM_KEY
    pricing: {{input_per_mtok: 0.15, output_per_mtok: 0.6}}
    contract:
      candidates: native
      max_candidates: 4
      output_cap: per_candidate
      stream_usage: include_usage
"""


@dataclass
class Target:
    """A URL to load, the process that serves it, and the key it wants."""

    name: str
    url: str
    server: bl.Server
    api_key: str = "bench"
    note: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    # keeps the shipped ramp limiter (``server.ramp``): measured once it let the load in
    ramped: bool = False


@dataclass
class Run:
    """Shared state of one benchmark run."""

    args: argparse.Namespace
    work: Path
    upstream: bl.Server
    upstream_port: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    shared: tuple[str, str] | None = None  # (ledger URL, budgets URL) of this run


def start_upstream(work: Path, args: argparse.Namespace) -> tuple[bl.Server, int]:
    port = bl.free_port()
    argv = [*bl.pin_prefix(args.pin_upstream), *bl.upstream_argv(port, args.upstream_module)]
    server = bl.start_server("upstream", argv, work)
    bl.wait_ready(server, _chat_url(port), bl.chat_body("fake-model"), timeout_s=30)
    return server, port


def _chat_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/v1/chat/completions"


def direct_target(run: Run) -> Target:
    return Target("direct", _chat_url(run.upstream_port), run.upstream, note="fake upstream")


# The shipped default: the route to the fake upstream and a workload concurrency above
# the load's, nothing else (stores, durability, ramp and in-flight limits as shipped).
NCAP_DEFAULT_CONFIG = """\
# Generated by bench/gateway_bench.py: the shipped default plus the route.
workloads:
  default:
    max_concurrency: {max_concurrency}
models:
  fake-model: [fake]
routes:
  fake:
    provider: openai
    base_url: http://127.0.0.1:{upstream_port}/v1
    upstream_model: fake-model
    api_key_env: NCAP_BENCH_UPSTREAM_KEY
    pricing: {{input_per_mtok: 0.15, output_per_mtok: 0.6}}
    contract:
      candidates: native
      max_candidates: 4
      output_cap: per_candidate
      stream_usage: include_usage
"""


def ncap_config_text(
    upstream_port: int,
    work: Path,
    stores: str,
    max_concurrency: int = 128,
    shared: tuple[str, str] | None = None,
) -> str:
    """``default``: the shipped default; ``memory``: both stores in memory;
    ``ledger-full``: SQLite ledger (synchronous FULL) and in-process budgets;
    ``sqlite``: SQLite ledger and SQLite budgets, both FULL (an earlier default);
    ``shared``: the given PostgreSQL ledger and Redis budgets."""
    if stores == "shared":
        assert shared is not None
        return NCAP_CONFIG.format(upstream_port=upstream_port, ledger=shared[0], budgets=shared[1])
    if stores == "default":
        return NCAP_DEFAULT_CONFIG.format(
            upstream_port=upstream_port, max_concurrency=max_concurrency
        )
    ledger, budgets = f"sqlite:///{work}/ledger.db", "memory://"
    if stores == "memory":
        ledger = "memory://"
    elif stores == "ledger-full":
        ledger += "?synchronous=full"
    elif stores == "sqlite":
        ledger += "?synchronous=full"
        budgets = f"sqlite:///{work}/budgets.db?synchronous=full"
    elif stores == "host":
        budgets = f"sqlite:///{work}/budgets.db"
    return NCAP_CONFIG.format(upstream_port=upstream_port, ledger=ledger, budgets=budgets)


def ncap_target(run: Run, name: str) -> Target | str:
    """Start ``ncap serve``; a string return is the reason it was skipped."""
    if not NCAP_BIN.exists():
        return f"{NCAP_BIN} not found"
    stores = NCAP_STORES[name]
    if stores == "shared" and run.shared is None:
        reason = shared_stores(run)
        if reason:
            return reason
    home = run.work / name
    home.mkdir(exist_ok=True)
    config = Path(run.args.ncap_config) if run.args.ncap_config else run.work / f"{name}.yaml"
    if not run.args.ncap_config:
        limit = 2 * max(run.args.concurrency)
        config.write_text(ncap_config_text(run.upstream_port, home, stores, limit, run.shared))
    port = bl.free_port()
    argv = [*bl.pin_prefix(run.args.pin_target), str(NCAP_BIN), "serve", "--config", str(config)]
    argv += ["--port", str(port)]
    if name in NCAP_WORKERS:
        argv += ["--workers", str(NCAP_WORKERS[name])]
    env = {"NCAP_BENCH_UPSTREAM_KEY": "dummy"}
    server = bl.start_server(name, argv, run.work, env=env, cwd=home)
    target = Target(name, _chat_url(port), server, note=f"{stores} stores")
    target.ramped = stores == "default" and not run.args.ncap_config
    return _ready_or_reason(target)


def shared_stores(run: Run) -> str | None:
    """A PostgreSQL database and a Redis key prefix of this run's own (``run.shared``);
    a string is the reason the shared targets are skipped."""
    import asyncio

    import asyncpg
    import redis

    name = f"ncap_bench_{secrets.token_hex(6)}"

    async def create() -> None:
        conn = await asyncpg.connect(BENCH_POSTGRES, timeout=5)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    try:
        asyncio.run(create())
        redis.Redis.from_url(BENCH_REDIS, socket_connect_timeout=5).ping()
    except Exception as exc:  # any failure only skips the shared targets
        return f"shared stores unavailable: {type(exc).__name__}"
    ledger = BENCH_POSTGRES.rsplit("/", 1)[0] + "/" + name
    sep = "&" if "?" in BENCH_REDIS else "?"
    run.shared = (ledger, f"{BENCH_REDIS}{sep}prefix={name}")
    return None


def drop_shared_stores(run: Run) -> None:
    """Drop the run's database and delete its Redis keys."""
    if run.shared is None:
        return
    import asyncio

    import asyncpg
    import redis

    name = run.shared[0].rsplit("/", 1)[1]

    async def drop() -> None:
        conn = await asyncpg.connect(BENCH_POSTGRES, timeout=5)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(drop())
    client = redis.Redis.from_url(BENCH_REDIS)
    keys = list(client.scan_iter(match=f"{name}:*", count=1000))
    if keys:
        client.delete(*keys)


def bare_target(run: Run) -> Target:
    """Python's floor: aiohttp server + aiohttp client forwarding bytes unchanged."""
    port = bl.free_port()
    argv = [*bl.pin_prefix(run.args.pin_target), str(bl.VENV_PY), str(bl.BENCH / "proxies.py")]
    argv += ["aiohttp+aiohttp", "--port", str(port), "--upstream", _chat_url(run.upstream_port)]
    server = bl.start_server("bare", argv, run.work)
    target = Target("bare", _chat_url(port), server, note="aiohttp pass-through")
    result = _ready_or_reason(target)
    if isinstance(result, str):
        raise RuntimeError(f"the bare pass-through did not start: {result}")
    return result


def portkey_target(run: Run) -> Target | str:
    """Portkey's open-source gateway (Node), told per request where the upstream is."""
    if not PORTKEY_BIN.exists():
        return "not installed (run scripts/setup-portkey.sh)"
    port = bl.free_port()
    argv = [*bl.pin_prefix(run.args.pin_target), str(PORTKEY_BIN), f"--port={port}", "--headless"]
    server = bl.start_server("portkey", argv, run.work, cwd=PORTKEY_DIR)
    headers = {
        "x-portkey-provider": "openai",
        "x-portkey-custom-host": f"http://127.0.0.1:{run.upstream_port}/v1",
    }
    target = Target(
        "portkey", _chat_url(port), server, api_key="dummy", note=portkey_version(), headers=headers
    )
    return _ready_or_reason(target)


def portkey_version() -> str:
    manifest = PORTKEY_DIR / "node_modules" / "@portkey-ai" / "gateway" / "package.json"
    if not manifest.exists():
        return "portkey"
    return f"@portkey-ai/gateway {json.loads(manifest.read_text()).get('version', '?')}"


def litellm_target(run: Run) -> Target | str:
    if not LITELLM_BIN.exists():
        return "not installed (run scripts/setup-litellm.sh)"
    port, key = bl.free_port(), "sk-" + secrets.token_hex(32)
    argv = [*bl.pin_prefix(run.args.pin_target), str(LITELLM_BIN)]
    argv += ["--config", str(bl.BENCH / "litellm_config.yaml")]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    env = dict(LITELLM_ENV, LITELLM_MASTER_KEY=key)
    env["NCAP_BENCH_UPSTREAM_BASE"] = f"http://127.0.0.1:{run.upstream_port}/v1"
    server = bl.start_server("litellm", argv, run.work, env=env)
    target = Target("litellm", _chat_url(port), server, api_key=key, note=litellm_version())
    return _ready_or_reason(target)


def litellm_version() -> str:
    marker = bl.ROOT / ".venv-litellm" / ".ncap-litellm-installed"
    return f"litellm {marker.read_text().strip()}" if marker.exists() else "litellm"


def _ready_or_reason(target: Target) -> Target | str:
    try:
        _wait_target(target)
    except RuntimeError as exc:
        bl.stop_server(target.server)
        last = [line for line in str(exc).splitlines() if line.strip()][-3:]
        return "did not start: " + " / ".join(last)
    return target


def _wait_target(target: Target) -> None:
    import urllib.request

    deadline = time.monotonic() + 120
    body = bl.chat_body("fake-model")
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {target.api_key}"}
    headers.update(target.headers)
    last = ""
    while time.monotonic() < deadline:
        if target.server.proc.poll() is not None:
            raise RuntimeError(f"exited {target.server.proc.returncode}\n{target.server.tail()}")
        req = urllib.request.Request(target.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                if resp.status == 200:
                    return
        except OSError as exc:
            last = repr(exc)[:300]
        time.sleep(0.5)
    raise RuntimeError(f"no 200 within 120 s: {last}\n{target.server.tail()}")


# the shipped ramp limiter lets a load grow by 500 requests a second from a burst of
# 1,000, and a target idle for 10 s (the other targets' turns) starts from that burst
RAMP_STEP_S = 2.0
RAMP_STEPS = 12


def measure(run: Run, target: Target, c: int) -> dict[str, Any]:
    """One point: warm-up plus measurement at concurrency ``c``."""
    args = run.args
    if target.ramped:
        ramp_up(target, args, c)
    with bl.measured(target.server.pid, [run.upstream.pid]) as cpu:
        res = _loadgen(target, args, c, args.duration, args.warmup)
    row = _row(target, c, res, cpu, args)
    print(_progress(row), file=sys.stderr, flush=True)
    return row


def ramp_up(target: Target, args: argparse.Namespace, c: int) -> None:
    """Load the shipped default until a whole step passes without its ramp limiter's
    429 ``slow_down``: the measurement is of its steady state, not of its growth limit
    (docs/configuration.md), which a fast machine reaches within the warm-up."""
    for _ in range(RAMP_STEPS):
        res = _loadgen(target, args, c, RAMP_STEP_S, 0.0)
        if not res["errors"]:
            return


def _loadgen(
    target: Target, args: argparse.Namespace, c: int, duration: float, warmup: float
) -> dict[str, Any]:
    argv = [*bl.pin_prefix(args.pin_loadgen), str(bl.VENV_PY), str(bl.BENCH / "loadgen.py")]
    argv += [target.url, "-c", str(c), "--duration", str(duration), "--warmup", str(warmup)]
    argv += ["--api-key", target.api_key, "--model", "fake-model", "--json"]
    for name, value in target.headers.items():
        argv += ["--header", f"{name}: {value}"]
    if args.stream:
        argv.append("--stream")
    out = subprocess.run(argv, capture_output=True, timeout=duration + warmup + 300)
    if out.returncode not in (0, 1) or not out.stdout:
        raise RuntimeError(f"loadgen failed: {out.stderr.decode(errors='replace')[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def _row(
    target: Target, c: int, res: dict[str, Any], cpu: dict[str, float], args: argparse.Namespace
) -> dict[str, Any]:
    rps = float(res["throughput_rps"] or 0)
    loaded_s = args.duration + args.warmup
    cpu_ms = 1000 * cpu["cpu_s"] / (rps * loaded_s) if rps else None
    return {
        "target": target.name,
        "note": target.note,
        "concurrency": c,
        "throughput_rps": rps,
        "p50_ms": res["p50_ms"],
        "p90_ms": res["p90_ms"],
        "p99_ms": res["p99_ms"],
        "ttfb_p50_ms": res.get("ttfb_p50_ms"),
        "requests": res["requests"],
        "errors": res["errors"],
        "error_kinds": res["error_kinds"],
        "rss_mib": bl.rss_mib(target.server.pid),
        "cpu_ms_per_req": round(cpu_ms, 3) if cpu_ms is not None else None,
        "cpu_util": round(cpu["cpu_s"] / cpu["wall_s"], 2) if cpu["wall_s"] else None,
        "foreign_cpu_share": round(cpu["foreign_share"], 3),
        "loadavg_after": bl.loadavg(),
    }


def _progress(row: dict[str, Any]) -> str:
    return (
        f"  {row['target']:<12} c={row['concurrency']:<3} {row['throughput_rps']:>8} req/s "
        f"p50={row['p50_ms']} ms p99={row['p99_ms']} ms errors={row['errors']} "
        f"rss={row['rss_mib']} MiB cpu/req={row['cpu_ms_per_req']} ms "
        f"foreign={row['foreign_cpu_share']:.0%}"
    )


def add_overheads(rows: list[dict[str, Any]]) -> None:
    """added_p50_ms = target p50 - direct p50 at the same concurrency."""
    direct = {r["concurrency"]: r for r in rows if r["target"] == "direct"}
    for r in rows:
        base = direct.get(r["concurrency"], {})
        for key in ("p50_ms", "p99_ms"):
            mine, theirs = r[key], base.get(key)
            r[f"added_{key}"] = round(mine - theirs, 3) if None not in (mine, theirs) else None


def ratios(rows: list[dict[str, Any]], concurrencies: list[int]) -> dict[str, Any]:
    """Per concurrency: every target's throughput over the bare pass-through's, and the
    shipped default's over LiteLLM's and Portkey's (the gateways it is compared with)."""
    out: dict[str, Any] = {}
    by = {(r["target"], r["concurrency"]): r for r in rows}
    for c in concurrencies:
        point: dict[str, Any] = {}
        bare = by.get(("bare", c))
        for (name, cc), r in by.items():
            if cc == c and bare and bare["throughput_rps"]:
                point[f"{name}_over_bare"] = round(r["throughput_rps"] / bare["throughput_rps"], 2)
        ncap = by.get(("ncap", c))
        # the shared stores over the embedded default, 2 workers over 1
        for mine, base in (("ncap-shared", "ncap"), ("ncap-shared-2w", "ncap-shared")):
            a, b = by.get((mine, c)), by.get((base, c))
            if a and b and b["throughput_rps"]:
                point[f"{mine}_over_{base}"] = round(a["throughput_rps"] / b["throughput_rps"], 2)
        for other in ("litellm", "portkey"):
            theirs = by.get((other, c))
            if ncap and theirs and theirs["throughput_rps"]:
                point[f"ncap_over_{other}"] = round(
                    ncap["throughput_rps"] / theirs["throughput_rps"], 2
                )
        if point:
            out[str(c)] = point
    return out


def summary_table(rows: list[dict[str, Any]]) -> bl.Table:
    """The comparison table: added p50 at c=1, req/s (× bare) at c=16, req/s at c=64."""
    by = {(r["target"], r["concurrency"]): r for r in rows}
    bare16 = (by.get(("bare", 16)) or {}).get("throughput_rps")
    body: list[list[Any]] = []
    for name in dict.fromkeys(r["target"] for r in rows):
        one, sixteen, sixty_four = by.get((name, 1)), by.get((name, 16)), by.get((name, 64))
        rps16 = sixteen["throughput_rps"] if sixteen else None
        times = f" ({rps16 / bare16:.2f}×)" if rps16 and bare16 else ""
        body.append(
            [
                name,
                _fmt(one and one.get("added_p50_ms")),
                f"{_fmt(rps16)}{times}",
                _fmt(sixty_four and sixty_four["throughput_rps"]),
                _fmt(sixteen and sixteen["foreign_cpu_share"], "_share"),
            ]
        )
    headers = ["target", "c=1 added p50 ms", "c=16 req/s (× bare)", "c=64 req/s"]
    title = "Added latency at c=1, throughput at c=16 (× bare) and c=64"
    return bl.Table(title, [*headers, "foreign CPU c=16"], body)


def tables(
    rows: list[dict[str, Any]], ratio: dict[str, Any], skipped: dict[str, str]
) -> list[bl.Table]:
    """The run's tables: the summary, every point, and the throughput ratios."""
    headers = ["target", "c", "req/s", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms"]
    headers += ["errors", "RSS MiB", "CPU ms/req", "foreign CPU"]
    keys = ["throughput_rps", "p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms", "errors"]
    keys += ["rss_mib", "cpu_ms_per_req", "foreign_cpu_share"]
    body = [[r["target"], r["concurrency"], *(_fmt(r[k], k) for k in keys)] for r in rows]
    notes = "; ".join(f"skipped {name}: {why}" for name, why in skipped.items())
    out = [summary_table(rows), bl.Table("Every target at every concurrency", headers, body)]
    out[-1].notes = (
        "Medians over the rounds; errors summed, RSS the largest seen. " + notes
    ).strip()
    if ratio:
        rrows = [[c, ", ".join(f"{k}={v}" for k, v in point.items())] for c, point in ratio.items()]
        out.append(bl.Table("Throughput ratios", ["c", "throughput ratios"], rrows))
    rounds = rounds_table(rows)
    if rounds is not None:
        out.append(rounds)
    return out


def rounds_table(rows: list[dict[str, Any]]) -> bl.Table | None:
    """Each round on its own: a target's throughput over bare's in the same round, and
    at c=1 its p50 over direct's in the same round (the spread the medians hide)."""
    by = {(r["target"], r["concurrency"]): r for r in rows}
    body: list[list[Any]] = []
    for r in rows:
        name, c = r["target"], r["concurrency"]
        bare, direct = by.get(("bare", c)), by.get(("direct", c))
        if name in ("bare", "direct") or "throughput_each_round" not in r:
            continue
        times = added = "n/a"
        median = None
        if bare and "throughput_each_round" in bare:
            each = [
                round(mine / theirs, 2)
                for mine, theirs in _each_round(r, bare, "throughput_each_round")
                if mine and theirs
            ]
            times = ", ".join(f"{v:.2f}" for v in each) or "n/a"
            median = round(statistics.median(each), 2) if each else None
        if c == 1 and direct and "p50_each_round" in direct:
            added = ", ".join(
                f"{mine - theirs:.3f}"
                for mine, theirs in _each_round(r, direct, "p50_each_round")
                if mine is not None and theirs is not None
            )
        body.append([name, c, times, _fmt(median), added or "n/a"])
    if not body:
        return None
    headers = ["target", "c", "× bare, each round", "median of the rounds' ×"]
    table = bl.Table("Round by round", [*headers, "added p50 ms, each round"], body)
    table.notes = (
        "Each round's point against bare's (and, at c=1, direct's) of the same round, "
        "measured moments apart; the tables above are the medians over the rounds."
    )
    return table


def _each_round(mine: dict[str, Any], base: dict[str, Any], key: str) -> list[tuple[Any, Any]]:
    """The two rows' values round by round (every target runs the same rounds)."""
    return list(zip(mine[key], base[key], strict=True))


def markdown(rows: list[dict[str, Any]], ratio: dict[str, Any], skipped: dict[str, str]) -> str:
    parts = [bl.md_table(t.columns, t.rows) for t in tables(rows, ratio, skipped)]
    parts += [f"- skipped {name}: {why}" for name, why in skipped.items()]
    return "\n\n".join(parts)


def _fmt(v: object, key: str = "") -> str:
    if v is None:
        return "n/a"
    return f"{v:.0%}" if key.endswith("_share") and isinstance(v, float) else str(v)


def starters(run: Run) -> dict[str, Callable[[], Target | str]]:
    out: dict[str, Callable[[], Target | str]] = {
        "direct": lambda: direct_target(run),
        "bare": lambda: bare_target(run),
        "portkey": lambda: portkey_target(run),
        "litellm": lambda: litellm_target(run),
    }
    out.update({name: functools.partial(ncap_target, run, name) for name in NCAP_STORES})
    return out


def start_targets(run: Run) -> list[Target]:
    """Start every requested target up front (idle ones cost ~nothing) and warm each."""
    start, targets = starters(run), []
    for name in run.args.targets:
        print(f"{name}: starting", file=sys.stderr, flush=True)
        target = start[name]()
        if isinstance(target, str):
            run.skipped[name] = target
            print(f"{name}: SKIPPED ({target})", file=sys.stderr, flush=True)
            continue
        targets.append(target)
        _loadgen(target, run.args, 4, 2.0, 0.0)
    return targets


def bench_targets(run: Run) -> None:
    """Round-robin: every round visits every target at every concurrency, so a burst
    of foreign load lands on one round of each rather than on one whole target.

    Within a round the targets follow each other at one concurrency before the next
    one, so a target's point is measured right after bare's at the same concurrency
    (one point apart for the first ncap target) instead of a whole target's worth of
    points later: the ratio to bare compares moments as close as the run allows."""
    targets = start_targets(run)
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        for r in range(run.args.rounds):
            print(f"round {r + 1}/{run.args.rounds}", file=sys.stderr, flush=True)
            for c in run.args.concurrency:
                for target in targets:
                    samples.setdefault((target.name, c), []).append(measure(run, target, c))
    finally:
        for target in targets:
            if target.server is not run.upstream:
                bl.stop_server(target.server)
    run.rows = [_median_row(points) for points in samples.values()]


_MEDIAN_KEYS = ["throughput_rps", "p50_ms", "p90_ms", "p99_ms", "ttfb_p50_ms", "cpu_ms_per_req"]
_MEDIAN_KEYS += ["cpu_util", "foreign_cpu_share"]


def _median_row(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each measure over the rounds; errors summed, RSS the largest seen."""
    row = dict(points[-1])
    for key in _MEDIAN_KEYS:
        vals = [p[key] for p in points if p[key] is not None]
        row[key] = round(statistics.median(vals), 3) if vals else None
    row["errors"] = sum(p["errors"] for p in points)
    row["requests"] = sum(p["requests"] for p in points)
    row["rss_mib"] = max(p["rss_mib"] for p in points)
    row["throughput_each_round"] = [p["throughput_rps"] for p in points]
    row["p50_each_round"] = [p["p50_ms"] for p in points]
    row["foreign_each_round"] = [p["foreign_cpu_share"] for p in points]
    return row


def busy_fraction(seconds: float = 1.0) -> float:
    """Share of all CPU time that was busy over ``seconds``: is the machine quiet?"""

    def sample() -> tuple[int, int]:
        vals = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = vals[3] + vals[4]
        return sum(vals), idle

    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return round(1 - (i1 - i0) / max(1, t1 - t0), 3)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--targets", default=DEFAULT_TARGETS, help=f"comma list of {TARGETS}")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--rounds", type=int, default=3, help="round-robin passes; medians reported")
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per point")
    p.add_argument("--stream", action="store_true", help="streaming requests")
    p.add_argument("--ncap-config", help="use this ncap config instead of a generated one")
    p.add_argument("--upstream-module", help="force 'ncap.testing.fake_upstream' or 'standin'")
    p.add_argument("--pin-upstream", default=PIN_UPSTREAM, help="taskset CPU list ('' = none)")
    p.add_argument("--pin-loadgen", default=PIN_LOADGEN, help="taskset CPU list ('' = none)")
    p.add_argument("--pin-target", default="", help="taskset CPU list for the gateway")
    p.add_argument("--output", help="also write the raw results here (they are in the envelope)")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with server logs")
    args = p.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in args.targets if t not in TARGETS]
    if bad:
        p.error(f"unknown targets {bad}; choose from {TARGETS}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = bl.machine_info()
    info["busy_fraction_before"] = busy_fraction()
    if float(info["busy_fraction_before"]) > 0.15:  # type: ignore[arg-type]
        print(f"WARNING: machine busy before start: {info}", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="ncap-bench-"))
    upstream, port = start_upstream(work, args)
    run = Run(args, work, upstream, port)
    try:
        bench_targets(run)
    finally:
        bl.stop_server(upstream)
        drop_shared_stores(run)
        if not args.keep_logs:
            shutil.rmtree(work, ignore_errors=True)
    add_overheads(run.rows)
    ratio = ratios(run.rows, args.concurrency)
    info["loadavg_at_end"] = bl.loadavg()
    info["busy_fraction_after"] = busy_fraction()
    write_results(args, info, run, ratio)
    print(markdown(run.rows, ratio, run.skipped))
    return 0


def write_results(
    args: argparse.Namespace, info: dict[str, object], run: Run, ratio: dict[str, Any]
) -> None:
    settings = {
        "targets": args.targets,
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "rounds": args.rounds,
        "stream": args.stream,
        "upstream": args.upstream_module or bl.fake_upstream_module(),
        "pin_upstream": args.pin_upstream or None,
        "pin_loadgen": args.pin_loadgen or None,
        "pin_target": args.pin_target or None,
        "body": json.loads(bl.chat_body("fake-model", args.stream)),
    }
    doc = {"machine": info, "settings": settings, "rows": run.rows, "ratios": ratio}
    doc["skipped"] = run.skipped
    if args.output and args.output != os.devnull:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
    name = "gateway-stream" if args.stream else "gateway"
    bl.save_result(name, tables(run.rows, ratio, run.skipped), raw=doc)


if __name__ == "__main__":
    sys.exit(main())
