"""A 1,000,000-row ledger through the FinOps commands: ``ncap ledger export --format csv``
and ``ncap audit`` (``--jsonl``: the JSONL export too), each timed as its own process,
with that process's CPU and the machine's load (a busy machine stretches the wall time).

Generates the ledger first (``ncap ledger generate``, kept in ``--dir`` for the next
run), then runs each command with stdout to a file and checks what it wrote (the CSV
has a header and one line per row). ``--events`` also times the event-by-event export
(the path a PostgreSQL ledger takes, and SQLite's before the streamed one) for the
ratio; it takes minutes.

    .venv/bin/python bench/export_bench.py [--rows 1000000] [--dir /tmp/ncap-export-bench]
        [--jsonl] [--events]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchlib as bl

NCAP = [sys.executable, "-m", "ncap.cli.main"]
LIMIT_S = 30.0  # the target for a 1M-row CSV export


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(args: list[str], out: Path) -> dict[str, Any]:
    """One command, stdout to ``out``: wall seconds, CPU seconds of the process, bytes."""
    cpu, start = _cpu(), time.perf_counter()
    with out.open("wb") as sink:
        done = subprocess.run([*NCAP, *args], stdout=sink, stderr=subprocess.PIPE)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed: {done.stderr.decode()[-2000:]}")
    return {
        "command": "ncap " + " ".join(args),
        "wall_s": round(wall, 2),
        "cpu_s": round(_cpu() - cpu, 2),
        "bytes": out.stat().st_size,
    }


def lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def table(results: dict[str, Any]) -> bl.Table:
    """One row per timed command: wall and CPU seconds, output size, lines or requests."""
    rows = []
    for key in ("csv", "jsonl", "audit_7d", "csv_events"):
        if key in results:
            run = results[key]
            count = run.get("lines", run.get("requests"))
            rows.append([run["command"], run["wall_s"], run["cpu_s"], run["bytes"], count])
    notes = f"Ledger generated in {results.get('generate_s', '–')} s (when not cached)."
    if "ratio_events_over_streamed" in results:
        notes += f" Event-by-event over streamed CSV: {results['ratio_events_over_streamed']}×."
    title = f"FinOps commands on a {results['rows']:,}-row ledger"
    columns = ["command", "wall s", "CPU s", "output bytes", "lines (or requests)"]
    return bl.Table(title, columns, rows, notes=notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/ncap-export-bench"))
    parser.add_argument("--events", action="store_true", help="also time the event path")
    parser.add_argument("--jsonl", action="store_true", help="also time the JSONL export")
    opts = parser.parse_args()
    opts.dir.mkdir(parents=True, exist_ok=True)
    ledger, config = opts.dir / f"ledger-{opts.rows}.db", opts.dir / f"ledger-{opts.rows}.yaml"
    results: dict[str, Any] = {"rows": opts.rows, "load_1m": os.getloadavg()[0]}
    if not ledger.exists():
        start = time.perf_counter()
        args = ["ledger", "generate", "--rows", str(opts.rows), "--out", str(ledger)]
        subprocess.run([*NCAP, *args, "--write-config", str(config)], check=True)
        results["generate_s"] = round(time.perf_counter() - start, 1)
    csv_out = opts.dir / "export.csv"
    results["csv"] = timed(["ledger", "export", "--format", "csv", "-c", str(config)], csv_out)
    results["csv"]["lines"] = lines(csv_out)
    assert results["csv"]["lines"] == opts.rows + 1, results["csv"]  # header + one per row
    if opts.jsonl:
        jsonl_out = opts.dir / "export.jsonl"
        results["jsonl"] = timed(["ledger", "export", "-c", str(config)], jsonl_out)
        results["jsonl"]["lines"] = lines(jsonl_out)
    audit_out = opts.dir / "audit.json"
    results["audit_7d"] = timed(
        ["audit", "--since", "7d", "--format", "json", "-c", str(config)], audit_out
    )
    results["audit_7d"]["requests"] = json.loads(audit_out.read_text())["totals"]["requests"]
    if opts.events:
        slow_out = opts.dir / "export-events.csv"
        results["csv_events"] = timed(
            ["ledger", "export", "--format", "csv", "--by-event", "-c", str(config)], slow_out
        )
        same = slow_out.read_bytes() == csv_out.read_bytes()
        results["csv_events"]["identical_to_streamed"] = same
        results["ratio_events_over_streamed"] = round(
            results["csv_events"]["wall_s"] / results["csv"]["wall_s"], 1
        )
    results["load_1m_after"] = os.getloadavg()[0]
    results["csv_under_30s"] = results["csv"]["wall_s"] < LIMIT_S
    print(json.dumps(results, indent=2))
    bl.save_result("export", [table(results)], raw=results)
    if not results["csv_under_30s"]:
        raise SystemExit(f"CSV export of {opts.rows:,} rows took {results['csv']['wall_s']} s")


if __name__ == "__main__":
    main()
