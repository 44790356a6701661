"""Closed-loop HTTP load generator for chat-completions endpoints.

C workers each send one request, wait for the whole answer, and send the next,
so offered load adapts to the server (no coordinated-omission correction is
needed because there is no open-loop schedule to fall behind). One process,
aiohttp client on uvloop: on a 2-core machine a second load process would only
steal the core the server under test needs.

Usage:
    loadgen.py URL [-c 16] [--duration 5 | --requests N] [--warmup 1]
               [--model fake-model] [--stream] [--json] [--header 'Name: value' ...]

Throughput counts answers that *completed* inside the measurement window;
latency percentiles are over the same answers. Streaming mode also reports the
time to the first body byte (TTFB) and requires the ``data: [DONE]`` trailer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import uvloop
from benchlib import chat_body


@dataclass
class Window:
    """The measurement interval, on the perf_counter clock; end grows in count mode."""

    start: float
    end: float
    remaining: int | None = None  # count mode: measured requests still to send


@dataclass
class Samples:
    latencies: list[float] = field(default_factory=list)
    ttfbs: list[float] = field(default_factory=list)
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    # during the warm-up (e.g. the ramp limiter's 429 slow_down while load steps up)
    warmup_errors: int = 0
    last_done: float = 0.0

    def error(self, kind: str, *, warming_up: bool = False) -> None:
        if warming_up:
            self.warmup_errors += 1
            return
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


@dataclass
class Result:
    url: str
    concurrency: int
    stream: bool
    duration_s: float
    requests: int
    errors: int
    throughput_rps: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    mean_ms: float | None
    ttfb_p50_ms: float | None
    ttfb_p99_ms: float | None
    error_kinds: dict[str, int]
    warmup_errors: int = 0


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an already sorted list."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> float | None:
    """Send one request; return TTFB for streams (None otherwise); raise on a bad answer."""
    async with session.post(url, data=body) as resp:
        if resp.status != 200:
            await resp.read()
            raise _BadAnswer(f"http_{resp.status}")
        if not stream:
            if b'"choices"' not in await resp.read():
                raise _BadAnswer("no_choices")
            return None
        ttfb, tail = None, b""
        async for chunk in resp.content.iter_any():
            if ttfb is None:
                ttfb = time.perf_counter()
            tail = (tail + chunk)[-64:]
        if b"[DONE]" not in tail:
            raise _BadAnswer("no_done")
        return ttfb


class _BadAnswer(Exception):
    pass


def _take_ticket(window: Window, now: float) -> bool:
    """Whether a worker may send another request (time or count budget left)."""
    if window.remaining is None:
        return now < window.end
    if now < window.start:
        return True
    if window.remaining <= 0:
        return False
    window.remaining -= 1
    return True


async def _worker(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, w: Window, s: Samples
) -> None:
    while _take_ticket(w, t0 := time.perf_counter()):
        try:
            ttfb = await _one(session, url, body, stream)
        except _BadAnswer as exc:
            s.error(str(exc), warming_up=t0 < w.start)
            continue
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            s.error(type(exc).__name__, warming_up=t0 < w.start)
            await asyncio.sleep(0.01)  # a refused connection must not spin the core
            continue
        t1 = time.perf_counter()
        if t0 >= w.start and (w.remaining is not None or t1 <= w.end):
            s.latencies.append(t1 - t0)
            s.last_done = t1
            if ttfb is not None:
                s.ttfbs.append(ttfb - t0)


async def run(
    url: str,
    body: bytes,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    stream: bool = False,
    requests: int | None = None,
    api_key: str = "bench",
    extra_headers: dict[str, str] | None = None,
) -> Result:
    """Drive ``concurrency`` workers; measure after ``warmup_s`` seconds."""
    now = time.perf_counter()
    window = Window(start=now + warmup_s, end=now + warmup_s + duration_s, remaining=requests)
    samples = Samples()
    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    headers.update(extra_headers or {})
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        workers = [_worker(session, url, body, stream, window, samples) for _ in range(concurrency)]
        await asyncio.gather(*workers)
    measured_s = (samples.last_done - window.start) if requests else duration_s
    return _summarise(url, concurrency, stream, measured_s, samples)


def _ms(values: list[float], q: float) -> float | None:
    """Percentile in ms rounded to µs; None (JSON null, never NaN) without samples."""
    return round(percentile(values, q), 3) if values else None


def _summarise(url: str, c: int, stream: bool, secs: float, s: Samples) -> Result:
    lat = sorted(x * 1000 for x in s.latencies)
    ttfb = sorted(x * 1000 for x in s.ttfbs)
    return Result(
        url=url,
        concurrency=c,
        stream=stream,
        duration_s=round(secs, 3),
        requests=len(lat),
        errors=s.errors,
        throughput_rps=round(len(lat) / secs, 1) if secs > 0 else 0.0,
        p50_ms=_ms(lat, 50),
        p90_ms=_ms(lat, 90),
        p99_ms=_ms(lat, 99),
        max_ms=_ms(lat, 100),
        mean_ms=round(sum(lat) / len(lat), 3) if lat else None,
        ttfb_p50_ms=_ms(ttfb, 50),
        ttfb_p99_ms=_ms(ttfb, 99),
        error_kinds=s.error_kinds,
        warmup_errors=s.warmup_errors,
    )


def _body(args: argparse.Namespace) -> bytes:
    if args.body:
        with open(args.body, "rb") as f:
            return f.read()
    return chat_body(args.model, args.stream)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("url")
    p.add_argument("-c", "--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=5.0, help="seconds measured (time mode)")
    p.add_argument("--requests", type=int, default=None, help="measure N requests instead")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring")
    p.add_argument("--model", default="fake-model")
    p.add_argument("--body", help="file with the JSON body to send instead of the default")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--api-key", default="bench", help="sent as Authorization: Bearer KEY")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--header", action="append", default=[], help="extra 'Name: value' header (repeatable)"
    )
    args = p.parse_args(argv)
    extra = dict(tuple(part.strip() for part in h.split(":", 1)) for h in args.header)
    res = uvloop.run(
        run(
            args.url,
            _body(args),
            args.concurrency,
            args.duration,
            args.warmup,
            args.stream,
            args.requests,
            args.api_key,
            extra,
        )
    )
    if args.json:
        print(json.dumps(asdict(res)))
    else:
        print(
            f"c={res.concurrency} {res.throughput_rps} req/s p50={res.p50_ms}ms "
            f"p99={res.p99_ms}ms n={res.requests} errors={res.errors} {res.error_kinds or ''}"
        )
    return 0 if res.requests else 1


if __name__ == "__main__":
    sys.exit(main())
