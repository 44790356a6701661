"""Tasks, coroutines and timers the gateway starts per request, counted in-process.

One process runs the fake upstream, the gateway (``create_app``, memory stores or the
shipped default) and a client; after ``--warm`` requests, ``--requests`` sequential
non-streamed requests are counted: every task created (by what its coroutine is),
every entry into a coroutine frame of ncap's own code (``sys.setprofile``: a start,
or a resumption after an await that suspended), and every timer (``call_at``, which
``call_later`` goes through). The client's and the upstream's share is the same
before and after a change to the gateway, so a difference is the gateway's.

    PYTHONPATH=src .venv/bin/python bench/lifecycle_counts.py [--stores memory|default]
        [--requests 500] [--warm 50]

Run it against two checkouts' ``src`` (``PYTHONPATH``) for a before/after.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import gateway_bench as gb
from aiohttp import web

_BODY = b'{"model":"fake-model","messages":[{"role":"user","content":"hi"}]}'


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


class Counter:
    """What one measured window started, by kind."""

    def __init__(self) -> None:
        self.tasks: collections.Counter[str] = collections.Counter()
        self.coroutines = 0
        self.timers = 0
        self.on = False

    def task_factory(self, loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task[Any]:
        if self.on:
            self.tasks[getattr(coro, "__qualname__", type(coro).__name__)] += 1
        return asyncio.Task(coro, loop=loop)

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if (
            event == "call"
            and code.co_flags & inspect.CO_COROUTINE
            and "/ncap/" in code.co_filename
            and "/ncap/testing/" not in code.co_filename
        ):
            self.coroutines += 1


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from ncap.config import load_config
    from ncap.http.app import create_app
    from ncap.testing.fake_upstream import create_app as upstream_app

    os.environ.setdefault("NCAP_BENCH_UPSTREAM_KEY", "bench")
    up_runner, up_port = await _serve(upstream_app())
    work = Path(tempfile.mkdtemp(prefix="ncap-counts-"))
    config = work / "ncap.yaml"
    config.write_text(gb.ncap_config_text(up_port, work, args.stores))
    os.environ["NCAP_HOME"] = str(work)
    runner, port = await _serve(create_app(load_config(config)))
    counter = Counter()
    loop = asyncio.get_running_loop()
    loop.set_task_factory(counter.task_factory)
    at = loop.call_at  # call_later goes through call_at: each timer counted once

    def call_at(when: float, *a: Any, **k: Any) -> asyncio.TimerHandle:
        counter.timers += counter.on
        return at(when, *a, **k)

    loop.call_at = call_at  # type: ignore[method-assign]
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession() as session:
        for i in range(args.warm + args.requests):
            if i == args.warm:
                counter.on = True
                sys.setprofile(counter.profile)
            async with session.post(url, data=_BODY, headers=headers) as response:
                assert response.status == 200, response.status
                await response.read()
        sys.setprofile(None)
        counter.on = False
        await asyncio.sleep(0.05)  # the last settlements
    await runner.cleanup()
    await up_runner.cleanup()
    n = args.requests
    return {
        "stores": args.stores,
        "requests": n,
        "tasks_per_request": round(sum(counter.tasks.values()) / n, 3),
        "tasks_by_coroutine": {k: round(v / n, 3) for k, v in counter.tasks.most_common()},
        "ncap_coroutine_entries_per_request": round(counter.coroutines / n, 2),
        "timers_per_request": round(counter.timers / n, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stores", default="memory", choices=["memory", "default"])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--warm", type=int, default=50)
    print(json.dumps(asyncio.run(run(p.parse_args())), indent=1))


if __name__ == "__main__":
    main()
