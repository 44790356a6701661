"""User-space instructions per relayed chunk under callgrind, by cause: the relay's cost
measured so that a busy machine does not move it.

A streaming upstream paced so that each event arrives in its own read (``--pace-ms``
between writes: the gateway, 50× slower under valgrind, still keeps up; the
``client_reads_per_chunk`` column falls below 1 when it did not) serves the bare
pass-through and ``ncap serve`` (shipped default) with one concern of the relay
switched off at a time (the cases of ``bench/stream_profile.py``). Each runs under
``valgrind --tool=callgrind --instr-atstart=no``; after warm-up streams the
instrumentation is switched on, ``--streams`` streams are read at c=1 and the total is
divided by the chunks relayed, less what the process does in the same wall time with no
traffic (its timers and background tasks, measured right after: ``idle_instructions``).
``--src`` serves another tree; ``--before-src DIR`` serves another tree too, each case
right after this tree's (``before-full``, ``before-fanout``), so that both see the same
machine. ``fanout`` is ``full`` on the emulated route (``--n`` single-candidate
branches merged; use it with ``--n 4``). Kernel time is not counted.

    .venv/bin/python bench/stream_instructions.py [--cases full,no-decode,...]
        [--streams 4] [--tokens 200] [--n 1] [--pace-ms 2] [--src DIR]
        [--before-src DIR] [--keep DIR]
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
from pathlib import Path
from typing import Any

import benchlib as bl
import stream_bench as sb
import stream_profile as sp


def _callgrind(flags: list[str], pid: int) -> None:
    subprocess.run(["callgrind_control", *flags, str(pid)], capture_output=True, check=False)


def _totals(path: Path) -> int:
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    return 0


def _dumped(pid: int, work: Path, case: str) -> int:
    """Instrumentation off, the counts since the last zeroing dumped and read."""
    before = set(work.glob(f"{case}.callgrind*"))
    _callgrind(["-i", "off"], pid)
    _callgrind(["-d"], pid)
    time.sleep(1)
    fresh = set(work.glob(f"{case}.callgrind*")) - before
    return max((_totals(p) for p in fresh), default=0)


def measure(
    case: str, args: argparse.Namespace, up_port: int, work: Path, src: str
) -> dict[str, Any]:
    port = bl.free_port()
    env = dict(os.environ, NCAP_BENCH_UPSTREAM_KEY="dummy", PYTHONPATH=src)
    served = case.removeprefix("before-")
    served = "full" if served == "fanout" else served
    if case == "bare":
        argv = sb._sub("bare", "--port", str(port), "--upstream", sb._url(up_port))
    else:
        home = work / case
        home.mkdir(exist_ok=True)
        config = sb.NCAP_CONFIG.format(port=up_port, stores="default", stores_block="")
        (home / "ncap.yaml").write_text(config)
        argv = sb._py(str(bl.BENCH / "stream_profile.py"), "serve", "--case", served, "--")
        argv += ["serve", "--config", str(home / "ncap.yaml"), "--port", str(port)]
    out = work / f"{case}.callgrind"
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
    valgrind += [f"--callgrind-out-file={out}"]
    with (work / f"{case}.log").open("wb") as log:
        server = subprocess.Popen(valgrind + argv, env=env, cwd=work, stdout=log, stderr=log)
    model = "fake-fanout" if case.endswith("fanout") else "fake-model"
    target = sb.Target(case, sb._url(port), None, model=model)
    n = args.n
    try:
        sb._wait_port(bl.Server(case, server, work / f"{case}.log"), port, timeout_s=300)
        sb.run_load(target, n, args.tokens, 1, 2)
        _callgrind(["-i", "on"], server.pid)
        sb.run_load(target, n, args.tokens, 1, 1)  # the instrumented paths warm up too
        _callgrind(["-z"], server.pid)
        res = sb.run_load(target, n, args.tokens, 1, args.streams)
        total = _dumped(server.pid, work, case)
        # the same wall time without traffic: what the process does on its own (timers,
        # background tasks), which a slow pace would otherwise spread over the chunks
        _callgrind(["-i", "on"], server.pid)
        _callgrind(["-z"], server.pid)
        time.sleep(res["wall_s"])
        idle = _dumped(server.pid, work, case)
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            for path in work.glob(f"{case}.callgrind*"):
                shutil.copy(path, Path(args.keep) / path.name)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    chunks = res["ok"] * n * args.tokens
    row = {"case": case, "streams": res["ok"], "errors": res["errors"]}
    row["instructions_per_chunk"] = round((total - idle) / chunks) if chunks else None
    row["idle_instructions"] = idle
    row["instructions_per_chunk_with_idle"] = round(total / chunks) if chunks else None
    # below 1: the target fell behind the pace and relayed several events per read
    row["client_reads_per_chunk"] = round(res["reads"] / chunks, 3) if chunks else None
    print(
        f"  {case:<14} {row['instructions_per_chunk']} instructions/chunk, "
        f"{row['client_reads_per_chunk']} client reads/chunk",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default="bare," + ",".join(sp.CASES))
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--n", type=int, default=1, help="choices per stream (interleaved)")
    p.add_argument("--pace-ms", type=float, default=2.0)
    p.add_argument("--src", default=str(bl.ROOT / "src"))
    p.add_argument("--before-src", default="", help="also serve these sources, case by case")
    p.add_argument("--keep", default="")
    p.add_argument("--output", help="also write the raw results here (they are in the envelope)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ncap-stream-instr-"))
    port = bl.free_port()
    upstream_argv = sb._sub("upstream", "--port", str(port), "--pace-ms", str(args.pace_ms))
    upstream = bl.start_server("upstream", upstream_argv, work)
    rows: list[dict[str, Any]] = []
    try:
        sb._wait_port(upstream, port)
        for case in (c.strip() for c in args.cases.split(",") if c.strip()):
            rows.append(measure(case, args, port, work, args.src))
            if args.before_src and case != "bare":  # the same case, right after
                rows.append(measure(f"before-{case}", args, port, work, args.before_src))
    finally:
        bl.stop_server(upstream)
        shutil.rmtree(work, ignore_errors=True)
    bare = next((r["instructions_per_chunk"] for r in rows if r["case"] == "bare"), None)
    for row in rows:
        if bare and row["instructions_per_chunk"]:
            row["x_bare"] = round(row["instructions_per_chunk"] / bare, 2)
    result = {
        "src": args.src,
        "before_src": args.before_src,
        "n": args.n,
        "tokens": args.tokens,
        "pace_ms": args.pace_ms,
        "rows": rows,
    }
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(rows, indent=1))
    if Path(args.src).resolve() == (bl.ROOT / "src").resolve():  # not a before/after tree
        bl.save_result("stream-instructions", [table(result)], raw=result)
    return 0


def table(result: dict[str, Any]) -> bl.Table:
    columns = ["case", "streams", "errors", "instructions per chunk", "× bare"]
    keys = ["case", "streams", "errors", "instructions_per_chunk", "x_bare"]
    rows = [[row.get(k) for k in keys] for row in result["rows"]]
    for row in rows:  # errors by kind: their count is what the table shows
        row[2] = sum(row[2].values()) if isinstance(row[2], dict) else row[2]
    title = f"Instructions per relayed chunk ({result['tokens']} tokens a stream)"
    return bl.Table(title, columns, rows, notes=f"Upstream paced {result['pace_ms']} ms per event.")


if __name__ == "__main__":
    sys.exit(main())
