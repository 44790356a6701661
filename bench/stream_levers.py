"""Instructions per chunk of two parts of the streaming relay, in isolation, for this
tree and another (``--before-src``): what a change to one of them saved, free of the
machine's load and of how reads coalesce.

  write-loop        the client write loop over a stream that suspends once per chunk
                    (as on an upstream read), the client write a no-op
  rebase            the fan-out merge's ``_rebase`` of a one-chunk piece, the
                    candidates' evidence hook a no-op
  rebase-evidence   the same with the evidence hook on

Each runs under ``valgrind --tool=callgrind`` twice, with N calls and with 0, the
cyclic GC off (its passes over the imported modules would otherwise land in the
difference); the difference over N is the figure. A tree that predates the write loop
(``http.limits.write_stream``) is driven the way its handler drove it
(``bounded_stream`` and the stall watch's stamps).

    .venv/bin/python bench/stream_levers.py [--before-src DIR] [--levers ...] [--n 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import benchlib as bl

LEVERS = ("write-loop", "rebase", "rebase-evidence")
HEAD = (
    b'{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"fake-model","system_fingerprint":"fp_bench","choices":['
)
EVENT = b"data: " + HEAD + b'{"index":0,"delta":{"content":" w12"},"logprobs":null,'
EVENT += b'"finish_reason":null}]}\n\n'


class _Client:
    async def prepare(self, request: Any) -> None:
        return None

    async def write(self, data: bytes) -> None:
        return None


async def _source(n: int) -> Any:
    for _ in range(n):
        await asyncio.sleep(0)  # a read: the task suspends
        yield EVENT


async def _write_loop(n: int) -> None:
    from ncap.http import limits

    request, client = SimpleNamespace(transport=None), _Client()
    if hasattr(limits, "write_stream"):
        config = SimpleNamespace(max_stream_s=900, stream_write_timeout_s=30)
        await limits.write_stream(request, client, _source(n), config, lambda: None)  # type: ignore[arg-type]
        return
    bounded = limits.bounded_stream(_source(n), 900)  # type: ignore[attr-defined]
    watch = limits.StallWatch(request, 30)  # type: ignore[arg-type]
    first = await anext(bounded, None)
    await watch.write(client.prepare(request))
    if first is not None:
        await watch.write(client.write(first))
    async for chunk in bounded:
        watch.writing_since = watch.now()
        await client.write(chunk)
        watch.writing_since = None
    watch.close()


def _rebase(n: int, total: int, evidence: bool) -> None:
    import msgspec

    from ncap.lifecycle import fanout
    from ncap.lifecycle.attempt_report import Tally
    from ncap.lifecycle.evidence import EvidenceFeed
    from ncap.streaming.sse import EventSplitter

    merged: Any = "chatcmpl-r1"
    if hasattr(fanout, "_spliced"):
        merged = msgspec.json.encode(merged)
    feed: Any = EvidenceFeed() if evidence else SimpleNamespace(chunk=None, piece=None)
    tally = Tally(model="fake-model")
    pieces = [EventSplitter().feed(EVENT) for _ in range(total)]  # the same in both runs
    if len(inspect.signature(fanout._rebase).parameters) == 5:  # a tree that fed per event
        for piece in pieces[:n]:
            fanout._rebase(piece, tally, 2, merged, feed)
        return
    for piece in pieces[:n]:  # the merge feeds what it writes
        out = fanout._rebase(piece, tally, 2, merged)
        if evidence:
            feed.piece(out)


def run(lever: str, n: int, total: int) -> None:
    gc.disable()
    if lever == "write-loop":
        asyncio.run(_write_loop(n))
    else:
        _rebase(n, total, evidence=lever == "rebase-evidence")


def _instructions(src: str, lever: str, n: int, total: int, work: Path) -> int:
    out = work / f"{lever}-{n}-{abs(hash(src))}.out"
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    argv += [str(bl.VENV_PY), str(Path(__file__).resolve()), "run", lever, str(n), str(total)]
    env = {"PYTHONPATH": src, "PYTHONHASHSEED": "0"}  # the same dict layouts in each run
    subprocess.run(argv, env=env, capture_output=True, check=True)
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {out}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "run":
        run(argv[1], int(argv[2]), int(argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--src", default=str(bl.ROOT / "src"))
    p.add_argument("--before-src", default="")
    p.add_argument("--levers", default=",".join(LEVERS))
    p.add_argument("--n", type=int, default=4000)
    p.add_argument("--output", default=str(bl.BENCH / "results" / "stream-levers.json"))
    args = p.parse_args(argv)
    trees = {"after": args.src} | ({"before": args.before_src} if args.before_src else {})
    rows = []
    with tempfile.TemporaryDirectory(prefix="ncap-stream-levers-") as tmp:
        for lever in (x.strip() for x in args.levers.split(",") if x.strip()):
            row: dict[str, Any] = {"lever": lever, "n": args.n}
            for name, src in trees.items():
                full = _instructions(src, lever, args.n, args.n, Path(tmp))
                base = _instructions(src, lever, 0, args.n, Path(tmp))
                row[name] = round((full - base) / args.n)
            print(json.dumps(row), flush=True)
            rows.append(row)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"trees": trees, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
