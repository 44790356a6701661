"""What OpenTelemetry costs per request, in one run: the shipped default (no telemetry)
of this checkout and of another (``--before-src``, e.g. the main branch's ``src``),
and the default plus ``observability.otlp`` exporting every span and the GenAI metrics
to a local OTLP/HTTP sink (``otlp``) or keeping no root trace (``otlp-unsampled``:
spans are not recorded, the trace context still goes upstream).

``--mode callgrind`` (the default) counts user-space instructions per request under
valgrind, as bench/instructions.py does (all threads: the span batch processor's and
the metric reader's exports are in the total); ``--mode cpu`` reads the server
process's own CPU counters (user + system, /proc) around the same load, without
valgrind. Ratios are against ``default`` of the same run.

    .venv/bin/python bench/telemetry_cost.py [--mode callgrind|cpu] [--requests 2000]
        [--before-src ../main/src] [--setups before,default,otlp,otlp-unsampled]
        [--stores default|memory] [--rounds 1] [--metrics-interval 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import benchlib as bl
import gateway_bench as gb
import instructions as ins
from aiohttp import web

_OTLP = """
observability:
  otlp:
    endpoint: http://127.0.0.1:{port}
{extra}"""


class Sink:
    """A local OTLP/HTTP receiver that answers 200 and counts what it got."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        self.port = bl.free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Sink:
        self._thread.start()
        time.sleep(0.5)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._got)
        app.router.add_post("/v1/metrics", self._got)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._loop.run_forever()

    async def _got(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.bytes += len(await request.read())
        return web.Response(body=b"", content_type="application/x-protobuf")


def config_text(setup: str, upstream_port: int, sink: Sink, args: argparse.Namespace) -> str:
    """The set-up's config: ``--stores`` (``default``: the shipped default; ``memory``:
    both stores in memory, whose instruction counts vary least between runs), plus
    the OTLP section; metrics are exported every ``--metrics-interval`` seconds (the
    shipped 60 s makes their export cost per request vanish under load)."""
    base = gb.ncap_config_text(upstream_port, Path("."), args.stores)
    if setup in ("default", "before"):
        return base
    extra = f"    metrics_interval_s: {args.metrics_interval}\n"
    if setup == "otlp-unsampled":
        extra += "    sampling: 0.0\n"
    return base + _OTLP.format(port=sink.port, extra=extra)


def _env(src: str) -> dict[str, str]:
    env = dict(os.environ, NCAP_BENCH_UPSTREAM_KEY="dummy")
    env["PYTHONPATH"] = str(Path(src).resolve())
    return env


def _serve(setup: str, args: argparse.Namespace, work: Path, text: str, valgrind: bool) -> tuple:
    port = bl.free_port()
    home = work / setup
    home.mkdir(exist_ok=True)
    config = home / "ncap.yaml"
    config.write_text(text)
    argv = [str(bl.VENV_PY), "-m", "ncap.cli.main", "serve", "--config", str(config)]
    argv += ["--port", str(port)]
    out = work / f"{setup}.callgrind"
    if valgrind:
        tool = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
        argv = [*tool, f"--callgrind-out-file={out}", *argv]
    env = _env(args.before_src if setup == "before" else args.src)
    log = (work / f"{setup}.log").open("wb")
    server = subprocess.Popen(argv, env=env, cwd=home, stdout=log, stderr=log)
    return server, f"http://127.0.0.1:{port}/v1/chat/completions", env, out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def measure(setup: str, args: argparse.Namespace, upstream_port: int, sink: Sink, work: Path):
    text = config_text(setup, upstream_port, sink, args)
    valgrind = args.mode == "callgrind"
    server, url, env, _out = _serve(setup, args, work, text, valgrind)
    before_sink = sink.requests
    try:
        ins._wait(url)
        ins._load(url, args.warm, args, env)
        if valgrind:
            ins._callgrind(["-i", "on"], server.pid)
            ins._load(url, 100, args, env)
            ins._callgrind(["-z"], server.pid)
        cpu0 = _cpu_s(server.pid)
        result = ins._load(url, args.requests, args, env)
        time.sleep(1.5)  # one metric export interval: its cost is part of the load
        cpu1 = _cpu_s(server.pid)
        if valgrind:
            ins._callgrind(["-i", "off"], server.pid)
            ins._callgrind(["-d"], server.pid)
            time.sleep(1)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    row = {
        "setup": setup,
        "mode": args.mode,
        "stores": args.stores,
        "requests": args.requests,
        "errors": result["errors"],
        "cpu_ms_per_request": round((cpu1 - cpu0) * 1000 / args.requests, 4),
        "otlp_posts": sink.requests - before_sink,
    }
    if valgrind:
        total = max(ins._totals(p) for p in work.glob(f"{setup}.callgrind*"))
        row["instructions_per_request"] = total // args.requests
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("callgrind", "cpu"), default="callgrind")
    p.add_argument("--setups", default="before,default,otlp,otlp-unsampled")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--warm", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--stores", choices=("default", "memory"), default="default")
    p.add_argument("--metrics-interval", type=float, default=60.0)
    p.add_argument("--rounds", type=int, default=1, help="each set-up this many times")
    p.add_argument("--src", default=str(bl.BENCH.parent / "src"))
    p.add_argument("--before-src", default="", help="another checkout's src (setup before)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setups = args.setups.split(",")
    if "before" in setups and not args.before_src:
        setups.remove("before")
    if args.mode == "callgrind" and shutil.which("valgrind") is None:
        print("valgrind (callgrind) is not installed", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="ncap-telemetry-"))
    sink = Sink().start()
    upstream_port = bl.free_port()
    upstream = bl.start_server("upstream", bl.upstream_argv(upstream_port), work)
    rows = []
    try:
        url = f"http://127.0.0.1:{upstream_port}/v1/chat/completions"
        bl.wait_ready(upstream, url, bl.chat_body("fake-model"), timeout_s=30)
        for _ in range(args.rounds):  # set-ups interleaved: the machine's drift hits all
            for setup in setups:
                rows.append(measure(setup, args, upstream_port, sink, work))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        bl.stop_server(upstream)
        shutil.rmtree(work, ignore_errors=True)
    key = "instructions_per_request" if args.mode == "callgrind" else "cpu_ms_per_request"
    medians = {s: statistics.median(r[key] for r in rows if r["setup"] == s) for s in setups}
    base = medians.get("default")
    body = []
    for setup, value in medians.items():
        ratio = f"  x{value / base:.3f} of default" if base else ""
        print(f"{setup:>16}: {value:>12} {key} (median of {args.rounds}){ratio}")
        body.append([setup, value, round(value / base, 3) if base else None])
    title = f"{key.replace('_', ' ')} by set-up ({args.stores} stores, median of {args.rounds})"
    table = bl.Table(title, ["set-up", key.replace("_", " "), "× default"], body)
    bl.save_result("telemetry", [table], raw=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
