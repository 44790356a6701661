"""One request at a time through one gateway: p50 and each thread's CPU per request.

At c=1 nothing is batched and a request's latency is the CPU on its path, so the
gateway's CPU is read per thread (``/proc/PID/task/*/stat``): the event loop's thread
against SQLite's writer and reader threads. Starts the fake upstream and ``ncap serve``
on the given store set-up (bench/gateway_bench.py's configs), warms it, then loads it
with bench/loadgen.py at c=1 for ``--seconds``. ``--src`` serves another checkout's
sources, for a lever's before and after run back to back:

    .venv/bin/python bench/c1_threads.py --stores default [--src /tmp/before/src]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib as bl
import gateway_bench as gb


def _threads(pid: int) -> dict[str, tuple[int, int]]:
    """Each thread's (user, system) clock ticks, by thread id and name."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except FileNotFoundError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[f"{tid} {name}"] = (int(fields[11]), int(fields[12]))
    return out


def _load(url: str, seconds: float, env: dict[str, str]) -> dict[str, Any]:
    argv = [str(bl.VENV_PY), str(bl.BENCH / "loadgen.py"), url, "-c", "1"]
    argv += ["--duration", str(seconds), "--warmup", "0", "--json"]
    argv += ["--api-key", "bench", "--model", "fake-model"]
    done = subprocess.run(argv, capture_output=True, check=True, env=env)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def measure(
    stores: str, seconds: float, src: str | None
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    work = Path(tempfile.mkdtemp(prefix="ncap-c1-"))
    upstream_port = bl.free_port()
    upstream = bl.start_server("upstream", bl.upstream_argv(upstream_port), work)
    home = work / "home"
    home.mkdir()
    config = work / "ncap.yaml"
    config.write_text(gb.ncap_config_text(upstream_port, home, stores, 128))
    port = bl.free_port()
    env = dict(os.environ, NCAP_BENCH_UPSTREAM_KEY="dummy")
    if src:
        env["PYTHONPATH"] = str(Path(src).resolve())
    argv = [str(bl.VENV_PY), "-m", "ncap.cli.main", "serve", "--config", str(config)]
    gateway = subprocess.Popen(
        [*argv, "--port", str(port)],
        cwd=home,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        for _ in range(120):  # until it answers
            try:
                _load(url, 0.2, env)
                break
            except subprocess.CalledProcessError:
                time.sleep(0.5)
        _load(url, 3, env)  # warm
        before = _threads(gateway.pid)
        result = _load(url, seconds, env)
        after = _threads(gateway.pid)
    finally:
        gateway.terminate()
        gateway.wait(30)
        bl.stop_server(upstream)
    requests = result["requests"]
    tick = os.sysconf("SC_CLK_TCK")
    threads = {}
    for key, (user, system) in after.items():
        user0, system0 = before.get(key, (0, 0))
        if user - user0 or system - system0:
            threads[key] = {
                "user_us": round(1e6 * (user - user0) / tick / requests, 1),
                "sys_us": round(1e6 * (system - system0) / tick / requests, 1),
            }
    return {"stores": stores, "src": src, "requests": requests, "p50_ms": result["p50_ms"]}, threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stores", default="default", help="default, memory, ledger-full, sqlite")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--src", default=None, help="another checkout's src to serve")
    args = p.parse_args()
    summary, threads = measure(args.stores, args.seconds, args.src)
    print(json.dumps({**summary, "threads": threads}))


if __name__ == "__main__":
    main()
