"""Where an n=1 and an n=8 request spend their time: prefill, decode steps, token draws.

Same request as ``bench/engine_bench.py`` (443-token prompt, 64 new tokens per choice,
temperature 1, prefix cache off). Every ``llama_decode`` and every
``llama_sampler_sample`` call of the engine thread is timed (wall and process CPU, so
ggml's second thread counts), and the script prints medians over ``--repeat`` requests:
the prefill of the prompt, one decode step of batch 1 (n=1) and of batch 8 (n=8), and
the draws of one step. Variants of the llama context (KV cache types, flash attention,
threads) are options, so each can be compared against the shipped configuration.

    PYTHONPATH=src .venv/bin/python bench/engine_steps.py --threads 1 --repeat 5
    PYTHONPATH=src .venv/bin/python bench/engine_steps.py --kv f32 --weights q4_0
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from engine_bench import SEED, SEED_HELP, messages

import ncap.engine.scheduler as scheduler_module
from ncap.engine import Engine, EngineSettings, GenerationParams
from ncap.engine.model import ContextSettings
from ncap.engine.weights import WEIGHTS

KV_TYPES = {"f16": 1, "f32": 0, "q8_0": 8, "bf16": 30}


@dataclass
class Timings:
    """Per-call records of the engine thread: (n_tokens, wall, cpu) of each decode."""

    decodes: list[tuple[int, float, float]] = field(default_factory=list)
    step_draws: list[tuple[int, float]] = field(default_factory=list)  # rows, wall per step
    starts: list[tuple[int, float]] = field(default_factory=list)  # n_tokens, decode start


class TimedLib:
    """The llama_cpp module with llama_decode and llama_sampler_sample timed."""

    def __init__(self, lib: Any, timings: Timings) -> None:
        self._lib = lib
        self._t = timings
        self._pending: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def llama_decode(self, ctx: Any, batch: Any) -> int:
        self.flush()
        w, c = time.perf_counter(), time.process_time()
        rc = int(self._lib.llama_decode(ctx, batch))
        self._t.decodes.append(
            (int(batch.n_tokens), time.perf_counter() - w, time.process_time() - c)
        )
        self._t.starts.append((int(batch.n_tokens), w))
        return rc

    def llama_sampler_sample(self, chain: Any, ctx: Any, row: int) -> int:
        w = time.perf_counter()
        token = int(self._lib.llama_sampler_sample(chain, ctx, row))
        self._pending.append(time.perf_counter() - w)
        return token

    def flush(self) -> None:
        """Close the current step's draws (called before each decode and at the end)."""
        if self._pending:
            self._t.step_draws.append((len(self._pending), sum(self._pending)))
            self._pending = []


def ms(x: float) -> str:
    return f"{x * 1000:.2f}"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", choices=WEIGHTS, default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--threads-batch", type=int, default=0)
    ap.add_argument("--kv", choices=sorted(KV_TYPES), default=None, help="K and V cache type")
    ap.add_argument("--no-fa", action="store_true", help="flash attention off")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--passages", type=int, default=5)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--spin", default=None, help="GOMP_SPINCOUNT for ggml's OpenMP threads")
    ap.add_argument("--only-n", action="store_true", help="skip the n=1 requests (profiling)")
    ap.add_argument("--seed", type=int, default=SEED, help=SEED_HELP)
    args = ap.parse_args()

    overrides: dict[str, Any] = {}
    if args.kv:
        overrides["type_k"] = overrides["type_v"] = KV_TYPES[args.kv]
    if args.threads_batch:
        overrides["threads_batch"] = args.threads_batch
    if args.no_fa:
        overrides["flash_attn"] = False

    def context_settings(*a: Any, **kw: Any) -> ContextSettings:
        return replace(ContextSettings(*a, **kw), **overrides)

    scheduler_module.ContextSettings = context_settings  # type: ignore[assignment,misc]

    if args.spin is not None:
        os.environ["GOMP_SPINCOUNT"] = args.spin  # read when libgomp loads, with llama_cpp
    load = os.getloadavg()
    settings = EngineSettings(
        n_ctx=4096, max_sequences=16, threads=args.threads, weights=args.weights
    )
    engine = await asyncio.to_thread(Engine.load, settings)
    timings = Timings()
    lib = TimedLib(engine.model.lib, timings)
    engine._scheduler._lib = lib  # the scheduler thread reads it on every call
    msgs = tuple(messages(args.passages))

    def params(n: int, seed: int) -> GenerationParams:
        return GenerationParams(messages=msgs, n=n, max_tokens=args.tokens, seed=seed)

    await engine.run(params(1, 0))  # warm-up
    variants = [] if args.only_n else [("1", 1)]
    variants.append((str(args.n), args.n))
    results: dict[str, dict[str, list[float]]] = {v[0]: defaultdict(list) for v in variants}
    try:
        for _ in range(args.repeat):
            for label, n in variants:
                timings.decodes.clear()
                timings.step_draws.clear()
                timings.starts.clear()
                w, c = time.perf_counter(), time.process_time()
                done = await engine.run(params(n, args.seed))
                wall, cpu = time.perf_counter() - w, time.process_time() - c
                lib.flush()
                r = results[label]
                r["wall"].append(wall)
                r["cpu"].append(cpu)
                r["tokens"].append(done.completion_tokens)
                prefill = [d for d in timings.decodes if d[0] > args.n]
                steps = [d for d in timings.decodes if d[0] == n]
                r["prefill_wall"].append(sum(d[1] for d in prefill))
                r["prefill_cpu"].append(sum(d[2] for d in prefill))
                r["step_wall"].append(statistics.median(d[1] for d in steps))
                r["step_cpu"].append(statistics.median(d[2] for d in steps))
                full = [d for rows, d in timings.step_draws if rows == n]
                r["draws"].append(statistics.median(full) if full else 0.0)
                gaps = [
                    b[1] - a[1]
                    for a, b in zip(timings.starts, timings.starts[1:], strict=False)
                    if a[0] == b[0] == n
                ]
                r["interval"].append(statistics.median(gaps))
    finally:
        engine.close()

    med = statistics.median
    print(
        f"weights {args.weights} ({engine.model_file.name}); threads {args.threads}"
        f"/{args.threads_batch or args.threads}; kv {args.kv or 'f16'}; fa {not args.no_fa}; "
        f"spin {args.spin}; "
        f"median of {args.repeat}; load {' '.join(f'{x:.2f}' for x in load)} → "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        "| n | wall (s) | CPU (s) | prefill wall / CPU (s) | step wall / CPU (ms) "
        "| draws/step (ms) | decode-to-decode (ms) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, r in results.items():
        if not r:
            continue
        print(
            f"| {n} | {med(r['wall']):.3f} | {med(r['cpu']):.3f} | "
            f"{med(r['prefill_wall']):.3f} / {med(r['prefill_cpu']):.3f} | "
            f"{ms(med(r['step_wall']))} / {ms(med(r['step_cpu']))} | {ms(med(r['draws']))} "
            f"| {ms(med(r['interval']))} |"
        )
    if args.only_n:
        return
    one, many = results["1"], results[str(args.n)]
    print(
        f"n={args.n}/n=1 wall {med(many['wall']) / med(one['wall']):.3f}, "
        f"CPU {med(many['cpu']) / med(one['cpu']):.3f}; tokens {many['tokens']}"
    )


if __name__ == "__main__":
    asyncio.run(main())
