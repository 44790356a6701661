"""Forced and ``auto`` tool calls on the local engine: the full seeded sweep.

200 requests (seeds 0-199), n=5 each, through the gateway with the official SDK, on
the embedded default's local route: ``tool_choice`` named / ``required`` / ``auto``,
temperature 1 and 1.5, ``max_tokens`` 16, 64 and 256, ``parallel_tool_calls`` true and
false, in the combinations ``tests/engine/tool_checks.request`` cycles through. Every
choice is checked (``check_choice``): a forced choice is a call (``tool_calls``) or a
call cut by the token limit (``length`` with the partial call), every whole call's
arguments parse and validate against its tool's JSON schema (``jsonschema``), and
``parallel_tool_calls: false`` gives exactly one call. Exits 1 on any breach.

    .venv/bin/python bench/engine_tools_bench.py [--seeds 200] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from ncap.config import Stores, Workload, default_config  # noqa: E402
from tests.engine.tool_checks import Tally, request  # noqa: E402
from tests.support import gateway  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=200, help="seeds 0 .. N-1, one request each")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="write the tally as JSON here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = default_config()
        route = base.routes["local-smollm2"].model_copy(
            update={"threads": args.threads, "max_sequences": 5 * args.concurrency}
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
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=3600)
            tally, wall = sweep(client, args.seeds, args.concurrency)
    report(tally, wall, args.out)
    return 1 if tally.failures else 0


def sweep(client: openai.OpenAI, seeds: int, concurrency: int) -> tuple[Tally, float]:
    tally = Tally()
    bodies = [request(s) for s in range(seeds)]
    began = time.monotonic()

    def one(body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        return body, client.chat.completions.create(**body)

    with ThreadPoolExecutor(concurrency) as pool:
        for done, (body, completion) in enumerate(pool.map(one, bodies), 1):
            tally.add(body, completion)
            if done % 20 == 0:
                print(f"{done}/{seeds} requests, {time.monotonic() - began:.0f} s", flush=True)
    return tally, time.monotonic() - began


def report(tally: Tally, wall: float, out: Path | None) -> None:
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, outcome), count in sorted(tally.choices.items()):
        by_kind.setdefault(kind, {})[outcome] = count
    summary = {
        "requests": tally.requests,
        "choices": sum(tally.choices.values()) + len(tally.failures),
        "by_tool_choice": by_kind,
        "finish_reasons": dict(tally.finish),
        "whole_calls_validated": tally.calls_validated,
        "single_call_choices_with_parallel_false": tally.single_call_choices,
        "breaches": len(tally.failures),
        "wall_s": round(wall, 1),
    }
    print("| tool_choice | call | partial (length) | prose |")
    print("| --- | --- | --- | --- |")
    for kind, counts in by_kind.items():
        row = [counts.get(k, 0) for k in ("call", "partial", "prose")]
        print(f"| {kind} | {row[0]} | {row[1]} | {row[2]} |")
    print(json.dumps(summary, indent=2))
    for failure in tally.failures[:20]:
        print("BREACH", failure)
    if out is not None:
        out.write_text(json.dumps({**summary, "failures": tally.failures}, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
