"""User-space instructions per request, under callgrind: a cost measure that a busy
machine does not move.

Wall-clock rates on a shared 2-core machine swing by tens of percent between runs;
the number of instructions a request costs does not. Each set-up (``bare`` for the
aiohttp pass-through, ``bare-lean`` for the same server with ncap's own upstream
client, ``server-app``, ``server-lowlevel`` and ``server-protocol`` for a server alone
answering a fixed body, ``bare-protocol`` for the pass-through on the last of those and
ncap's client, or a ``gateway_bench`` ncap target) runs under
``valgrind --tool=callgrind --instr-atstart=no``; after ``--warm`` requests the
instrumentation is switched on, ``--requests`` requests are measured at
``--concurrency`` with bench/loadgen.py, and the total is divided by that count.
Kernel time (the loopback writes) is not counted: count system calls with
``strace -c`` for that. Needs valgrind (on every machine kind here).

    .venv/bin/python bench/instructions.py [--setups bare,ncap-memory,ncap]
        [--requests 2000] [--concurrency 8] [--src DIR] [--keep DIR]

``--src`` measures another checkout's ``src`` (a before/after of one change) with the
same harness and upstream; ``--keep`` copies the callgrind files out, for
``callgrind_annotate`` (by object file: ``--inclusive=yes``, or per function).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchlib as bl
import gateway_bench as gb

# the bare pass-through proxies: the aiohttp server with aiohttp's client, or with
# ncap's own upstream client (ncap.providers.http1); and aiohttp's server alone, a fixed
# answer and no upstream, on its application layer or on its low-level server
BARE = {
    "bare": "aiohttp+aiohttp",
    "bare-lean": "aiohttp+lean",
    "server-app": "aiohttp+fixed",
    "server-lowlevel": "aiohttp-server+fixed",
    "server-protocol": "protocol+fixed",
    "server-front": "front+fixed",
    "bare-protocol": "protocol+lean",
}
_PROBE = b'{"model":"fake-model","messages":[{"role":"user","content":"hi"}]}'


def measure(setup: str, args: argparse.Namespace, upstream_port: int, work: Path) -> dict:
    port = bl.free_port()
    if setup in BARE:
        upstream = f"http://127.0.0.1:{upstream_port}/v1/chat/completions"
        argv = [str(bl.VENV_PY), str(bl.BENCH / "proxies.py"), BARE[setup]]
        argv += ["--port", str(port), "--upstream", upstream]
    else:
        config = work / f"{setup}.yaml"
        home = work / setup
        home.mkdir(exist_ok=True)
        stores = gb.NCAP_STORES[setup]
        shared = _shared_stores() if stores == "shared" else None
        config.write_text(gb.ncap_config_text(upstream_port, home, stores, 128, shared))
        argv = [str(bl.VENV_PY), "-m", "ncap.cli.main", "serve", "--config", str(config)]
        argv += ["--port", str(port)]
    out = work / f"{setup}.callgrind"
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
    valgrind += [f"--callgrind-out-file={out}"]
    env = _env(args)
    with (work / f"{setup}.log").open("wb") as log:
        server = subprocess.Popen(valgrind + argv, env=env, cwd=work, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        _wait(url)
        _load(url, args.warm, args, env)
        _callgrind(["-i", "on"], server.pid)
        _load(url, 100, args, env)  # the instrumented code paths warm up too
        _callgrind(["-z"], server.pid)
        result = _load(url, args.requests, args, env)
        _callgrind(["-i", "off"], server.pid)
        _callgrind(["-d"], server.pid)
        time.sleep(1)
        total = max(_totals(path) for path in work.glob(f"{setup}.callgrind*"))
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            for path in work.glob(f"{setup}.callgrind*"):
                shutil.copy(path, Path(args.keep) / path.name)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    return {
        "setup": setup,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "errors": result.get("errors"),
        "instructions_per_request": round(total / args.requests),
    }


_CREATED: list[str] = []  # databases to drop at the end


def _run_sql(sql: str) -> None:
    import asyncio

    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(gb.BENCH_POSTGRES, timeout=5)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


def _shared_stores() -> tuple[str, str]:
    """A PostgreSQL database and a Redis key prefix of this measurement's own."""
    import secrets

    name = f"ncap_instr_{secrets.token_hex(6)}"
    _run_sql(f'CREATE DATABASE "{name}"')
    _CREATED.append(name)
    ledger = gb.BENCH_POSTGRES.rsplit("/", 1)[0] + "/" + name
    sep = "&" if "?" in gb.BENCH_REDIS else "?"
    return ledger, f"{gb.BENCH_REDIS}{sep}prefix={name}"


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, NCAP_BENCH_UPSTREAM_KEY="dummy")
    if args.src:
        env["PYTHONPATH"] = str(Path(args.src).resolve())
    return env


