"""Streamed answers through each gateway, side by side in one run: CPU per relayed chunk
(from the gateway process tree's own counters, /proc/PID/stat) and time to first byte.

One minimal streaming upstream (``upstream`` below: OpenAI-shaped chunks of one token
each, the n choices interleaved, then a usage chunk and ``[DONE]``, every chunk its own
write, as fast as it can after a 2 ms pause between the role chunks and the first
token) serves every target:

  direct        the upstream itself (the base of "added" time to first byte)
  bare          an aiohttp pass-through that copies the upstream's bytes as they come
  ncap-memory   ncap serve, both stores in memory
  ncap          ncap serve as shipped (default stores), native route
  ncap-no-evidence  the same with the candidates' evidence hook made a no-op in the
                served process (as ``evidence_bench.py --e2e`` does; never in the
                product): ncap's CPU per chunk over this one's is what the evidence
                costs (``evidence_overhead`` in the JSON; n=1 streams have none)
  ncap-fanout   the same ncap process, an emulated route: n single-candidate branches
                merged (n=4 scenarios only)
  litellm       LiteLLM proxy, 1 worker (scripts/setup-litellm.sh)
  portkey       Portkey's gateway (scripts/setup-portkey.sh)

Scenarios: ``n1x500`` (one choice of 500 chunks) and ``n4x250`` (four choices of 250,
interleaved: 1,000 chunks); ``n1x1`` (one chunk: what a streamed request costs besides
its chunks) on demand. ``--compare-src DIR`` also serves another tree's sources as
``ncap-before`` and ``ncap-fanout-before``, in the same run. For each round, scenario
and target: CPU per chunk at ``--cpu-concurrency`` over ``--requests`` streams, and
TTFB p50 at c=1 and c=16. The
client does not ask for usage: ncap strips the usage chunk it asked for on its own
behalf; the pass-throughs relay it. A target that fails is reported with its error.

    .venv/bin/python bench/stream_bench.py [--targets ...] [--rounds 3]
        [--scenarios n1x500,n4x250] [--output bench/results/stream.json]

Subcommands used by the driver itself: ``upstream``, ``bare``, ``load``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import benchlib as bl

SCENARIOS = {"n1x500": (1, 500), "n4x250": (4, 250), "n1x1": (1, 1)}
DEFAULT_SCENARIOS = "n1x500,n4x250"  # n1x1: one chunk, the request path's own cost
TARGETS = (
    "direct",
    "bare",
    "ncap-memory",
    "ncap",
    "ncap-no-evidence",
    "ncap-fanout",
    "litellm",
    "portkey",
)
# the evidence hook as a no-op in the served process only: the stream is relayed as with it
EVIDENCE_OFF = (
    "import ncap.lifecycle.evidence as e; "
    "e.EvidenceFeed.piece = lambda *a, **k: None; "
    "import ncap.streaming.sse as s; s.EventSplitter.read_candidates = lambda self: None; "
)
LITELLM_BIN = bl.ROOT / ".venv-litellm" / "bin" / "litellm"
PORTKEY_DIR = bl.BENCH / "portkey"
PORTKEY_BIN = PORTKEY_DIR / "node_modules" / ".bin" / "gateway"
MESSAGES = [{"role": "user", "content": "Count to five hundred, one word per token."}]
FIRST_TOKEN_MS = 2.0  # the upstream's pause between its role chunks and its first token


# -- the upstream -------------------------------------------------------------------


def _chunks(model: str, n: int, tokens: int) -> list[bytes]:
    head = b'{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    head += b'"model":"' + model.encode() + b'","system_fingerprint":"fp_bench","choices":['
    out = []
    for i in range(n):
        delta = b'{"role":"assistant","content":""}'
        out.append(_choice(head, i, delta, b"null"))
    for t in range(tokens):
        for i in range(n):
            delta = b'{"content":" w' + str(t).encode() + b'"}'
            out.append(_choice(head, i, delta, b'"length"' if t == tokens - 1 else b"null"))
    usage = b'{"prompt_tokens":20,"completion_tokens":%d,"total_tokens":%d}' % (
        n * tokens,
        20 + n * tokens,
    )
    out.append(b"data: " + head + b'],"usage":' + usage + b"}\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def _choice(head: bytes, index: int, delta: bytes, finish: bytes) -> bytes:
    choice = b'{"index":%d,"delta":%s,"logprobs":null,"finish_reason":%s}' % (index, delta, finish)
    return b"data: " + head + choice + b"]}\n\n"


def upstream_main(port: int, pace_ms: float = 0.0, first_token_ms: float = FIRST_TOKEN_MS) -> None:
    """A streaming upstream: ``n`` choices of ``max_tokens`` (or
    ``max_completion_tokens``) one-token chunks, interleaved; usage always sent;
    ``pace_ms`` between writes (0: as fast as it can). ``first_token_ms`` after the
    role chunks, as a model pauses before its first token: without it the first chunk
    left while the upstream wrote the other thousand, and time to first byte at c=1
    measured three processes (upstream, gateway, client) sharing two cores."""
    import uvloop
    from aiohttp import web

    cache: dict[tuple[str, int, int], list[bytes]] = {}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("n") or 1)
        tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        model = str(body.get("model") or "fake-model")
        if not body.get("stream"):
            text = {"role": "assistant", "content": "w" * tokens}
            choices = [{"index": i, "message": text, "finish_reason": "length"} for i in range(n)]
            usage = {"prompt_tokens": 20, "completion_tokens": n * tokens}
            usage["total_tokens"] = 20 + n * tokens
            answer = {"id": "chatcmpl-bench", "object": "chat.completion", "created": 1}
            answer.update(model=model, choices=choices, usage=usage)
            return web.json_response(answer)
        key = (model, n, tokens)
        chunks = cache.get(key) or cache.setdefault(key, _chunks(model, n, tokens))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for number, chunk in enumerate(chunks, 1):
            await resp.write(chunk)
            if number == n and first_token_ms:
                await asyncio.sleep(first_token_ms / 1000)
            elif pace_ms:
                await asyncio.sleep(pace_ms / 1000)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# -- the bare streaming pass-through -------------------------------------------------


def bare_main(port: int, upstream: str) -> None:
    """Forward the body unchanged; copy the upstream's bytes to the client as they come."""
    import aiohttp
    import uvloop
    from aiohttp import web

    state: dict[str, aiohttp.ClientSession] = {}

    async def chat(request: web.Request) -> web.StreamResponse:
        session = state.get("s")
        if session is None:
            connector = aiohttp.TCPConnector(limit=1024)
            session = state["s"] = aiohttp.ClientSession(connector=connector)
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        async with session.post(upstream, data=body, headers=headers) as up:
            ctype = up.headers.get("Content-Type", "application/json")
            out = web.StreamResponse(status=up.status, headers={"Content-Type": ctype})
            await out.prepare(request)
            async for data in up.content.iter_any():
                await out.write(data)
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# -- the load generator ----------------------------------------------------------------


