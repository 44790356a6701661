"""Forced and ``auto`` tool calls on the local engine: the full seeded sweep.

200 requests (seeds 0-199), n=5 each, through the gateway with the official SDK, on
the embedded default's local route: ``tool_choice`` named / ``required`` / ``auto``,
temperature 1 and 1.5, ``max_tokens`` 16, 64 and 256, ``parallel_tool_calls`` true and
false, in the combinations ``tests/engine/tool_checks.request`` cycles through. Every
choice is checked (``check_choice``): a forced choice is a call (``tool_calls``) or a
call cut by the token limit (``length`` with the partial call), every whole call's
arguments parse and validate against its tool's JSON schema (``jsonschema``), and
``parallel_tool_calls: false`` gives exactly one call. Exits 1 on any breach.

    .venv/bin/python bench/engine_tools_bench.py [--seeds 200] [--concurrency 4] [--shards 1]

``--shards k`` runs k gateways in separate processes, each on a contiguous slice of the
seeds, and sums their tallies: on a machine shared with other work, each process gets
its own share of the CPU. A seed's request is the same whichever shard runs it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import benchlib as bl  # noqa: E402
import openai  # noqa: E402

from ncap.config import Stores, Workload, default_config  # noqa: E402
from tests.engine.tool_checks import Tally, request  # noqa: E402
from tests.support import gateway  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=200, help="how many seeds, one request each")
    ap.add_argument("--first", type=int, default=0, help="the first seed")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shards", type=int, default=1, help="processes sharing the seeds")
    ap.add_argument("--out", type=Path, help="write the summary as JSON here too")
    # a shard of a sharded run: its summary goes to --out for the parent, no result
    ap.add_argument("--shard", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.shards > 1:
        summary = sharded(args)
    else:
        tally, wall = run(args.first, args.seeds, args.concurrency, args.threads)
        summary = summarize(tally, wall)
    report(summary, args.out)
    if not args.shard:
        bl.save_result("engine-tools", [table(summary)], raw=summary)
    return 1 if summary["breaches"] else 0


def run(first: int, seeds: int, concurrency: int, threads: int) -> tuple[Tally, float]:
    with tempfile.TemporaryDirectory() as tmp:
        base = default_config()
        route = base.routes["local-smollm2"].model_copy(
            update={"threads": threads, "max_sequences": 5 * concurrency}
        )
        config = base.model_copy(
            update={
                "stores": Stores(
                    ledger=f"sqlite:///{tmp}/ledger.db", budgets=f"sqlite:///{tmp}/budgets.db"
                ),
                "workloads": {"default": Workload(max_candidates=8)},
                "routes": {"local-smollm2": route},
            }
        )
        with gateway(config) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=7200)
            return sweep(client, range(first, first + seeds), concurrency)


def sharded(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.shards`` processes on contiguous slices of the seeds; sum their tallies."""
    began = time.monotonic()
    size = -(-args.seeds // args.shards)
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for k in range(args.shards):
            first = args.first + k * size
            count = min(size, args.first + args.seeds - first)
            if count <= 0:
                break
            cmd = [sys.executable, __file__, "--first", str(first), "--seeds", str(count)]
            cmd += ["--concurrency", str(args.concurrency), "--threads", str(args.threads)]
            cmd += ["--out", f"{tmp}/shard-{k}.json", "--shard"]
            procs.append((subprocess.Popen(cmd), Path(f"{tmp}/shard-{k}.json")))
        parts = []
        for proc, out in procs:
            proc.wait()
            parts.append(json.loads(out.read_text()))
    return merge(parts, time.monotonic() - began)


def merge(parts: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    total: dict[str, Any] = {"by_tool_choice": {}, "finish_reasons": {}, "failures": []}
    for part in parts:
        for key in _COUNTS:
            total[key] = total.get(key, 0) + part[key]
        for kind, counts in part["by_tool_choice"].items():
            mine = total["by_tool_choice"].setdefault(kind, {})
            for outcome, n in counts.items():
                mine[outcome] = mine.get(outcome, 0) + n
        for reason, n in part["finish_reasons"].items():
            total["finish_reasons"][reason] = total["finish_reasons"].get(reason, 0) + n
        total["failures"] += part["failures"]
    total["wall_s"] = round(wall, 1)
    return total


_COUNTS = (
    "requests",
    "choices",
    "whole_calls_validated",
    "single_call_choices_with_parallel_false",
    "breaches",
)


def sweep(client: openai.OpenAI, seeds: range, concurrency: int) -> tuple[Tally, float]:
    tally = Tally()
    bodies = [request(s) for s in seeds]
    began = time.monotonic()

    def one(body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        return body, client.chat.completions.create(**body)

    with ThreadPoolExecutor(concurrency) as pool:
        for done, (body, completion) in enumerate(pool.map(one, bodies), 1):
            seen = (sum(tally.choices.values()), len(tally.failures))
            tally.add(body, completion)
            # one line a request, so that a run cut short still says what it saw
            print(
                f"seed {body['seed']}: {sum(tally.choices.values()) - seen[0]} choices as "
                f"required, {len(tally.failures) - seen[1]} breaches",
                flush=True,
            )
            if done % 10 == 0:
                print(
                    f"seeds {seeds.start}-{seeds.stop - 1}: {done}/{len(bodies)} requests, "
                    f"{time.monotonic() - began:.0f} s",
                    flush=True,
                )
    return tally, time.monotonic() - began


def summarize(tally: Tally, wall: float) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, outcome), count in sorted(tally.choices.items()):
        by_kind.setdefault(kind, {})[outcome] = count
    return {
        "requests": tally.requests,
        "choices": sum(tally.choices.values()) + len(tally.failures),
        "by_tool_choice": by_kind,
        "finish_reasons": dict(tally.finish),
        "whole_calls_validated": tally.calls_validated,
        "single_call_choices_with_parallel_false": tally.single_call_choices,
        "breaches": len(tally.failures),
        "failures": tally.failures,
        "wall_s": round(wall, 1),
    }


def table(summary: dict[str, Any]) -> bl.Table:
    """Choices by tool_choice and outcome; the totals and breaches in the notes."""
    rows = [
        [kind, *(counts.get(k, 0) for k in ("call", "partial", "prose"))]
        for kind, counts in summary["by_tool_choice"].items()
    ]
    notes = (
        f"{summary['requests']} requests, {summary['choices']} choices, "
        f"{summary['whole_calls_validated']} whole calls validated against their schema, "
        f"{summary['breaches']} breaches, {summary['wall_s']} s."
    )
    columns = ["tool_choice", "call", "partial (length)", "prose"]
    return bl.Table("Choices by tool_choice", columns, rows, notes=notes)


def report(summary: dict[str, Any], out: Path | None) -> None:
    print("| tool_choice | call | partial (length) | prose |")
    print("| --- | --- | --- | --- |")
    for kind, counts in summary["by_tool_choice"].items():
        row = [counts.get(k, 0) for k in ("call", "partial", "prose")]
        print(f"| {kind} | {row[0]} | {row[1]} | {row[2]} |")
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=2))
    for failure in summary["failures"][:20]:
        print("BREACH", failure)
    if out is not None:
        out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
