"""A tiny OpenAI-shaped upstream for developing the benchmark harness.

Only a stand-in until ``ncap.testing.fake_upstream`` exists: final benchmark runs
must use that module (benchlib.upstream_argv picks it automatically). Answers
POST /v1/chat/completions immediately, honours ``n`` and ``stream``.
"""

from __future__ import annotations

import argparse
import json
import time

import uvloop
from aiohttp import web


def _completion(model: str, n: int) -> bytes:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": "Hello there, how are you?"},
            "finish_reason": "stop",
            "logprobs": None,
        }
        for i in range(n)
    ]
    return json.dumps(
        {
            "id": "chatcmpl-standin",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": {"prompt_tokens": 20, "completion_tokens": 7 * n, "total_tokens": 20 + 7 * n},
        }
    ).encode()


def _chunks(model: str, n: int) -> list[bytes]:
    base = {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "created": 0}
    out = []
    for word in ("Hello", " there", "."):
        for i in range(n):
            choice = {"index": i, "delta": {"content": word}, "finish_reason": None}
            out.append(json.dumps(dict(base, model=model, choices=[choice])).encode())
    for i in range(n):
        choice = {"index": i, "delta": {}, "finish_reason": "stop"}
        out.append(json.dumps(dict(base, model=model, choices=[choice])).encode())
    usage = {"prompt_tokens": 20, "completion_tokens": 3 * n, "total_tokens": 20 + 3 * n}
    out.append(json.dumps(dict(base, model=model, choices=[], usage=usage)).encode())
    return [b"data: " + c + b"\n\n" for c in out] + [b"data: [DONE]\n\n"]


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    model, n = str(body.get("model", "fake")), int(body.get("n") or 1)
    if not body.get("stream"):
        return web.Response(body=_completion(model, n), content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for chunk in _chunks(model, n):
        await resp.write(chunk)
    await resp.write_eof()
    return resp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=9100)
    args = parser.parse_args()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