def load_main(args: argparse.Namespace) -> None:
    """``requests`` streams at concurrency ``c``; each read to its end; JSON out."""
    import aiohttp
    import uvloop

    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {args.api_key}"}
    for header in args.header or []:
        name, _, value = header.partition(":")
        headers[name.strip()] = value.strip()
    body = args.body.encode()
    ttfbs: list[float] = []
    errors: dict[str, int] = {}
    sizes: list[int] = []
    reads = [0]  # the client's reads: writes of the target that did not coalesce

    async def one(session: aiohttp.ClientSession) -> None:
        t0 = time.perf_counter()
        try:
            async with session.post(args.url, data=body, headers=headers) as resp:
                first = True
                got = bytearray()
                async for data in resp.content.iter_any():
                    if first:
                        ttfbs.append(time.perf_counter() - t0)
                        first = False
                    got += data
                    reads[0] += 1
                if resp.status != 200 or not got.rstrip().endswith(b"data: [DONE]"):
                    kind = f"status {resp.status}: {bytes(got[-300:])!r}"
                    errors[kind] = errors.get(kind, 0) + 1
                else:
                    sizes.append(len(got))
        except Exception as exc:
            kind = type(exc).__name__
            errors[kind] = errors.get(kind, 0) + 1

    async def main() -> None:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            left = args.requests

            async def worker() -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    await one(session)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.c)))
            wall = time.perf_counter() - t0
        ttfbs.sort()
        out = {
            "requests": args.requests,
            "ok": len(sizes),
            "errors": errors,
            "wall_s": wall,
            "ttfb_p50_ms": 1000 * statistics.median(ttfbs) if ttfbs else None,
            "ttfb_p90_ms": 1000 * ttfbs[int(0.9 * (len(ttfbs) - 1))] if ttfbs else None,
            "bytes_per_stream": statistics.median(sizes) if sizes else None,
            "reads": reads[0],
        }
        print(json.dumps(out))

    uvloop.install()
    asyncio.run(main())


