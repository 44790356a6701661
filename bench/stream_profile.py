"""Where a streamed chunk's CPU goes in ``ncap serve``: the relay profiled by cause.

Each case serves the same config (the shipped default stores unless ``--stores
memory``) with ONE concern of the streaming path switched off by monkeypatching it in
the served process (never in the product code), and measures the gateway process's
CPU per relayed chunk (its own /proc counters) under the stream benchmark's load; the
bare pass-through is measured in the same run, for the ratio. The difference between
``full`` and a case is what that concern costs:

  full          nothing switched off
  no-decode     the settlement decode (each data event's ``ResponseSummary``) skipped
  no-tally      the settlement tally (indexes, finish reasons, usage) skipped
  no-watchdog   the client-write watchdog and the stream duration bound bypassed
                (a write loop without either)
  no-split      the upstream reads relayed without any event splitting or decoding
                (what is left: aiohttp both sides, the lifecycle's generators, the
                settlement at the end; the stream is then not settled to its usage)
  no-gc         Python's cyclic garbage collector off (what its passes cost)
  no-evidence   the candidates' evidence hook (n > 1 streams) a no-op

``bare`` (the aiohttp pass-through) is measured in every run; naming it in ``--cases``
changes nothing.

``--cprofile`` also runs ``full`` under cProfile and prints the top functions by own
time (``--top``), with the calls per relayed chunk: the profiler is switched on in the
served process (SIGUSR1) after the warm-up, so the top is the measured load's and not
the start-up's. ``--ncap-src`` serves other sources (e.g. an older checkout): only
``full`` and ``--cprofile`` apply to sources whose internals differ, and such a run is
not saved as this checkout's result.

``--before-src DIR`` measures another checkout's ``full`` in the same run beside this
one's: a ``full-before`` row in the CPU table and, with ``--cprofile``, a second
cProfile top, each titled with its tree's commit. Comparing the two tops of one run is
what it is for: on a shared machine the absolute seconds move between runs, the shares
and the calls per chunk much less.

    .venv/bin/python bench/stream_profile.py [--cases full,no-decode,...]
        [--scenario n4x250] [--requests 150] [--cprofile] [--ncap-src DIR]
        [--before-src DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import benchlib as bl
import stream_bench as sb

CASES = ("full", "no-decode", "no-tally", "no-watchdog", "no-split", "no-gc", "no-evidence")


def switch_off(case: str) -> None:
    """Monkeypatch one concern out of the served process (see the module docstring)."""
    from ncap.protocol.responses import ResponseSummary
    from ncap.streaming import sse

    if case == "no-evidence":
        from ncap.lifecycle.evidence import EvidenceFeed

        EvidenceFeed.piece = lambda self, raw, summaries=(): None  # type: ignore[method-assign]
        sse.EventSplitter.read_candidates = lambda self: None  # type: ignore[method-assign]
    elif case == "no-gc":
        import gc

        gc.disable()
    elif case == "no-decode":
        blank, decode = ResponseSummary(), sse._decode_summary
        # ``[DONE]`` is still found (its decode fails): the stream must end as it does
        sse._decode_summary = lambda data: blank if data[:1] == b"{" else decode(data)
    elif case == "no-tally":
        from ncap.lifecycle.attempt_report import Tally

        Tally.add_all = lambda self, summaries: False  # type: ignore[method-assign]
    elif case == "no-watchdog":
        from ncap.http import app

        async def unwatched(
            request: Any, response: Any, stream: AsyncIterator[bytes], limits: Any, first: Any
        ) -> None:
            await response.prepare(request)
            async for chunk in stream:
                await response.write(chunk)
                first()

        app.write_stream = unwatched  # type: ignore[assignment]
    elif case == "no-split":

        def feed(self: sse.EventSplitter, chunk: bytes) -> sse.StreamPiece:
            self.done = chunk.endswith(b"[DONE]\n\n")
            return sse.StreamPiece(chunk, [], done=self.done)

        sse.EventSplitter.feed = feed  # type: ignore[method-assign,assignment]


def serve_main(case: str, profile: str | None, argv: list[str]) -> None:
    if case != "full":
        switch_off(case)
    from ncap.cli.main import main

    sys.argv = ["ncap", *argv]
    if not profile:
        main()
        return
    import cProfile

    profiler = cProfile.Profile()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a clean exit writes stats
    # on only once the warm-up is done (the driver sends SIGUSR1): the load's calls alone
    signal.signal(signal.SIGUSR1, lambda signum, frame: profiler.enable())
    try:
        main()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        profiler.disable()
        profiler.dump_stats(profile)


def start(
    work: Path,
    up_port: int,
    case: str,
    stores: str,
    profile: Path | None,
    src: str | None = None,
    name: str | None = None,
) -> sb.Target:
    """``ncap serve`` with ``case`` switched off, from this tree's sources or ``src``."""
    name = name or case
    home = work / name
    home.mkdir(exist_ok=True)
    memory = stores == "memory"
    config = sb.NCAP_CONFIG.format(
        port=up_port, stores=stores, stores_block=sb.MEMORY_STORES if memory else ""
    )
    (home / "ncap.yaml").write_text(config)
    port = bl.free_port()
    argv = sb._py(str(Path(__file__).resolve()), "serve", "--case", case)
    if profile is not None:
        argv += ["--profile", str(profile)]
    argv += ["--", "serve", "--config", str(home / "ncap.yaml"), "--port", str(port)]
    env = {"NCAP_BENCH_UPSTREAM_KEY": "dummy", "PYTHONPATH": src or sb.NCAP_SRC[0]}
    server = bl.start_server(f"ncap-{name}", argv, work, env=env, cwd=home)
    sb._wait_port(server, port)
    return sb.Target(f"ncap-{name}", sb._url(port), server, note=case)


