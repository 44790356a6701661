"""Profile ``ncap serve`` under load: where a request's CPU goes on each store set-up.

Starts the fake upstream and ``ncap serve`` under cProfile (the event-loop thread;
the SQLite writer thread runs outside the profiler and shows up as the time the loop
spends waiting), drives it with bench/loadgen.py at ``--concurrency`` for
``--duration`` seconds, stops it with SIGTERM (cProfile writes its stats on the
clean exit) and prints the top functions by own time and by cumulative time.
Stats go to bench/results/partial/profile-<setup>.prof (ignored by git) and a text
summary beside it; the top functions by own time go to the ``profile`` result.

    .venv/bin/python bench/profile_gateway.py [--setups ncap,ncap-memory]
        [--concurrency 16] [--duration 10] [--top 25]
"""

from __future__ import annotations

import argparse
import io
import pstats
import shutil
import sys
import tempfile
from pathlib import Path

import benchlib as bl
import gateway_bench as gb


def profile(run: gb.Run, name: str, args: argparse.Namespace) -> tuple[str, list[bl.Table]]:
    home = run.work / name
    home.mkdir(exist_ok=True)
    config = run.work / f"{name}.yaml"
    limit = 2 * args.concurrency
    config.write_text(gb.ncap_config_text(run.upstream_port, home, gb.NCAP_STORES[name], limit))
    out = Path(args.results) / f"profile-{name}.prof"
    port = bl.free_port()
    argv = [str(bl.VENV_PY), "-m", "cProfile", "-o", str(out), "-m", "ncap.cli.main"]
    argv += ["serve", "--config", str(config), "--port", str(port)]
    server = bl.start_server(name, argv, run.work, env={"NCAP_BENCH_UPSTREAM_KEY": "d"}, cwd=home)
    target = gb._ready_or_reason(gb.Target(name, gb._chat_url(port), server))
    if isinstance(target, str):
        return f"{name}: skipped ({target})", []
    try:
        res = gb._loadgen(target, run.args, args.concurrency, args.duration, 0.5)
    finally:
        bl.stop_server(server, grace_s=30)
    if not out.exists():
        return f"{name}: no profile written (did the server exit cleanly?)\n{server.tail()}", []
    head = f"{name}: {res['throughput_rps']} req/s, p50 {res['p50_ms']} ms"
    table = bl.profile_table(out, f"{head}, top {args.top} by own time", args.top)
    return _summary(name, out, res, args.top), [table]


def _summary(name: str, prof: Path, res: dict[str, object], top: int) -> str:
    text = io.StringIO()
    text.write(f"## {name}: {res['throughput_rps']} req/s, p50 {res['p50_ms']} ms\n\n")
    stats = pstats.Stats(str(prof), stream=text)
    stats.strip_dirs()
    for key in ("tottime", "cumulative"):
        text.write(f"### top {top} by {key}\n\n```\n")
        stats.sort_stats(key).print_stats(top)
        text.write("```\n\n")
    summary = text.getvalue()
    prof.with_suffix(".txt").write_text(summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--setups", default="ncap,ncap-memory")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--results", default=str(bl.RESULTS / "partial"))
    args = p.parse_args(argv)
    Path(args.results).mkdir(parents=True, exist_ok=True)
    bench_args = gb.parse_args(["--concurrency", str(args.concurrency)])
    work = Path(tempfile.mkdtemp(prefix="ncap-profile-"))
    upstream, port = gb.start_upstream(work, bench_args)
    run = gb.Run(bench_args, work, upstream, port)
    tables: list[bl.Table] = []
    try:
        for name in (s.strip() for s in args.setups.split(",") if s.strip()):
            summary, found = profile(run, name, args)
            print(summary)
            tables += found
    finally:
        bl.stop_server(upstream)
        shutil.rmtree(work, ignore_errors=True)
    bl.save_result("profile", tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