# -- the driver ----------------------------------------------------------------------


@dataclass
class Target:
    name: str
    url: str
    server: bl.Server | None
    model: str = "fake-model"
    api_key: str = "bench"
    headers: dict[str, str] = field(default_factory=dict)
    note: str = ""


NCAP_CONFIG = """\
# Generated by bench/stream_bench.py: {stores}.
{stores_block}workloads:
  default:
    max_candidates: 4
    max_concurrency: null
    output_ceiling: 1000
models:
  fake-model: [fake]
  fake-fanout: [fanout]
routes:
  fake:
    provider: openai
    base_url: http://127.0.0.1:{port}/v1
    upstream_model: fake-model
    api_key_env: NCAP_BENCH_UPSTREAM_KEY
    pricing: {{input_per_mtok: 0.15, output_per_mtok: 0.6}}
    contract: {{candidates: native, max_candidates: 4, output_cap: per_candidate,
                stream_usage: include_usage}}
  fanout:
    provider: openai
    base_url: http://127.0.0.1:{port}/v1
    upstream_model: fake-model
    api_key_env: NCAP_BENCH_UPSTREAM_KEY
    pricing: {{input_per_mtok: 0.15, output_per_mtok: 0.6}}
    contract: {{candidates: emulate, max_candidates: 4, output_cap: per_candidate,
                stream_usage: include_usage}}
"""
MEMORY_STORES = "stores:\n  ledger: memory://\n  budgets: memory://\n"


def _py(*args: str) -> list[str]:
    return [str(bl.VENV_PY), *args]


def _sub(kind: str, *args: str) -> list[str]:
    return _py(str(Path(__file__).resolve()), kind, *args)


def start_upstream(work: Path) -> tuple[bl.Server, int]:
    port = bl.free_port()
    server = bl.start_server("upstream", _sub("upstream", "--port", str(port)), work)
    _wait_port(server, port)
    return server, port


def _wait_port(server: bl.Server, port: int, timeout_s: float = 60) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited:\n{server.tail()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{server.name} not listening on {port}")


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}/v1/chat/completions"


NCAP_SRC = [str(bl.ROOT / "src")]
COMPARE_SRC = [""]  # --compare-src: another tree served as ncap-before, ncap-fanout-before


def ncap_target(work: Path, up_port: int, name: str, src: str | None = None) -> Target:
    """``ncap serve`` from this tree's sources (or ``src``: ``--compare-src``)."""
    home = work / name
    home.mkdir(exist_ok=True)
    memory = name == "ncap-memory"
    evidence = name != "ncap-no-evidence"
    config = NCAP_CONFIG.format(
        port=up_port,
        stores="memory stores" if memory else "the shipped default stores",
        stores_block=MEMORY_STORES if memory else "",
    )
    (home / "ncap.yaml").write_text(config)
    port = bl.free_port()
    serve = "from ncap.cli.main import main; main()"
    argv = _py("-c", serve if evidence else EVIDENCE_OFF + serve)
    argv += ["serve", "--config", str(home / "ncap.yaml")]
    env = {"NCAP_BENCH_UPSTREAM_KEY": "dummy", "PYTHONPATH": src or NCAP_SRC[0]}
    server = bl.start_server(name, [*argv, "--port", str(port)], work, env=env, cwd=home)
    _wait_port(server, port)
    note = "memory stores" if memory else "shipped default"
    note += "" if evidence else ", evidence hook a no-op"
    return Target(name, _url(port), server, note=note + (f", sources {src}" if src else ""))


