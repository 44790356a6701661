"""The engine on its own, as an OpenAI-compatible HTTP server (``ncap engine serve``).

Thin aiohttp handlers over ``Engine``: request validation is ``ncap.protocol.validate``,
the answers are ``ncap.engine.wire``; every error leaves as OpenAI's envelope.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from aiohttp import web

from ncap.engine.engine import Engine
from ncap.engine.params import chat_params, completion_params, include_usage
from ncap.engine.wire import (
    ChatChunks,
    TextChunks,
    best_of,
    chat_chunk_stream,
    chat_completion,
    new_id,
    sse,
    text_chunk_stream,
    text_completion,
)
from ncap.errors import BodyTooLarge, InvalidRequest, NcapError
from ncap.logsafe import log_internal_error
from ncap.protocol.validate import parse_chat_request, parse_completion_request

__all__ = ["ENGINE", "MODEL_NAME", "create_engine_app"]

log = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", Engine)
MODEL_NAME = web.AppKey("model_name", str)
_encode = msgspec.json.encode
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(exc: NcapError) -> web.Response:
    return web.Response(
        body=_encode(exc.envelope()),
        status=exc.status,
        headers=exc.headers(),
        content_type="application/json",
    )


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Map every failure to OpenAI's envelope; never a stack trace."""
    try:
        return await handler(request)
    except NcapError as exc:
        return _error(exc)
    except web.HTTPRequestEntityTooLarge:
        return _error(BodyTooLarge("the request body is too large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(_http_error(exc))
    except Exception as exc:
        log_internal_error(log, "engine handler failed", exc)
        return _error(NcapError("the server had an error while processing your request"))


def _http_error(exc: web.HTTPException) -> NcapError:
    error = InvalidRequest(exc.reason, code="not_found" if exc.status == 404 else "invalid_request")
    error.status = exc.status  # type: ignore[misc]
    return error


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine, model = request.app[ENGINE], request.app[MODEL_NAME]
    body, _ = parse_chat_request(await request.read())
    params = chat_params(body)
    if body.get("stream"):
        chunks = ChatChunks(
            id_=new_id(), model=model, n=params.n, include_usage=include_usage(body)
        )
        async with engine.open(params) as stream:
            return await _sse(request, chat_chunk_stream(stream, chunks))
    done = await engine.run(params)
    payload = chat_completion(done, id_=new_id(), model=model, created=int(time.time()))
    return web.Response(body=_encode(payload), content_type="application/json")


async def completions(request: web.Request) -> web.StreamResponse:
    engine, model = request.app[ENGINE], request.app[MODEL_NAME]
    body, _ = parse_completion_request(await request.read())
    legacy = completion_params(body)
    if legacy.stream:
        chunks = TextChunks(id_=new_id("cmpl"), model=model, include_usage=legacy.include_usage)
        async with engine.open(legacy.params) as stream:
            return await _sse(request, text_chunk_stream(stream, chunks))
    done = best_of(await engine.run(legacy.params), legacy.n)
    payload = text_completion(done, id_=new_id("cmpl"), model=model, created=int(time.time()))
    return web.Response(body=_encode(payload), content_type="application/json")


async def _sse(request: web.Request, chunks: AsyncIterator[msgspec.Struct]) -> web.StreamResponse:
    """Relay chunks as server-sent events; a failure mid-stream becomes an error event."""
    first = await anext(chunks, None)  # errors before the first chunk stay proper HTTP errors
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        if first is not None:
            await response.write(sse(first))
        async for chunk in chunks:
            await response.write(sse(chunk))
        await response.write(sse(b"[DONE]"))
        await response.write_eof()
    except NcapError as exc:
        await response.write(sse(_encode(exc.envelope())))
        await response.write(sse(b"[DONE]"))
    except ConnectionResetError:
        pass  # the client left: leaving the engine's context cancels the request
    return response


async def models(request: web.Request) -> web.Response:
    name = request.app[MODEL_NAME]
    entry = {"id": name, "object": "model", "created": 0, "owned_by": "ncap"}
    return web.json_response({"object": "list", "data": [entry]})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def stats(request: web.Request) -> web.Response:
    s = request.app[ENGINE].stats()
    return web.json_response({k: getattr(s, k) for k in type(s).__slots__})


def create_engine_app(
    engine: Engine, *, model_name: str = "smollm2", max_body_bytes: int = 4 * 1024 * 1024
) -> web.Application:
    """The engine's app; the caller owns the engine (load before, close after)."""
    app = web.Application(middlewares=[errors_middleware], client_max_size=max_body_bytes)
    app[ENGINE] = engine
    app[MODEL_NAME] = model_name
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/stats", stats)
    return app
