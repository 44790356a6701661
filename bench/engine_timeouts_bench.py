"""The local engine's timeouts on a busy machine.

Two CPU burners (busy loops, one per core of a two-core machine) run beside the
gateway throughout.

1. Twenty n=4 requests at once (a prompt of about 400 tokens, ``max_tokens`` 64) through
   the embedded default (``default_config()``: its local route sets no ``timeout_s``, so
   each attempt's budget comes from its size and the engine's measured speed, charged
   from admission). Every one must answer 200; the ledger rows must all be settled.
2. A route with ``timeout_s: 60`` (``--timeout-s``) and four sequences: request A
   (n=4, 1,000 tokens, no end token) times out; request B (n=4, streamed), sent while A
   holds every sequence, must be admitted as soon as A is cancelled: its first chunk
   arrives right after A's 504, and A's ledger row is settled with finish reason
   ``cancelled``.

    .venv/bin/python bench/engine_timeouts_bench.py [--requests 20] [--burners 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import benchlib as bl  # noqa: E402
import openai  # noqa: E402

from ncap.config import Config, Stores, default_config  # noqa: E402
from tests.http.test_accounting import rows, settled_rows  # noqa: E402
from tests.support import gateway  # noqa: E402

PASSAGE = (
    "The harbour town wakes before dawn. Fishing boats slip their moorings one by one, "
    "their engines coughing in the cold air, while gulls circle the market hall where "
    "the first crates of ice are already stacked. By seven the bakers have opened, the "
    "ferry to the islands has sounded its horn twice, and the school bus is waiting at "
    "the square with its doors open and its heater running. "
)
PROMPT = [{"role": "user", "content": PASSAGE * 6 + "\nSummarise the passage."}]
NO_END = {"0": -100, "2": -100}


def with_stores(config: Config, tmp: str, **route: Any) -> Config:
    base = config.routes["local-smollm2"]
    return config.model_copy(
        update={
            "stores": Stores(
                ledger=f"sqlite:///{tmp}/ledger.db", budgets=f"sqlite:///{tmp}/budgets.db"
            ),
            "routes": {"local-smollm2": base.model_copy(update=route) if route else base},
        }
    )


def loaded(count: int, tmp: str) -> dict[str, Any]:
    """Part 1: ``count`` n=4 requests at once through the embedded default."""
    config = with_stores(default_config(), tmp)
    with gateway(config) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=3600)
        client.chat.completions.create(model="smollm2", messages=PROMPT, max_tokens=1)  # load

        def one(seed: int) -> tuple[int, float, int]:
            began = time.monotonic()
            raw = client.with_options(max_retries=0).chat.completions.with_raw_response
            try:
                answer = raw.create(model="smollm2", messages=PROMPT, n=4, max_tokens=64, seed=seed)
                status, choices = answer.http_response.status_code, len(answer.parse().choices)
            except openai.APIStatusError as exc:
                status, choices = exc.status_code, 0
            return status, time.monotonic() - began, choices

        began = time.monotonic()
        with ThreadPoolExecutor(count) as pool:
            results = list(pool.map(one, range(count)))
        wall = time.monotonic() - began
        ledger = asyncio.run(rows(Path(tmp)))
    statuses = [s for s, _, _ in results]
    return {
        "requests": count,
        "status_200": statuses.count(200),
        "statuses": sorted(set(statuses)),
        "choices": sum(c for _, _, c in results),
        "latency_s_max": round(max(t for _, t, _ in results), 1),
        "latency_s_min": round(min(t for _, t, _ in results), 1),
        "wall_s": round(wall, 1),
        "ledger_states": sorted({r.state for r in ledger}),
    }


def warm(client: openai.OpenAI, tries: int = 3) -> None:
    """Load the model and fill the prefix cache with the prompt. Under the burners the
    first request (model load and a cold prefill) may outlast this route's timeout; the
    next ones find the model loaded and the prompt cached."""
    for attempt in range(tries):
        try:
            client.chat.completions.create(model="smollm2", messages=PROMPT, max_tokens=1)
            return
        except openai.InternalServerError:
            if attempt == tries - 1:
                raise


def timed_out(tmp: str, timeout_s: float) -> dict[str, Any]:
    """Part 2: a timed-out request frees its sequences for the queued one at once."""
    config = with_stores(
        default_config(), tmp, timeout_s=timeout_s, retries=0, max_sequences=4, n_ctx=2048
    )
    marks: dict[str, float] = {}
    with gateway(config) as server:
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0
        )
        warm(client)
        request_id: list[str] = []

        def first() -> None:
            try:
                client.chat.completions.create(
                    model="smollm2", messages=PROMPT, n=4, max_tokens=1000, logit_bias=NO_END
                )
            except openai.APIStatusError as exc:
                marks["a_status"] = exc.status_code
                request_id.append(exc.response.headers["x-request-id"])
            marks["a_failed"] = time.monotonic()

        a = threading.Thread(target=first)
        a.start()
        time.sleep(1.0)  # A holds all four sequences by now
        marks["b_sent"] = time.monotonic()
        stream = client.chat.completions.create(
            model="smollm2", messages=PROMPT, n=4, max_tokens=4, seed=1, stream=True
        )
        try:
            for _chunk in stream:
                marks.setdefault("b_first", time.monotonic())
            marks["b_done"] = time.monotonic()
        except openai.APIError:  # B's own time limit may run out on a loaded machine
            marks["b_cut"] = time.monotonic()
        a.join()
        (row,) = asyncio.run(settled_rows(Path(tmp), request_id[0]))
    return {
        "a_status": marks.get("a_status"),
        "b_first_chunk_after_a_failed_s": round(marks["b_first"] - marks["a_failed"], 3),
        "b_waited_s": round(marks["b_first"] - marks["b_sent"], 2),
        "b_completed": "b_done" in marks,
        "a_row": {
            "state": row.state,
            "finish_reasons": row.finish_reasons,
            "input_tokens": row.input_tokens,
            "output_tokens_total": row.output_tokens_total,
            "reconciliation_reason": row.reconciliation_reason,
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--burners", type=int, default=2)
    ap.add_argument(
        "--timeout-s",
        type=float,
        default=60,
        help="part 2's route timeout: long enough for a cold 400-token prefill beside the burners",
    )
    ap.add_argument("--parts", default="loaded,timeout", help="which parts to run")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)
    ]
    try:
        with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as two:
            result: dict[str, Any] = {"burners": args.burners}
            if "loaded" in parts:
                result["loaded"] = loaded(args.requests, one)
                print(json.dumps(result, indent=2), flush=True)
            if "timeout" in parts:
                result["timeout"] = timed_out(two, args.timeout_s)
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()
    print(json.dumps(result, indent=2))
    ok = all(
        [
            "loaded" not in result or result["loaded"]["status_200"] == args.requests,
            "timeout" not in result or result["timeout"]["a_status"] == 504,
        ]
    )
    burners = f"{args.burners} CPU burners running"
    tables = []
    if "loaded" in result:
        title = f"{args.requests} n=4 requests at once, {burners}"
        tables.append(bl.flat_table(title, result["loaded"]))
    if "timeout" in result:
        title = f"A request that times out ({args.timeout_s:g} s), then the next one, {burners}"
        tables.append(bl.flat_table(title, result["timeout"]))
    bl.save_result("engine-timeouts", tables, raw=result)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
