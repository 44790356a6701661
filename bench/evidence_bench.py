"""CPU per streamed chunk with the candidate evidence on and off, in one run.

What the gateway does per upstream chunk of a streamed answer: split the SSE bytes
into events (``EventSplitter``: one piece per read, the settlement summary decoded) and take
each event in the relay (``relay._take``: the tally, and with evidence on, the
candidates' text and tool calls decoded and hashed). Sockets, aiohttp and the
ledger are left out, so the overhead is a share of the smallest per-chunk cost
there is (an upper bound on its share of the whole gateway's). The stream is the
fake upstream's own: n candidates of T tokens each, one chunk per token per
candidate, two of them tool calls streamed in argument fragments.

Timed with the process's own CPU clock, on and off alternated over rounds; the
ratio of the medians is the result.

``--e2e`` measures the whole gateway instead: two ``ncap serve`` processes in front of
one fake upstream (in-memory stores), one with the evidence hook turned into a no-op
(the only difference), streamed requests of n candidates sent to each in alternating
rounds, and each gateway's own CPU (``/proc``) divided by the chunks it relayed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import benchlib as bl

from ncap.lifecycle.attempt_report import Tally
from ncap.lifecycle.evidence import EvidenceFeed
from ncap.lifecycle.relay import _take
from ncap.streaming.sse import EventSplitter, StreamPiece
from ncap.testing._fake_content import choice_text, labelled_choice
from ncap.testing._fake_render import Generation, chat_events


def stream_bytes(n: int, tokens: int) -> list[bytes]:
    choices = [choice_text(7, i, None, tokens) for i in range(n - 2)]
    choices += [labelled_choice("tool:lookup", None), labelled_choice("tool:lookup", None)]
    gen = Generation(id="chatcmpl-b", created=0, model="m", choices=choices, prompt_tokens=30)
    return chat_events(gen, "separate").data


async def _pieces(data: list[bytes]) -> AsyncIterator[StreamPiece]:
    """Each upstream write as its own read, split as the relay splits it."""
    splitter = EventSplitter()
    for chunk in data:
        piece = splitter.feed(chunk)
        if piece is not None:
            yield piece
    last = splitter.end()
    if last is not None:
        yield last


async def one_stream(data: list[bytes], evidence: bool) -> int:
    """Parse and take one stream; returns the chunks taken."""
    tally = Tally(evidence=EvidenceFeed() if evidence else None)
    taken = 0
    async for piece in _pieces(data):
        _take(piece, tally, True)
        taken += 1
    if tally.evidence is not None:
        tally.evidence.finish()
    return taken


def cpu_per_chunk(data: list[bytes], evidence: bool, streams: int) -> float:
    loop = asyncio.new_event_loop()
    try:
        start = time.process_time()
        chunks = 0
        for _ in range(streams):
            chunks += loop.run_until_complete(one_stream(data, evidence))
        return (time.process_time() - start) / chunks * 1e6
    finally:
        loop.close()


CONFIG = """\
stores: {{ledger: "memory://", budgets: "memory://"}}
workloads:
  default: {{max_candidates: 8, output_ceiling: 4096, max_concurrency: 64}}
models:
  fake-model: [fake]
routes:
  fake:
    provider: openai
    base_url: http://127.0.0.1:{port}/v1
    upstream_model: fake-model
    api_key_env: NCAP_BENCH_UPSTREAM_KEY
    pricing: {{input_per_mtok: 0.15, output_per_mtok: 0.6}}
    contract: {{candidates: native, max_candidates: 8, stream_usage: include_usage}}