def bare_target(work: Path, up_port: int) -> Target:
    port = bl.free_port()
    argv = _sub("bare", "--port", str(port), "--upstream", _url(up_port))
    server = bl.start_server("bare", argv, work)
    _wait_port(server, port)
    return Target("bare", _url(port), server, note="aiohttp, bytes copied as they come")


def litellm_target(work: Path, up_port: int) -> Target | str:
    if not LITELLM_BIN.exists():
        return "not installed (scripts/setup-litellm.sh)"
    port, key = bl.free_port(), "sk-" + secrets.token_hex(32)
    argv = [str(LITELLM_BIN), "--config", str(bl.BENCH / "litellm_config.yaml")]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    import gateway_bench as gb

    env = dict(gb.LITELLM_ENV, LITELLM_MASTER_KEY=key)
    env["NCAP_BENCH_UPSTREAM_BASE"] = f"http://127.0.0.1:{up_port}/v1"
    server = bl.start_server("litellm", argv, work, env=env)
    try:
        _wait_port(server, port, timeout_s=120)
    except RuntimeError as exc:
        return f"did not start: {str(exc)[-300:]}"
    return Target("litellm", _url(port), server, api_key=key, note="1 worker")


def portkey_target(work: Path, up_port: int) -> Target | str:
    if not PORTKEY_BIN.exists():
        return "not installed (scripts/setup-portkey.sh)"
    port = bl.free_port()
    argv = [str(PORTKEY_BIN), f"--port={port}", "--headless"]
    server = bl.start_server("portkey", argv, work, cwd=PORTKEY_DIR)
    try:
        _wait_port(server, port, timeout_s=60)
    except RuntimeError as exc:
        return f"did not start: {str(exc)[-300:]}"
    headers = {
        "x-portkey-provider": "openai",
        "x-portkey-custom-host": f"http://127.0.0.1:{up_port}/v1",
    }
    return Target("portkey", _url(port), server, api_key="dummy", headers=headers)


