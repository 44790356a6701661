"""The HTTP front's own instructions per request, by cause, under callgrind.

One ``FrontConnection`` (``ncap.http.front``) is fed the same completion request over
and over with a transport that drops what is written, and a handler that reads two
headers and answers a fixed body: no socket, no upstream, no accounting, only the
front's parse, dispatch and answer. Each case runs the whole program under
``valgrind --tool=callgrind``; a run with no requests is subtracted, and the rest is
divided by the request count. Cases switch one concern off at a time:

- ``full``: the front as shipped;
- ``no-headers``: the header callback does nothing (no header pairs kept, an empty
  header map): what the request's headers cost, callbacks and map;
- ``no-header-map``: the pairs kept, the checked case-insensitive map not built;
- ``fixed-head``: the answer's head not formatted (a prepared one written instead).

    .venv/bin/python bench/front_instructions.py [--cases full,no-headers] [--requests 4000]

Prints one JSON line per case. Needs valgrind.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = ("full", "no-headers", "no-header-map", "fixed-head")
_PROMPT = b'{"model":"fake-model","messages":[{"role":"user","content":"hi"}]}'
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nAccept: */*\r\n"
    b"Accept-Encoding: gzip, deflate\r\nUser-Agent: loadgen\r\n"
    b"Authorization: Bearer sk-bench\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_PROMPT), _PROMPT)
)
ANSWER = b'{"id":"chatcmpl-fixed","object":"chat.completion","created":1,"choices":[]}'
HEADERS = {"Content-Type": "application/json", "x-request-id": "req-0123456789abcdef-1"}
WARM = 300


def serve(case: str, requests: int) -> None:
    """The measured program (run under callgrind by ``main``)."""
    import uvloop
    from aiohttp import web

    from ncap.cli.main import _GC_THRESHOLDS
    from ncap.config import Limits
    from ncap.http import front

    if case == "no-headers":
        front.FrontConnection.on_header = lambda self, name, value: None  # type: ignore[method-assign]
    elif case == "no-header-map":
        empty = front._NO_HEADERS
        front.FrontConnection._checked = lambda self, raw: empty  # type: ignore[method-assign]
    elif case == "fixed-head":
        head = front._head(200, HEADERS, "Content-Length: 76\r\n")
        front._head = lambda status, headers, extra: head  # type: ignore[assignment]

    class Dropped(asyncio.Transport):
        def write(self, data: bytes | bytearray | memoryview) -> None:
            pass

        def is_closing(self) -> bool:
            return False

        def get_extra_info(self, name: str, default: object = None) -> object:
            return default

    async def chat(message: front.Message) -> None:
        message.body_now(1 << 20)
        message.headers.get("Authorization")
        message.headers.get("x-stainless-retry-count")
        message.answer(200, HEADERS, ANSWER)

    async def run() -> None:
        runner = web.AppRunner(web.Application())
        await runner.setup()
        assert runner.server is not None
        server = front.FrontServer(runner.server, {"/v1/chat/completions": chat}, Limits())
        conn = server()
        conn.connection_made(Dropped())
        for count in (WARM, requests):
            for _ in range(count):
                conn.data_received(REQUEST)
                await asyncio.sleep(0)  # the handler's task runs
                await asyncio.sleep(0)
            if count == WARM:  # as `ncap serve` settles its heap
                gc.collect()
                gc.freeze()
                gc.set_threshold(*_GC_THRESHOLDS)

    uvloop.install()
    asyncio.run(run())


def _instructions(case: str, requests: int, work: Path) -> int:
    out = work / f"{case}-{requests}.callgrind"
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            __file__,
            "--serve",
            case,
            "--requests",
            str(requests),
        ],
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--serve", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve, args.requests)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = _instructions("full", 0, work)
        for case in args.cases.split(","):
            total = _instructions(case, args.requests, work)
            per = (total - base) / args.requests
            print(json.dumps({"case": case, "instructions_per_request": round(per)}))


if __name__ == "__main__":
    main()
