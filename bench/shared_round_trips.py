"""Store round trips per request of one gateway on the shared stores, at c=1.

Starts the fake upstream and ``ncap serve`` on a PostgreSQL ledger and Redis budgets
of the run's own (``NCAP_BENCH_POSTGRES`` / ``NCAP_BENCH_REDIS``, as
bench/gateway_bench.py), warms it, then sends ``--requests`` requests one at a time
while ``strace`` records the gateway's socket writes. Prints, per request: socket
writes to PostgreSQL and to Redis (one write is one round trip: asyncpg and redis-py
send a statement or a pipeline in one write), Redis commands by name (``INFO
commandstats``: the script's own calls included), and PostgreSQL commits and rows
(``pg_stat_database`` of the run's database). Requires ``strace`` and ``psql``;
strace slows the gateway, so the latency it prints is not a result.

    .venv/bin/python bench/shared_round_trips.py [--requests 300]
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import benchlib as bl
import gateway_bench as gb
import redis

PORTS = {
    urlsplit(gb.BENCH_POSTGRES).port or 5432: "postgresql",
    urlsplit(gb.BENCH_REDIS).port or 6379: "redis",
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--warmup", type=int, default=300)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ncap-round-trips-"))
    gb_args = argparse.Namespace(
        pin_upstream="", upstream_module=None, ncap_config=None, concurrency=[1], pin_target=""
    )
    upstream, port = gb.start_upstream(work, gb_args)
    run = gb.Run(gb_args, work, upstream, port)
    try:
        target = gb.ncap_target(run, "ncap-shared")
        if isinstance(target, str):
            print(f"skipped: {target}", file=sys.stderr)
            return 1
        try:
            print(measure(run, target, args.requests, args.warmup, work))
        finally:
            bl.stop_server(target.server)
    finally:
        bl.stop_server(upstream)
        gb.drop_shared_stores(run)
    return 0


def measure(run: gb.Run, target: gb.Target, n: int, warmup: int, work: Path) -> str:
    assert run.shared is not None
    url = urlsplit(target.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port)
    body = bl.chat_body("fake-model")

    def one() -> None:
        conn.request("POST", url.path, body=body, headers={"content-type": "application/json"})
        reply = conn.getresponse()
        reply.read()
        if reply.status != 200:
            raise RuntimeError(f"status {reply.status}")

    for _ in range(warmup):
        one()
    time.sleep(11)  # the warm-up's settlements; backends report their statistics
    # when idle, at most 10 s late (PostgreSQL 15's PGSTAT_IDLE_INTERVAL)
    gateway = bl.tree(target.server.pid)[-1]
    client = redis.Redis.from_url(gb.BENCH_REDIS)
    database = run.shared[0].rsplit("/", 1)[1]
    trace = work / "strace.txt"
    strace = ["strace", "-f", "-qq", "-e", "trace=write,sendto,sendmsg,writev"]
    tracer = subprocess.Popen([*strace, "-o", str(trace), "-p", str(gateway)])
    time.sleep(1.0)
    before = _commands(client), _pg(database)
    for _ in range(n):
        one()
    time.sleep(1.0)  # the last settlements (they run after the answer)
    tracer.terminate()
    tracer.wait()
    time.sleep(11)
    after = _commands(client), _pg(database)
    writes = _writes_by_peer(gateway, trace)
    lines = [f"{n} requests at c=1, per request:"]
    lines.append("  socket writes: " + ", ".join(f"{k} {v / n:.2f}" for k, v in writes.items()))
    calls = {k: after[0].get(k, 0) - before[0].get(k, 0) for k in after[0]}
    lines.append(
        "  redis commands: "
        + ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(calls.items()) if v and k != "info")
    )
    pg = [b - a for a, b in zip(before[1], after[1], strict=True)]
    lines.append(
        f"  postgresql: commits {pg[0] / n:.2f}, rows inserted {pg[1] / n:.2f},"
        f" rows updated {pg[2] / n:.2f} (a heartbeat's commits and update every 2 s"
        " included)"
    )
    return "\n".join(lines)


def _commands(client: Any) -> dict[str, int]:
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def _pg(database: str) -> list[int]:
    query = (
        "SELECT xact_commit, tup_inserted, tup_updated FROM pg_stat_database"
        f" WHERE datname = '{database}'"
    )
    admin = urlsplit(gb.BENCH_POSTGRES)
    server = ["-h", admin.hostname or "127.0.0.1", "-p", str(admin.port or 5432)]
    who = ["-U", admin.username or "postgres", admin.path.lstrip("/") or "postgres"]
    out = subprocess.run(
        ["psql", *server, *who, "-Atc", query],
        capture_output=True,
        text=True,
        check=True,
    )
    return [int(x) for x in out.stdout.strip().split("|")]


def _writes_by_peer(pid: int, trace: Path) -> dict[str, int]:
    """Socket writes by the peer's port (PostgreSQL, Redis, other)."""
    links: dict[int, str] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
    peers: dict[str, int] = {}
    ss = subprocess.run(["ss", "-tnpe"], capture_output=True, text=True).stdout
    for line in ss.splitlines():
        m = re.search(r"\S+:\d+\s+\S+:(\d+).*ino:(\d+)", line)
        if m:
            peers[m.group(2)] = int(m.group(1))
    counts: dict[str, int] = {}
    for line in trace.read_text().splitlines():
        m = re.search(r"(?:write|sendto|sendmsg|writev)\((\d+),", line)
        if not m:
            continue
        inode = re.search(r"socket:\[(\d+)\]", links.get(int(m.group(1)), ""))
        peer = peers.get(inode.group(1)) if inode else None
        if peer is None:
            continue  # a log file, or a socket that closed meanwhile
        name = PORTS.get(peer, "other (client, upstream)")
        counts[name] = counts.get(name, 0) + 1
    return counts


if __name__ == "__main__":
    sys.exit(main())
