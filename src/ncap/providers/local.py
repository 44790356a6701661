"""Provider ``local``: the in-process llama.cpp engine (``ncap.engine``).

The model is loaded once, lazily, in a worker thread so the event loop keeps serving.
The engine's own errors (``Overloaded`` 503, ``ContextLengthExceeded`` 400, invalid
values) are ``NcapError`` and propagate unchanged; only a timeout becomes
``AttemptFailed``, as for a remote upstream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

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
    completion_params,
    include_usage,
    new_id,
    summarize,
    text_chunk_stream,
    text_completion,
)
from ncap.protocol.completions import TextCompletion
from ncap.protocol.responses import ChatCompletion, ChatCompletionChunk, Usage
from ncap.providers.base import AttemptFailed, RequestKind, UpstreamResult
from ncap.streaming.sse import DONE, StreamEvent, encode_event

__all__ = ["LocalProvider"]

_encode = msgspec.json.Encoder().encode


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
        try:
            async with asyncio.timeout(timeout):
                done = await engine.run(params)
        except TimeoutError as exc:
            raise AttemptFailed("timeout", detail="local engine timed out") from exc
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
                yield id_, _events(stream, text_chunk_stream(stream, texts), timeout)
            return
        params = chat_params(body)
        id_ = new_id()
        chunks = ChatChunks(id_=id_, model=model, n=params.n, include_usage=include_usage(body))
        async with engine.open(params) as stream:
            yield id_, _events(stream, chat_chunk_stream(stream, chunks), timeout)

    async def aclose(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            await asyncio.to_thread(engine.close)

    def _model(self, body: Mapping[str, Any]) -> str:
        model = body.get("model")
        return model if isinstance(model, str) and model else self._default_model


async def _events(
    stream: RequestStream,
    chunks: AsyncIterator[ChatCompletionChunk | TextCompletion],
    timeout: float,
) -> AsyncIterator[StreamEvent]:
    """Chunks as SSE events; ``timeout`` bounds every wait for the next one; the usage
    chunk carries each choice's token count (``stream.finished``)."""
    source = aiter(chunks)
    while True:
        try:
            async with asyncio.timeout(timeout):
                chunk = await anext(source, None)
        except TimeoutError as exc:
            raise AttemptFailed("timeout", detail="local engine timed out", partial=True) from exc
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