def _wait(url: str) -> None:
    """Until the server answers a request (start-up under valgrind takes a while)."""
    headers = {"content-type": "application/json"}
    for _ in range(600):
        try:
            urllib.request.urlopen(urllib.request.Request(url, _PROBE, headers), timeout=5)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer")


def _load(url: str, requests: int, args: argparse.Namespace, env: dict[str, str]) -> dict:
    argv = [str(bl.VENV_PY), str(bl.BENCH / "loadgen.py"), url, "-c", str(args.concurrency)]
    argv += ["--requests", str(requests), "--warmup", "0", "--json"]
    argv += ["--header", "Authorization: Bearer bench"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    result: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _callgrind(flags: list[str], pid: int) -> None:
    subprocess.run(["callgrind_control", *flags, str(pid)], capture_output=True, check=False)


def _totals(path: Path) -> int:
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setups", default="bare,ncap-memory,ncap")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--warm", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--src", default="", help="a checkout's src to measure instead")
    p.add_argument("--keep", default="", help="copy the callgrind files into this folder")
    return p.parse_args(argv)


def have_callgrind() -> bool:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (callgrind) is not installed", file=sys.stderr)
        return False
    return True


def measure_each(
    names: list[str], measure_one: Callable[[str, int, Path], dict[str, Any]], prefix: str
) -> list[dict[str, Any]]:
    """Start the fake upstream, measure each name against it (``measure_one(name,
    upstream_port, work)``, each row printed as it comes), then stop the upstream and
    drop the databases the measurements created."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    upstream_port = bl.free_port()
    upstream = bl.start_server("upstream", bl.upstream_argv(upstream_port), work)
    rows: list[dict[str, Any]] = []
    try:
        url = f"http://127.0.0.1:{upstream_port}/v1/chat/completions"
        bl.wait_ready(upstream, url, bl.chat_body("fake-model"), timeout_s=30)
        for name in names:
            rows.append(measure_one(name, upstream_port, work))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        bl.stop_server(upstream)
        shutil.rmtree(work, ignore_errors=True)
        for name in _CREATED:
            _run_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not have_callgrind():
        return 2
    rows = measure_each(
        args.setups.split(","),
        lambda setup, port, work: measure(setup, args, port, work),
        "ncap-instructions-",
    )
    if not args.src:  # another checkout's count is a before/after, not this one's result
        bl.save_result("instructions", [table(rows, args)], raw=rows)
    return 0


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> bl.Table:
    bare = next((r["instructions_per_request"] for r in rows if r["setup"] == "bare"), None)
    body = [
        [
            r["setup"],
            r["instructions_per_request"],
            round(r["instructions_per_request"] / bare, 2) if bare else None,
            r["errors"],
        ]
        for r in rows
    ]
    title = f"User-space instructions per request (c={args.concurrency})"
    notes = f"{args.requests} requests counted after {args.warm} warm-up requests."
    return bl.Table(
        title, ["setup", "instructions per request", "× bare", "errors"], body, notes=notes
    )


if __name__ == "__main__":
    sys.exit(main())
