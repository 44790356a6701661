"""CPU per request of one gateway on the shared stores: gateway, Redis, PostgreSQL.

Wall-clock rates are noisy on a shared 2-core machine; CPU time per request is not
(much). Starts the fake upstream and ``ncap serve`` for each ``--targets`` entry
(``ncap-shared``: a PostgreSQL ledger and Redis budgets of the run's own, as
bench/gateway_bench.py; ``ncap``: the embedded default), warms it, then per repeat
sends ``--requests`` requests at ``-c`` with bench/loadgen.py and reads:

- the gateway's user+sys CPU (``/proc/PID/stat`` of its process tree), and its sys part;
- Redis: the server's ``used_cpu_user + used_cpu_sys`` (``INFO cpu``; the whole server,
  so another client's commands count too) and the ``EVALSHA`` calls and their
  ``usec`` (``INFO commandstats``: the scripts' own run time);
- PostgreSQL: the CPU of the backends connected to the run's database
  (``pg_stat_activity`` → ``/proc``) and of the server's other processes (WAL writer,
  checkpointer, …: shared with any other database on the server), the WAL bytes
  written (``pg_stat_wal``, server-wide too) and, at the end, the ledger's heap and
  index bytes per row.

Prints µs per request for each, per repeat and the median.

    PYTHONPATH=$PWD/src .venv/bin/python bench/shared_cpu.py [--targets ncap-shared]
        [--requests 4000] [-c 16] [--repeats 3] [--warmup-s 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--targets", default="ncap-shared")
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("-c", "--concurrency", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--warmup-s",
        type=float,
        default=8.0,
        help="seconds of load before measuring: long enough for the gateway's admission"
        " ramp (server.ramp: +500 requests/s per second) to reach the full rate",
    )
    p.add_argument("--pin-upstream", default=gb.PIN_UPSTREAM)
    p.add_argument("--pin-loadgen", default=gb.PIN_LOADGEN)
    p.add_argument("--pg-stats", action="store_true", help="wait for PostgreSQL's commit counts")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ncap-shared-cpu-"))
    gb_args = argparse.Namespace(
        pin_upstream=args.pin_upstream,
        upstream_module=None,
        ncap_config=None,
        concurrency=[args.concurrency],
        pin_target="",
    )
    upstream, port = gb.start_upstream(work, gb_args)
    run = gb.Run(gb_args, work, upstream, port)
    results: dict[str, Any] = {}
    try:
        for name in args.targets.split(","):
            target = gb.ncap_target(run, name)
            if isinstance(target, str):
                print(f"{name} skipped: {target}", file=sys.stderr)
                continue
            try:
                results[name] = measure(run, target, args)
            finally:
                bl.stop_server(target.server)
    finally:
        bl.stop_server(upstream)
        gb.drop_shared_stores(run)
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def measure(run: gb.Run, target: gb.Target, args: argparse.Namespace) -> dict[str, Any]:
    shared = target.name.startswith("ncap-shared") and run.shared is not None
    client = redis.Redis.from_url(gb.BENCH_REDIS)
    database = run.shared[0].rsplit("/", 1)[1] if shared and run.shared else None
    _warm(target, args)
    time.sleep(11.0 if args.pg_stats else 1.0)
    rows: list[dict[str, float]] = []
    for i in range(args.repeats):
        before = _sample(target, client, database)
        t0 = time.monotonic()
        res = _load(target, args, args.requests)
        wall = time.monotonic() - t0
        time.sleep(0.5)  # the last settlements run after the answers
        if args.pg_stats:
            time.sleep(11)  # idle backends report their commits at most 10 s late
        after = _sample(target, client, database)
        n = int(res["requests"])
        counts = ("evalsha_calls", "evalsha_usec", "redis_reads", "pg_commits", "pg_wal_bytes")
        row = {k: 1e6 * (after[k] - before[k]) / n for k in after if k not in counts}
        for k in counts:
            row[k + "/req"] = (after[k] - before[k]) / n
        row["rps_incl_start"] = n / wall
        row["errors"] = float(res["errors"])
        rows.append(row)
        print(f"{target.name} #{i}: " + _fmt(row), file=sys.stderr, flush=True)
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"{target.name} median: " + _fmt(median), flush=True)
    out = {"repeats": rows, "median": median, "loadavg": bl.loadavg()}
    if database is not None:
        out["ledger_bytes"] = _ledger_bytes(database)
        print(f"{target.name} ledger: " + _fmt(out["ledger_bytes"]), flush=True)
    return out


def _ledger_bytes(database: str) -> dict[str, float]:
    """Heap and index bytes per ledger row of the run's database (every row the run
    wrote, warm-up included; settled rows carry one dead tuple until vacuumed)."""
    query = (
        "SELECT count(*), pg_relation_size('ledger_events'), pg_indexes_size('ledger_events'),"
        " pg_total_relation_size('ledger_events') FROM ledger_events"
    )
    rows, heap, indexes, total = (float(v) for v in _psql(query, database).split("|"))
    return {
        "rows": rows,
        "heap_bytes/row": heap / rows,
        "index_bytes/row": indexes / rows,
        "total_bytes/row": total / rows,
    }


def _fmt(row: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.1f}" for k, v in row.items())


def _warm(target: gb.Target, args: argparse.Namespace) -> None:
    """Load for ``--warmup-s`` seconds (a count of requests would pass in a burst the
    admission ramp refuses in part, leaving the gateway below its rate)."""
    argv = _loadgen(target, args, "--duration", str(args.warmup_s))
    subprocess.run(argv, capture_output=True, timeout=600, check=False)


def _load(target: gb.Target, args: argparse.Namespace, requests: int) -> dict[str, Any]:
    argv = _loadgen(target, args, "--requests", str(requests))
    out = subprocess.run(argv, capture_output=True, timeout=600)
    if out.returncode not in (0, 1) or not out.stdout:
        raise RuntimeError(f"loadgen failed: {out.stderr.decode(errors='replace')[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def _loadgen(target: gb.Target, args: argparse.Namespace, *how_long: str) -> list[str]:
    """bench/loadgen.py against ``target`` at ``-c``, for ``how_long`` (a duration or a
    count of requests), one JSON result."""
    argv = [*bl.pin_prefix(args.pin_loadgen), str(bl.VENV_PY), str(bl.BENCH / "loadgen.py")]
    argv += [target.url, "-c", str(args.concurrency), *how_long]
    argv += ["--warmup", "0", "--api-key", target.api_key, "--model", "fake-model", "--json"]
    return argv


def _sample(target: gb.Target, client: Any, database: str | None) -> dict[str, float]:
    """Cumulative CPU seconds (and EVALSHA counters) of everything measured."""
    cpu = client.info("cpu")
    stats = client.info("commandstats").get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    reads = client.info("stats").get("total_reads_processed", 0)
    sample = {
        "gateway_us": bl.cpu_seconds(target.server.pid),
        "gateway_sys_us": sum(_proc_cpu(p, user=False) for p in bl.tree(target.server.pid)),
        "redis_us": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
        "evalsha_calls": float(stats["calls"]),
        "evalsha_usec": float(stats["usec"]),
        "redis_reads": float(reads),
    }
    backends, others = _postgres_pids(database)
    sample["pg_backends_us"] = sum(_proc_cpu(p) for p in backends)
    sample["pg_server_other_us"] = sum(_proc_cpu(p) for p in others)
    sample["pg_commits"] = _pg_commits(database) if database else 0.0
    # WAL is counted server-wide (pg_stat_wal): another database's writes count too
    sample["pg_wal_bytes"] = float(_psql("SELECT wal_bytes FROM pg_stat_wal")) if database else 0.0
    return sample


def _psql(query: str, database: str | None = None) -> str:
    admin = urlsplit(gb.BENCH_POSTGRES)
    server = ["-h", admin.hostname or "127.0.0.1", "-p", str(admin.port or 5432)]
    who = ["-U", admin.username or "postgres", database or admin.path.lstrip("/") or "postgres"]
    out = subprocess.run(
        ["psql", *server, *who, "-Atc", query], capture_output=True, text=True, check=True
    )
    return out.stdout


def _pg_commits(database: str) -> float:
    """Committed transactions of the database (statements: the ledger sends no BEGIN);
    backends report them when idle, up to 10 s late (see --pg-stats)."""
    rows = _psql(f"SELECT xact_commit FROM pg_stat_database WHERE datname = '{database}'")
    return float(rows.strip() or 0)


def _postgres_pids(database: str | None) -> tuple[list[int], list[int]]:
    """Backends on ``database``, and the server's processes that are not backends."""
    query = "SELECT pid, coalesce(datname, ''), backend_type FROM pg_stat_activity"
    backends, others = [], []
    for line in _psql(query).splitlines():
        pid, datname, kind = line.split("|")
        if kind == "client backend":
            if database is not None and datname == database:
                backends.append(int(pid))
        else:
            others.append(int(pid))
    return backends, others


def _proc_cpu(pid: int, *, user: bool = True) -> float:
    """User (unless ``user=False``) + system CPU seconds of one process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return ((int(fields[11]) if user else 0) + int(fields[12])) / bl.CLK_TCK


if __name__ == "__main__":
    sys.exit(main())
