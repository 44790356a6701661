"""One change's effect on throughput and CPU per request: the same ncap set-up served
from two source trees side by side, measured in interleaved pairs.

On a shared 2-core machine a round's speed moves by tens of percent from one minute to
the next, more than most changes are worth, so rounds of separate targets (as in
``gateway_bench.py``) cannot show a change of a few percent. Here the two servers (this
checkout's ``src`` and ``--before-src``, on one fake upstream) are measured back to back
in each pair, the order alternating from pair to pair, and each pair gives the ratio
after / before of its throughput and of the gateway's CPU per request (its own
``/proc`` counters); the medians of those paired ratios are the result. Prints only.

    .venv/bin/python bench/src_ab.py --before-src DIR [--setup ncap-memory]
        [--pairs 12] [--duration 3] [--warmup 2] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import benchlib as bl
import gateway_bench as gb


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before-src", required=True, help="the other checkout's src directory")
    p.add_argument("--setup", default="ncap-memory", choices=sorted(gb.NCAP_STORES))
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=16)
    return p.parse_args(argv)


def _start(run: gb.Run, setup: str, src: str | None, work: Path) -> gb.Target:
    """``ncap serve`` of ``setup``; with ``src``, that tree's package first on the path."""
    run.work = work
    work.mkdir(exist_ok=True)
    if src is not None:
        os.environ["PYTHONPATH"] = str(Path(src).resolve())
    try:
        target = gb.ncap_target(run, setup)
    finally:
        os.environ.pop("PYTHONPATH", None)
    if isinstance(target, str):
        raise SystemExit(f"{setup}: {target}")
    return target


def _point(target: gb.Target, run: gb.Run, args: argparse.Namespace) -> tuple[float, float]:
    """(requests/s, gateway CPU ms per request) of one closed-loop window."""
    with bl.measured(target.server.pid, [run.upstream.pid]) as cpu:
        out = gb._loadgen(target, run.args, args.concurrency, args.duration, args.warmup)
    rps = float(out["throughput_rps"] or 0)
    loaded = args.duration + args.warmup
    return rps, (1000 * cpu["cpu_s"] / (rps * loaded) if rps else float("nan"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ncap-src-ab-"))
    gb_args = gb.parse_args(["--targets", args.setup, "--concurrency", str(args.concurrency)])
    upstream, port = gb.start_upstream(work, gb_args)
    run = gb.Run(gb_args, work, upstream, port)
    after = _start(run, args.setup, None, work / "after")
    before = _start(run, args.setup, args.before_src, work / "before")
    pairs: list[dict[str, tuple[float, float]]] = []
    try:
        for target in (after, before):
            gb._loadgen(target, gb_args, args.concurrency, 4.0, 0.0)
        for i in range(args.pairs):
            order = (after, before) if i % 2 == 0 else (before, after)
            pair = {("after" if t is after else "before"): _point(t, run, args) for t in order}
            pairs.append(pair)
            shown = {k: f"{rps:.0f} req/s, {ms:.3f} ms" for k, (rps, ms) in pair.items()}
            print(f"pair {i + 1}: {shown}", file=sys.stderr, flush=True)
    finally:
        for target in (after, before):
            bl.stop_server(target.server)
        bl.stop_server(upstream)
    print(f"{args.setup}, c={args.concurrency}, {len(pairs)} pairs (after / before):")
    for label, index in (("throughput", 0), ("CPU per request", 1)):
        print(f"  {label}: {_summary([p['after'][index] / p['before'][index] for p in pairs])}")
    return 0


def _summary(ratios: list[float]) -> str:
    """The median and geometric mean of the paired ratios, the geometric mean of each
    order (``after`` measured first: even pairs; second: odd pairs) and the pairs.

    The order alternates, so with an even number of pairs the overall geometric mean
    cancels an order effect (the server measured second in a pair running slower or
    faster, e.g. while the idle one checkpoints its SQLite WAL); two order means far
    apart say the median is not to be read alone."""
    first, second = ratios[0::2], ratios[1::2]
    parts = [
        f"median {statistics.median(ratios):.3f}",
        f"geometric mean {statistics.geometric_mean(ratios):.3f}",
    ]
    if first and second:
        parts.append(
            f"after first {statistics.geometric_mean(first):.3f}, "
            f"after second {statistics.geometric_mean(second):.3f}"
        )
    return "; ".join(parts) + ", pairs " + ", ".join(f"{v:.2f}" for v in sorted(ratios))


if __name__ == "__main__":
    sys.exit(main())