def load_chunks(
    target: sb.Target, args: argparse.Namespace, profiled: bool = False
) -> tuple[float, int]:
    """Warm up, then the measured load: the server's CPU seconds during it and the
    chunks relayed (``profiled``: the server's profiler switched on in between)."""
    n, tokens = sb.SCENARIOS[args.scenario]
    sb.run_load(target, n, tokens, 4, 8)
    assert target.server is not None
    if profiled:
        os.kill(target.server.pid, signal.SIGUSR1)
        time.sleep(0.5)  # the handler runs at the served loop's next turn
    with bl.measured(target.server.pid) as cpu:
        res = sb.run_load(target, n, tokens, args.concurrency, args.requests)
    return float(cpu["cpu_s"]), res["ok"] * n * tokens


def cpu_per_chunk(target: sb.Target, args: argparse.Namespace) -> float | None:
    cpu_s, chunks = load_chunks(target, args)
    return 1e6 * cpu_s / chunks if chunks else None


def tree_commit(src: str) -> str:
    """The short commit of the checkout holding ``src``, ``+dirty`` when its sources differ."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=src, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", ".") else "")


def profile_run(
    work: Path, up_port: int, args: argparse.Namespace, src: str, name: str, title: str
) -> tuple[str, bl.Table | None]:
    """``full`` from ``src`` under cProfile through one measured load: the text top and
    the table (top ``--top`` by own time, with the calls per relayed chunk)."""
    prof = work / f"{name}.prof"
    target = start(work, up_port, "full", args.stores, prof, src=src, name=name)
    _, chunks = load_chunks(target, args, profiled=True)
    assert target.server is not None
    bl.stop_server(target.server, grace_s=30)
    deadline = time.monotonic() + 30
    while not prof.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not prof.exists():
        return "no profile", None
    stats = pstats.Stats(str(prof))
    calls = int(stats.total_calls)  # type: ignore[attr-defined]
    own = float(stats.total_tt)  # type: ignore[attr-defined]
    n, tokens = sb.SCENARIOS[args.scenario]
    table = bl.profile_table(prof, title, args.top)
    per_chunk = f"{calls / chunks:.1f}" if chunks else "–"
    writes = client_writes(stats)
    table.notes = (
        f"Calls per relayed chunk: {per_chunk} ({calls:,} calls, {own:.2f} s of own time in"
        f" all functions, over {chunks:,} chunks: {chunks // (n * tokens):,} streams of n={n}"
        f" × {tokens} tokens at c={args.concurrency}). Client writes (aiohttp's"
        f" `StreamResponse.write`): {writes:,}, {chunks / max(writes, 1):.1f} chunks per"
        " write (a relay that works per read writes what one upstream read brings; this"
        " upstream sends a stream's events as fast as it can, so a gateway behind it, as"
        " under the profiler, reads and writes many at once). The profiler was on for the"
        " measured load only, in the gateway process; the upstream and the load generator"
        " are not profiled. The machine is shared with other engineers' test runs (the load"
        " average is in the run's facts above): the seconds are slowed by them and by the"
        " profiler, and move from run to run; the shares of own time and the calls per"
        " chunk are what to compare, and both tops come from the same run."
    )
    return top(prof, args.top), table


def client_writes(stats: pstats.Stats) -> int:
    """Calls of aiohttp's ``StreamResponse.write``: the writes to the clients, whichever
    relay made them (the same aiohttp serves both trees)."""
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, object]]
    raw = stats.stats  # type: ignore[attr-defined]
    return sum(
        v[1]
        for (file, _, func), v in raw.items()
        if func == "write" and file.endswith(os.path.join("aiohttp", "web_response.py"))
    )


def top(profile: Path, count: int) -> str:
    text = io.StringIO()
    stats = pstats.Stats(str(profile), stream=text)
    stats.strip_dirs().sort_stats("tottime").print_stats(count)
    lines = text.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(lines[start:])


def drive(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="ncap-stream-profile-"))
    up, up_port = sb.start_upstream(work)
    results: dict[str, Any] = {"scenario": args.scenario, "stores": args.stores, "rounds": []}
    results["commit"] = tree_commit(args.ncap_src)
    if args.before_src:
        results["before_src"] = args.before_src
        results["before_commit"] = tree_commit(args.before_src)
    try:
        bare = sb.bare_target(work, up_port)
        cases = [c.strip() for c in args.cases.split(",") if c.strip() and c.strip() != "bare"]
        targets = {case: start(work, up_port, case, args.stores, None) for case in cases}
        if args.before_src:
            targets["full-before"] = start(
                work, up_port, "full", args.stores, None, src=args.before_src, name="full-before"
            )
        for number in range(args.rounds):
            row: dict[str, Any] = {"bare": cpu_per_chunk(bare, args)}
            for case, target in targets.items():
                row[case] = cpu_per_chunk(target, args)
            results["rounds"].append(row)
            cells = ", ".join(f"{k} {v:.2f}" for k, v in row.items() if v is not None)
            print(f"round {number + 1} (µs per chunk): {cells}", flush=True)
        for target in [bare, *targets.values()]:
            assert target.server is not None
            bl.stop_server(target.server)
        if args.cprofile:
            profiles = []
            if args.before_src:
                commit = results["before_commit"]
                title = f"cProfile before the per-read relay (commit {commit})"
                profiles.append(("before", args.before_src, "full-before", title))
            title = f"cProfile of the shipped relay (commit {results['commit']})"
            profiles.append(("", args.ncap_src, "full", title))
            for key, src, name, title in profiles:
                title += f", top {args.top} by own time"
                text, table = profile_run(work, up_port, args, src, name, title)
                results["cprofile_top" + (f"_{key}" if key else "")] = text
                print(f"{title}\n{text}", flush=True)
                if table is not None:
                    results.setdefault("cprofile_tables", []).append(table)
    finally:
        bl.stop_server(up)
        shutil.rmtree(work, ignore_errors=True)
    save(args, results)
    return 0


def save(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The optional raw file, and the envelope when this checkout's relay was measured."""
    profiles = results.pop("cprofile_tables", [])
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    if args.ncap_src != str(bl.ROOT / "src"):
        return  # another tree: a before/after comparison, not this checkout's result
    n, tokens = sb.SCENARIOS[args.scenario]
    cases = list(results["rounds"][0]) if results["rounds"] else []
    rows = [
        [case, *(r.get(case) and round(r[case], 2) for r in results["rounds"])] for case in cases
    ]
    columns = ["case", *(f"round {i + 1} µs/chunk" for i in range(len(results["rounds"])))]
    title = f"CPU per relayed chunk, {args.stores} stores, n={n} × {tokens} tokens"
    notes = f"c={args.concurrency}, {args.requests} streams per case and round."
    if args.before_src:
        notes += (
            f" full-before: `full` served from the sources before the per-read relay"
            f" (commit {results['before_commit']}), in the same run."
        )
    notes += (
        " The machine is shared with other engineers' test runs (the load average is in"
        " the run's facts above): compare the ratios to bare within a round, not the"
        " absolute figures across runs."
    )
    tables = [bl.Table(title, columns, rows, notes=notes), *profiles]
    bl.save_result("stream-profile", tables, raw=results)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        rest = argv.index("--")
        sub = argparse.ArgumentParser()
        sub.add_argument("--case", default="full")
        sub.add_argument("--profile")
        ns = sub.parse_args(argv[1:rest])
        serve_main(ns.case, ns.profile, argv[rest + 1 :])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--scenario", default="n4x250", choices=list(sb.SCENARIOS))
    p.add_argument("--stores", default="default", choices=["default", "memory"])
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--ncap-src", default=sb.NCAP_SRC[0])
    p.add_argument("--before-src", help="another checkout's src measured beside this one")
    p.add_argument("--output", help="also write the raw results here (they are in the envelope)")
    args = p.parse_args(argv)
    unknown = {c.strip() for c in args.cases.split(",") if c.strip()} - {"bare", *CASES}
    if unknown:
        p.error(f"unknown cases: {', '.join(sorted(unknown))} (known: bare, {', '.join(CASES)})")
    sb.NCAP_SRC[0] = args.ncap_src
    return drive(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
