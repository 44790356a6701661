"""Small hostile servers for the hostile-upstream and hostile-client suites: real aiohttp
servers on free ports (``ServerThread``), each doing one bad thing on purpose.

``Recorder`` is the other origin a hostile upstream points at: it records every request
it receives and answers as an honest upstream would (OpenAI's or Gemini's 200, whole or
streamed), so a client that followed it would see a success. ``serve`` runs any handler
on every path and method.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.support import ServerThread

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextmanager
def serve(handler: Handler) -> Iterator[ServerThread]:
    """``handler`` on every method and path of a server of its own."""

    def app() -> web.Application:
        a = web.Application()
        a.router.add_route("*", "/{tail:.*}", handler)
        return a

    server = ServerThread(app).start()
    try:
        yield server
    finally:
        server.stop()


def chat_completion(n: int = 1, content: str = "ok") -> dict[str, Any]:
    choices = [
        {"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}
        for i in range(n)
    ]
    return {
        "id": "chatcmpl-hostile",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": choices,
        "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
    }


def chat_chunk(content: str, *, finish: str | None = None) -> dict[str, Any]:
    delta = {"content": content} if finish is None else {}
    return {
        "id": "chatcmpl-hostile",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def gemini_answer(text: str = "ok") -> dict[str, Any]:
    return {
        "candidates": [
            {
                "index": 0,
                "content": {"role": "model", "parts": [{"text": text}]},
                "finishReason": "STOP",
            }
        ],
        "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 1, "totalTokenCount": 4},
        "responseId": "hostile",
        "modelVersion": "gemini-2.5-flash",
    }


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Recorder:
    """Another origin: records what reaches it, answers 200 as the upstream would."""

    seen: list[Seen] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers), body))
        if "streamGenerateContent" in request.path:
            return await sse(request, [gemini_answer()], done=False)
        if "generateContent" in request.path:
            return web.json_response(gemini_answer())
        if body and json.loads(body).get("stream"):
            return await sse(request, [chat_chunk("ok"), chat_chunk("", finish="stop")])
        return web.json_response(chat_completion())


async def sse(
    request: web.Request, events: list[dict[str, Any]], *, done: bool = True
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for event in events:
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    if done:
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