def run_load(target: Target, n: int, tokens: int, c: int, requests: int) -> dict[str, Any]:
    body = {"model": target.model, "messages": MESSAGES, "stream": True, "n": n}
    body["max_tokens"] = tokens
    argv = _sub("load", target.url, "-c", str(c), "--requests", str(requests))
    argv += ["--api-key", target.api_key, "--body", json.dumps(body)]
    for name, value in target.headers.items():
        argv += ["--header", f"{name}: {value}"]
    out = subprocess.run(argv, capture_output=True, timeout=900, check=False)
    if out.returncode != 0 or not out.stdout:
        raise RuntimeError(f"load failed: {out.stderr.decode(errors='replace')[-1500:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


PEERS = ("litellm", "portkey")


def measure(target: Target, scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    n, tokens = SCENARIOS[scenario]
    row: dict[str, Any] = {"target": target.name, "scenario": scenario, "note": target.note}
    peer = target.name in PEERS  # fewer streams: a peer may be 100x slower per chunk
    requests = args.peer_requests if peer else args.requests
    ttfb_counts = (
        ((1, args.peer_requests // 2), (16, args.peer_requests))
        if peer
        else ((1, args.ttfb_requests), (16, 2 * args.ttfb_requests))
    )
    run_load(target, n, tokens, 4, args.warmup)
    if target.server is not None and target.name != "direct":
        with bl.measured(target.server.pid) as cpu:
            res = run_load(target, n, tokens, args.cpu_concurrency, requests)
        chunks = res["ok"] * n * tokens
        row.update(
            cpu_s=round(cpu["cpu_s"], 3),
            foreign_share=round(cpu["foreign_share"], 3),
            cpu_us_per_chunk=round(1e6 * cpu["cpu_s"] / chunks, 3) if chunks else None,
            errors=res["errors"],
            ok=res["ok"],
        )
        if res["errors"]:
            row["error"] = next(iter(res["errors"]))
    for c, count in ttfb_counts:
        res = run_load(target, n, tokens, c, count)
        row[f"ttfb_p50_ms_c{c}"] = round(res["ttfb_p50_ms"], 3) if res["ttfb_p50_ms"] else None
        if res["errors"]:
            row.setdefault("error", next(iter(res["errors"])))
    print(_progress(row), file=sys.stderr, flush=True)
    return row


def _progress(row: dict[str, Any]) -> str:
    return (
        f"  {row['scenario']} {row['target']:<12} cpu/chunk={row.get('cpu_us_per_chunk')} us "
        f"ttfb c1={row.get('ttfb_p50_ms_c1')} c16={row.get('ttfb_p50_ms_c16')} ms "
        f"foreign={row.get('foreign_share')} {row.get('error', '')}"
    )


def derive(rows: list[dict[str, Any]]) -> None:
    """× bare (CPU per chunk), added TTFB (minus direct's) and, for ``ncap``, what the
    evidence hook costs (its CPU per chunk over ``ncap-no-evidence``'s, minus one),
    within the round."""
    for row in rows:
        peers = {r["target"]: r for r in rows if r["scenario"] == row["scenario"]}
        bare, direct = peers.get("bare"), peers.get("direct")
        if bare and bare.get("cpu_us_per_chunk") and row.get("cpu_us_per_chunk"):
            row["x_bare"] = round(row["cpu_us_per_chunk"] / bare["cpu_us_per_chunk"], 2)
        off = peers.get("ncap-no-evidence")
        if row["target"] == "ncap" and off and off.get("cpu_us_per_chunk"):
            share = row.get("cpu_us_per_chunk", 0) / off["cpu_us_per_chunk"] - 1
            row["evidence_overhead"] = round(share, 3)
        for c in (1, 16):
            key = f"ttfb_p50_ms_c{c}"
            if direct and direct.get(key) is not None and row.get(key) is not None:
                row[f"added_ttfb_ms_c{c}"] = round(row[key] - direct[key], 3)


def start_targets(work: Path, up_port: int, up: bl.Server, names: list[str]) -> dict[str, Any]:
    started: dict[str, Any] = {}
    for name in names:
        try:
            if name == "direct":
                started[name] = Target("direct", _url(up_port), up, note="the upstream")
            elif name == "bare":
                started[name] = bare_target(work, up_port)
            elif name in ("ncap", "ncap-memory", "ncap-no-evidence"):
                started[name] = ncap_target(work, up_port, name)
            elif name == "ncap-before":
                started[name] = ncap_target(work, up_port, name, COMPARE_SRC[0])
            elif name in ("ncap-fanout", "ncap-fanout-before"):
                base_name = "ncap" if name == "ncap-fanout" else "ncap-before"
                base = started.get(base_name)
                if not isinstance(base, Target):
                    raise RuntimeError(f"{name} needs {base_name}, which did not start")
                note = "emulated route" + (", before" if "before" in name else "")
                started[name] = Target(name, base.url, base.server, model="fake-fanout", note=note)
            elif name == "litellm":
                started[name] = litellm_target(work, up_port)
            elif name == "portkey":
                started[name] = portkey_target(work, up_port)
        except Exception as exc:  # a target that cannot start is reported, not fatal
            started[name] = f"did not start: {exc}"
    return started


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["scenario", "target", "CPU µs/chunk", "× bare", "TTFB c=1 (added)"]
    headers += ["TTFB c=16 (added)", "note"]
    body = []
    for r in rows:
        ttfb = [
            f"{r.get(f'ttfb_p50_ms_c{c}')} ({r.get(f'added_ttfb_ms_c{c}', '-')})" for c in (1, 16)
        ]
        note = r.get("error") or r.get("note", "")
        if "evidence_overhead" in r:
            note += f"; evidence hook {r['evidence_overhead']:+.1%} CPU/chunk"
        cpu = [r.get("cpu_us_per_chunk", "-"), r.get("x_bare", "-")]
        body.append([r["scenario"], r["target"], *cpu, *ttfb, note])
    return bl.md_table(headers, body)


def drive(args: argparse.Namespace) -> int:
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    if args.compare_src:
        COMPARE_SRC[0] = args.compare_src
        names += ["ncap-before", "ncap-fanout-before"]
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    work = Path(tempfile.mkdtemp(prefix="ncap-stream-bench-"))
    up, up_port = start_upstream(work)
    started = start_targets(work, up_port, up, names)
    result: dict[str, Any] = {"machine": bl.machine_info(), "rounds": [], "skipped": {}}
    try:
        for name, target in started.items():
            if isinstance(target, str):
                result["skipped"][name] = target
                print(f"  {name}: {target}", file=sys.stderr)
        for number in range(args.rounds):
            rows: list[dict[str, Any]] = []
            for scenario in scenarios:
                for name in names:
                    target = started.get(name)
                    if not isinstance(target, Target):
                        continue
                    if "fanout" in name and SCENARIOS[scenario][0] == 1:
                        continue  # one candidate is never fanned out
                    try:
                        rows.append(measure(target, scenario, args))
                    except Exception as exc:
                        error = f"failed: {str(exc)[-400:]}"
                        rows.append({"target": name, "scenario": scenario, "error": error})
            derive(rows)
            result["rounds"].append(rows)
            print(f"\n### round {number + 1}\n\n{table(rows)}\n", flush=True)
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
        pair = [started.get("ncap"), started.get("ncap-no-evidence")]
        if args.evidence_pairs and all(isinstance(t, Target) for t in pair):
            result["evidence_ab"] = evidence_ab(pair, args)  # type: ignore[arg-type]
    finally:
        for target in started.values():
            if isinstance(target, Target) and target.server is not None:
                bl.stop_server(target.server)
        bl.stop_server(up)
        shutil.rmtree(work, ignore_errors=True)
    result["machine"]["loadavg_at_end"] = bl.loadavg()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    if not args.compare_src:  # a before/after comparison is not this checkout's result
        bl.save_result("stream", result_tables(result), raw=result)
    return 0


def evidence_ab(pair: list[Target], args: argparse.Namespace) -> dict[str, Any]:
    """The evidence hook's cost, the n4x250 CPU per chunk of ``ncap`` and
    ``ncap-no-evidence`` measured one after the other ``--evidence-pairs`` times (one
    pair of single measurements moves by tens of percent: how the upstream's writes
    fall into reads differs from one measurement to the next); the median of each."""
    n, tokens = SCENARIOS["n4x250"]
    cpu: dict[str, list[float]] = {t.name: [] for t in pair}
    for _ in range(args.evidence_pairs):
        for target in pair:
            with bl.measured(target.server.pid) as used:  # type: ignore[union-attr]
                res = run_load(target, n, tokens, args.cpu_concurrency, args.requests)
            cpu[target.name].append(round(1e6 * used["cpu_s"] / (res["ok"] * n * tokens), 3))
    on, off = (statistics.median(cpu[t.name]) for t in pair)
    out = {
        "pairs": args.evidence_pairs,
        "cpu_us_per_chunk": cpu,
        "overhead": round(on / off - 1, 3),
    }
    print(
        f"  evidence on/off, median of {args.evidence_pairs}: {out['overhead']:+.1%}",
        file=sys.stderr,
    )
    return out


def result_tables(result: dict[str, Any]) -> list[bl.Table]:
    """Each round's table (the rows ``table`` prints), then what could not be measured."""
    columns = ["scenario", "target", "CPU µs/chunk", "× bare", "TTFB p50 ms c=1 (added)"]
    columns += ["TTFB p50 ms c=16 (added)", "note"]
    keys = ["scenario", "target", "cpu_us_per_chunk", "x_bare"]
    out = [_summary(result["rounds"])] if result["rounds"] else []
    ab = result.get("evidence_ab")
    if ab:
        cpu = ab["cpu_us_per_chunk"]
        body = [
            [name, statistics.median(values), min(values), max(values)]
            for name, values in cpu.items()
        ]
        note = (
            f"n4x250, {ab['pairs']} measurements of each, one after the other: the evidence "
            f"costs {ab['overhead']:+.1%} CPU per chunk (medians)."
        )
        columns = ["target", "median µs/chunk", "lowest", "highest"]
        out.append(bl.Table("Candidates' evidence on against off", columns, body, notes=note))
    method = (
        f"The upstream pauses {FIRST_TOKEN_MS:g} ms between its role chunks and its first "
        "token, then writes every chunk at once; added TTFB is over the upstream's own "
        "(direct)."
    )
    for number, rows in enumerate(result["rounds"], 1):
        body = [
            [r.get(k) for k in keys]
            + [
                f"{r.get(f'ttfb_p50_ms_c{c}')} ({r.get(f'added_ttfb_ms_c{c}', '–')})"
                for c in (1, 16)
            ]
            + [_note(r)]
            for r in rows
        ]
        skipped = "; ".join(f"{name}: {why}" for name, why in result["skipped"].items())
        notes = method + (f" Not measured: {skipped}." if skipped else "")
        out.append(bl.Table(f"Round {number}", columns, body, notes=notes))
    return out


def _note(row: dict[str, Any]) -> str:
    note = str(row.get("error") or row.get("note", ""))
    if "evidence_overhead" in row:
        note += f"; evidence hook {row['evidence_overhead']:+.1%} CPU/chunk"
    return note


def _summary(rounds: list[list[dict[str, Any]]]) -> bl.Table:
    """Per scenario and target, the range over the rounds of × bare, added TTFB at c=1
    and (for ``ncap``) the evidence hook's share."""
    ranges: dict[tuple[str, str], dict[str, list[float]]] = {}
    for rows in rounds:
        for r in rows:
            cell = ranges.setdefault((r["scenario"], r["target"]), {})
            for key in ("x_bare", "added_ttfb_ms_c1", "evidence_overhead"):
                if isinstance(r.get(key), int | float):
                    cell.setdefault(key, []).append(r[key])

    def span(values: list[float] | None, fmt: str) -> str:
        if not values:
            return "–"
        low, high = min(values), max(values)
        return format(low, fmt) if low == high else f"{low:{fmt}} – {high:{fmt}}"

    body = [
        [
            scenario,
            target,
            span(cell.get("x_bare"), ".2f"),
            span(cell.get("added_ttfb_ms_c1"), ".2f"),
            span(cell.get("evidence_overhead"), "+.1%"),
        ]
        for (scenario, target), cell in ranges.items()
        if target != "direct"
    ]
    columns = ["scenario", "target", "CPU/chunk × bare", "added TTFB c=1 ms", "evidence"]
    return bl.Table(f"Over {len(rounds)} round(s)", columns, body)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("upstream", "bare", "load"):
        sub = argparse.ArgumentParser()
        kind = argv[0]
        if kind == "load":
            sub.add_argument("url")
            sub.add_argument("-c", type=int, default=1)
            sub.add_argument("--requests", type=int, default=10)
            sub.add_argument("--api-key", default="bench")
            sub.add_argument("--body", required=True)
            sub.add_argument("--header", action="append")
            load_main(sub.parse_args(argv[1:]))
            return 0
        sub.add_argument("--port", type=int, required=True)
        sub.add_argument("--upstream", default="")
        sub.add_argument("--pace-ms", type=float, default=0.0)
        sub.add_argument("--first-token-ms", type=float, default=FIRST_TOKEN_MS)
        ns = sub.parse_args(argv[1:])
        if kind == "upstream":
            upstream_main(ns.port, ns.pace_ms, ns.first_token_ms)
        else:
            bare_main(ns.port, ns.upstream)
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--scenarios", default=DEFAULT_SCENARIOS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=150, help="streams per CPU measurement")
    p.add_argument("--cpu-concurrency", type=int, default=8)
    p.add_argument("--ttfb-requests", type=int, default=100, help="at c=1 (×2 at c=16)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--peer-requests", type=int, default=16, help="streams per peer measure")
    p.add_argument("--evidence-pairs", type=int, default=7, help="evidence on/off, interleaved")
    # the rounds so far, rewritten after each round so that a run cut short keeps them
    p.add_argument("--output", default=str(bl.RESULTS / "partial" / "stream.json"))
    p.add_argument("--ncap-src", default=NCAP_SRC[0], help="the ncap sources to serve")
    p.add_argument("--compare-src", default="", help="also serve these sources (before)")
    args = p.parse_args(argv)
    NCAP_SRC[0] = args.ncap_src
    return drive(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
