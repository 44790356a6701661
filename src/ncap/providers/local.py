"""Provider ``local``: the in-process llama.cpp engine (``ncap.engine``).

The model is loaded once, lazily, in a worker thread so the event loop keeps serving.
The engine's own errors (``Overloaded`` 503, ``ContextLengthExceeded`` 400, invalid
values) are ``NcapError`` and propagate unchanged; only a timeout becomes
``AttemptFailed``, as for a remote upstream.

A local engine is not a network upstream: its queue and its progress are known. An
attempt's clock starts when the engine admits it (waiting in its bounded queue is not
charged), and runs for the route's ``timeout_s`` when the configuration sets one, else
for a budget derived from the request and the engine's measured speed
(``Engine.time_budget``). At the timeout the request is cancelled and the attempt fails
only once the engine has freed its sequences; the failure carries what the engine had
used by then, so its ledger row is settled at that usage (finish reason ``cancelled``)
instead of waiting for a reconciliation no local engine can send.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import msgspec

from ncap.config import LocalRoute
from ncap.engine import (
    ChatChunks,
    Engine,
    EngineSettings,
    EngineStats,
    RequestStream,
    TextChunks,
    best_of,
    chat_chunk_stream,
    chat_completion,
    chat_params,
    collect,
    completion_params,
    include_usage,
    new_id,
    summarize,
    text_chunk_stream,
    text_completion,
    usage,
)
from ncap.protocol.completions import TextCompletion
from ncap.protocol.responses import ChatCompletion, ChatCompletionChunk, Usage
from ncap.providers.base import AttemptFailed, RequestKind, UpstreamResult
from ncap.streaming.sse import DONE, StreamEvent, encode_event

__all__ = ["LocalProvider"]

_encode = msgspec.json.Encoder().encode
T = TypeVar("T")


def settings_from_route(route: LocalRoute) -> EngineSettings:
    return EngineSettings(
        model_path=route.model_path,
        n_ctx=route.n_ctx,
        max_sequences=route.max_sequences,
        max_queue=route.max_queue,
        threads=route.threads,
        prefix_cache_tokens=route.prefix_cache_tokens,
        weights=route.weights,
    )


class LocalProvider:
    """One engine per route, shared by all its requests (continuous batching)."""

    def __init__(
        self, route: LocalRoute, *, route_id: str = "", default_model: str = "smollm2"
    ) -> None:
        self._settings = settings_from_route(route)
        # an explicit timeout_s bounds each attempt's time in the engine; without one
        # the engine derives a budget per request
        self._fixed_timeout = route.timeout_s if "timeout_s" in route.model_fields_set else None
        self._default_model = default_model
        self._engine: Engine | None = None
        self._loading: asyncio.Lock | None = None

    async def engine(self) -> Engine:
        """The loaded engine (first call loads it in a thread)."""
        if self._engine is None:
            self._loading = self._loading or asyncio.Lock()
            async with self._loading:
                if self._engine is None:
                    self._engine = await asyncio.to_thread(Engine.load, self._settings)
        return self._engine

    def stats(self) -> EngineStats | None:
        """The engine's counters for metrics; None until the model is loaded."""
        return self._engine.stats() if self._engine is not None else None

    async def complete(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> UpstreamResult:
        engine = await self.engine()
        legacy = completion_params(body) if kind == "completions" else None
        params = legacy.params if legacy is not None else chat_params(body)
        async with engine.open(params) as stream:
            await stream.started.wait()  # queued: bounded by the engine's max_queue
            budget = partial(self._budget, engine, stream)
            started = asyncio.get_running_loop().time()
            done = await _in_time(collect(stream), stream, started, budget)
        created, model = int(time.time()), self._model(body)
        payload: ChatCompletion | TextCompletion
        if legacy is not None:
            id_ = new_id("cmpl")
            done = best_of(done, legacy.n)  # the n of best_of, by mean log-probability
            payload = text_completion(done, id_=id_, model=model, created=created)
        else:
            id_ = new_id()
            payload = chat_completion(done, id_=id_, model=model, created=created)
        summary = summarize(
            id_, ((c.index, c.finish_reason) for c in payload.choices), payload.usage or None
        )
        tokens = tuple(c.tokens for c in done.choices)
        return UpstreamResult(200, _encode(payload), summary, id_, choice_tokens=tokens)

    @asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> AsyncIterator[tuple[str | None, AsyncIterator[StreamEvent]]]:
        engine = await self.engine()
        model = self._model(body)
        if kind == "completions":
            legacy = completion_params(body)
            id_ = new_id("cmpl")
            texts = TextChunks(id_=id_, model=model, include_usage=legacy.include_usage)
            async with engine.open(legacy.params) as stream:
                budget = partial(self._budget, engine, stream)
                yield id_, _events(stream, text_chunk_stream(stream, texts), budget)
            return
        params = chat_params(body)
        id_ = new_id()
        chunks = ChatChunks(id_=id_, model=model, n=params.n, include_usage=include_usage(body))
        async with engine.open(params) as stream:
            budget = partial(self._budget, engine, stream)
            yield id_, _events(stream, chat_chunk_stream(stream, chunks), budget)

    async def aclose(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            await asyncio.to_thread(engine.close)

    def _budget(self, engine: Engine, stream: RequestStream) -> float:
        """Seconds the admitted request may run: the route's own, or the engine's."""
        if self._fixed_timeout is not None:
            return self._fixed_timeout
        return engine.time_budget(stream.prepared)

    def _model(self, body: Mapping[str, Any]) -> str:
        model = body.get("model")
        return model if isinstance(model, str) and model else self._default_model


async def _timed_out(stream: RequestStream, *, mid_stream: bool = False) -> AttemptFailed:
    """Cancel the request, wait until its sequences are freed, and fail the attempt
    with what it had used. Not retried on the same engine (it would meet the same
    load); another route of the chain may serve."""
    freed = await stream.cancel()
    used = usage(freed.prompt_tokens, freed.completion_tokens, freed.cached_tokens)
    return AttemptFailed(
        "timeout",
        detail="local engine timed out; its sequences were cancelled",
        partial=mid_stream,
        usage=used,
        cancelled=True,
    )


async def _in_time(
    work: Awaitable[T],
    stream: RequestStream,
    started: float,
    budget: Callable[[], float],
    *,
    mid_stream: bool = False,
) -> T:
    """``work`` unless the request has run ``budget()`` seconds since ``started``.

    The budget is read again whenever it runs out: a derived one follows the engine's
    measured speed, so a request that a busier machine slowed down after its admission
    keeps running while the engine says it needs longer."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            left = started + budget() - loop.time()
            if left <= 0:
                task.cancel()
                await asyncio.wait({task})  # it stops reading the stream's events first
                raise await _timed_out(stream, mid_stream=mid_stream)
            await asyncio.wait({task}, timeout=left)
    except BaseException:
        task.cancel()
        raise
    return task.result()


async def _events(
    stream: RequestStream,
    chunks: AsyncIterator[ChatCompletionChunk | TextCompletion],
    budget: Callable[[], float],
) -> AsyncIterator[StreamEvent]:
    """Chunks as SSE events, the first once the engine admitted the request, the last
    within ``budget()`` seconds of that; the usage chunk carries each choice's token
    count (``stream.finished``)."""
    await stream.started.wait()  # queued: bounded by the engine's max_queue
    started = asyncio.get_running_loop().time()
    source = aiter(chunks)
    while True:
        chunk = await _in_time(anext(source, None), stream, started, budget, mid_stream=True)
        if chunk is None:
            break
        data = _encode(chunk)
        counts = None
        if isinstance(chunk.usage, Usage) and stream.finished is not None:  # after the end
            counts = stream.finished.choice_tokens
        yield StreamEvent(encode_event(data), _summary(chunk), data=data, choice_tokens=counts)
    yield StreamEvent(DONE, None, done=True)


def _summary(chunk: ChatCompletionChunk | TextCompletion) -> Any:
    use = chunk.usage if isinstance(chunk.usage, Usage) else None
    return summarize(chunk.id, ((c.index, c.finish_reason) for c in chunk.choices), use)