"""
_SERVE = "from ncap.cli.main import main; main()"
# the evidence hook as a no-op: the stream is relayed exactly as with it on
_OFF = (
    "import ncap.lifecycle.evidence as e; "
    "e.EvidenceFeed.piece = lambda *a, **k: None; "
    "import ncap.streaming.sse as s; s.EventSplitter.read_candidates = lambda self: None; "
)


def _gateway(name: str, config: Path, work: Path, evidence: bool) -> tuple[bl.Server, str]:
    port = bl.free_port()
    code = _SERVE if evidence else _OFF + _SERVE
    argv = [sys.executable, "-c", code, "serve", "--config", str(config), "--port", str(port)]
    env = {"NCAP_BENCH_UPSTREAM_KEY": "dummy", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    server = bl.start_server(name, argv, work, env=env, cwd=work)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    bl.wait_ready(server, url, bl.chat_body("fake-model"), timeout_s=60)
    return server, url


async def _stream_round(url: str, body: dict[str, object], requests: int, c: int) -> int:
    """``requests`` streamed requests, ``c`` at a time; returns the data events read."""
    chunks = 0

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal chunks
        async with session.post(url, json=body) as reply:
            assert reply.status == 200, await reply.text()
            async for line in reply.content:
                chunks += line.startswith(b"data:")

    async with aiohttp.ClientSession() as session:
        for start in range(0, requests, c):
            await asyncio.gather(*(one(session) for _ in range(min(c, requests - start))))
    return chunks


def e2e(args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="ncap-evidence-bench-"))
    up_port = bl.free_port()
    upstream = bl.start_server(
        "upstream",
        [sys.executable, "-m", "ncap.testing.fake_upstream", "--port", str(up_port)],
        work,
        env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    servers = [upstream]
    try:
        bl.wait_ready(
            upstream,
            f"http://127.0.0.1:{up_port}/v1/chat/completions",
            bl.chat_body("fake-model"),
            timeout_s=30,
        )
        config = work / "ncap.yaml"
        config.write_text(CONFIG.format(port=up_port))
        on_srv, on_url = _gateway("ncap-on", config, work, True)
        servers.append(on_srv)
        off_srv, off_url = _gateway("ncap-off", config, work, False)
        servers.append(off_srv)
        body = {
            "model": "fake-model",
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "n": args.n,
            "temperature": 1.0,
            "max_tokens": args.tokens,
            "stream": True,
        }
        sides = {True: (on_srv, on_url), False: (off_srv, off_url)}
        per_chunk: dict[bool, list[float]] = {True: [], False: []}
        asyncio.run(_stream_round(on_url, body, 10, 2))  # warm-up, both
        asyncio.run(_stream_round(off_url, body, 10, 2))
        for r in range(args.rounds):
            for flag in (True, False) if r % 2 == 0 else (False, True):
                srv, url = sides[flag]
                cpu0 = bl.cpu_seconds(srv.pid)
                chunks = asyncio.run(_stream_round(url, body, args.requests, args.concurrency))
                per_chunk[flag].append((bl.cpu_seconds(srv.pid) - cpu0) / chunks * 1e6)
        on, off = statistics.median(per_chunk[True]), statistics.median(per_chunk[False])
        return {
            "mode": "e2e gateway CPU per relayed chunk",
            "n": args.n,
            "tokens": args.tokens,
            "requests_per_round": args.requests,
            "us_per_chunk_off": round(off, 2),
            "us_per_chunk_on": round(on, 2),
            "ratio_on_off": round(on / off, 4),
            "rounds_off": [round(x, 2) for x in per_chunk[False]],
            "rounds_on": [round(x, 2) for x in per_chunk[True]],
            "loadavg": bl.loadavg(),
        }
    finally:
        for server in reversed(servers):
            bl.stop_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=200, help="streams per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--e2e", action="store_true", help="whole gateways, not the relay")
    parser.add_argument("--requests", type=int, default=40, help="--e2e: requests per round")
    parser.add_argument("--concurrency", type=int, default=4, help="--e2e: at a time")
    args = parser.parse_args()
    if args.e2e:
        whole = e2e(args)
        print(json.dumps(whole, indent=2))
        title = f"Gateway CPU per relayed chunk, evidence on and off (n={args.n})"
        bl.save_result("evidence-e2e", [bl.flat_table(title, whole)], raw=whole)
        return
    data = stream_bytes(args.n, args.tokens)
    cpu_per_chunk(data, True, 20)  # warm-up
    on: list[float] = []
    off: list[float] = []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for flag in order:
            (on if flag else off).append(cpu_per_chunk(data, flag, args.streams))
    result = {
        "n": args.n,
        "chunks_per_stream": len(data),
        "us_per_chunk_off": round(statistics.median(off), 3),
        "us_per_chunk_on": round(statistics.median(on), 3),
        "ratio_on_off": round(statistics.median(on) / statistics.median(off), 4),
        "rounds_off": [round(x, 3) for x in off],
        "rounds_on": [round(x, 3) for x in on],
    }
    print(json.dumps(result, indent=2))
    title = f"Relay CPU per chunk, evidence on and off (n={args.n}, {args.streams} streams a round)"
    bl.save_result("evidence", [bl.flat_table(title, result)], raw=result)


if __name__ == "__main__":
    main()
