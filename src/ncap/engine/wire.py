"""Engine results → OpenAI wire shapes (chat.completion, chunks, legacy text_completion).

Shared by the engine's own HTTP server and the gateway's ``local`` provider, so both
answer byte-for-byte the same way. Streaming sends one choice per chunk: a role delta
for every choice first, content deltas in the order the scheduler produced them, a
finish chunk per choice, then (with ``include_usage``) the usage chunk with
``choices: []``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Protocol, TypeVar

import msgspec
from msgspec import UNSET

from ncap.engine.engine import RequestStream
from ncap.engine.events import ChoiceDelta, ChoiceResult, Completion, RequestDone, TokenInfo
from ncap.protocol.completions import LegacyLogprobs, TextChoice, TextCompletion
from ncap.protocol.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionTokensDetails,
    Delta,
    FunctionCall,
    Message,
    PromptTokensDetails,
    ResponseSummary,
    SummaryChoice,
    SummaryUsage,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from ncap.protocol.responses import SummaryUsageDetails as _SummaryDetails

__all__ = [
    "ChatChunks",
    "LegacyLogprobs",
    "TextChoice",
    "TextChunks",
    "TextCompletion",
    "best_of",
    "chat_chunk_stream",
    "chat_completion",
    "new_id",
    "sse",
    "summarize",
    "text_chunk_stream",
    "text_completion",
    "usage",
]

_encoder = msgspec.json.Encoder()


def new_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: msgspec.Struct | bytes) -> bytes:
    """One server-sent event; ``[DONE]`` is passed as bytes."""
    data = payload if isinstance(payload, bytes) else _encoder.encode(payload)
    return b"data: " + data + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        completion_tokens=completion_tokens,
        prompt_tokens=prompt_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=0),
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def summarize(
    id_: str, choices: Iterable[tuple[int, str | None]], use: Usage | None
) -> ResponseSummary:
    """The gateway's settlement view of what was just produced."""
    return ResponseSummary(
        id=id_,
        choices=[SummaryChoice(index=i, finish_reason=f) for i, f in choices],
        usage=None
        if use is None
        else SummaryUsage(
            prompt_tokens=use.prompt_tokens,
            completion_tokens=use.completion_tokens,
            total_tokens=use.total_tokens,
            prompt_tokens_details=_SummaryDetails(cached_tokens=_cached(use)),
        ),
    )


def _cached(use: Usage) -> int:
    details = use.prompt_tokens_details
    return details.cached_tokens if isinstance(details, PromptTokensDetails) else 0


def _token_logprob(info: TokenInfo) -> TokenLogprob:
    return TokenLogprob(
        token=info.token,
        logprob=info.logprob,
        bytes=list(info.bytes),
        top_logprobs=[TopLogprob(t.token, t.logprob, list(t.bytes)) for t in info.top],
    )


def _choice_logprobs(infos: Iterable[TokenInfo] | None) -> ChoiceLogprobs | None:
    if infos is None:
        return None
    return ChoiceLogprobs(content=[_token_logprob(i) for i in infos], refusal=None)


def _message(c: ChoiceResult) -> Message:
    if not c.tool_calls:
        return Message(content=c.text, refusal=None)
    calls = [ToolCall(t.id, "function", FunctionCall(t.name, t.arguments)) for t in c.tool_calls]
    return Message(content=c.text or None, refusal=None, tool_calls=calls)


def _call_deltas(d: ChoiceDelta) -> list[ToolCallDelta]:
    return [
        ToolCallDelta(k, t.id, "function", {"name": t.name, "arguments": t.arguments})
        for k, t in enumerate(d.tool_calls)
    ]


def chat_completion(done: Completion, *, id_: str, model: str, created: int) -> ChatCompletion:
    return ChatCompletion(
        id=id_,
        choices=[
            Choice(
                finish_reason=c.finish_reason,  # type: ignore[arg-type]
                index=c.index,
                message=_message(c),
                logprobs=_choice_logprobs(c.logprobs),
            )
            for c in done.choices
        ],
        created=created,
        model=model,
        usage=usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens),
    )


class ChatChunks:
    """Builds the chat.completion.chunk sequence of one streamed request."""

    def __init__(self, *, id_: str, model: str, n: int, include_usage: bool) -> None:
        self.id = id_
        self.model = model
        self.created = int(time.time())
        self.n = n
        self.include_usage = include_usage

    def _chunk(self, choices: list[ChunkChoice], use: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id,
            choices=choices,
            created=self.created,
            model=self.model,
            usage=use if use is not None else (None if self.include_usage else UNSET),
        )

    def opening(self) -> list[ChatCompletionChunk]:
        """The first chunk of every choice: the assistant role."""
        return [
            self._chunk([ChunkChoice(Delta(content="", role="assistant"), None, i, None)])
            for i in range(self.n)
        ]

    def delta(self, d: ChoiceDelta) -> list[ChatCompletionChunk]:
        out = []
        if d.text or d.logprobs:
            lp = _choice_logprobs(d.logprobs)
            out.append(self._chunk([ChunkChoice(Delta(content=d.text), None, d.index, lp)]))
        if d.tool_calls:
            delta = Delta(tool_calls=_call_deltas(d))
            out.append(self._chunk([ChunkChoice(delta, None, d.index, None)]))
        if d.finish_reason is not None:
            reason = d.finish_reason
            out.append(self._chunk([ChunkChoice(Delta(), reason, d.index, None)]))  # type: ignore[arg-type]
        return out

    def closing(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> list[ChatCompletionChunk]:
        if not self.include_usage:
            return []
        return [self._chunk([], usage(prompt_tokens, completion_tokens, cached_tokens))]


# --- legacy /v1/completions (wire shapes: ncap.protocol.completions) ---


def _legacy_logprobs(
    infos: list[TokenInfo] | tuple[TokenInfo, ...] | None, offset: int
) -> LegacyLogprobs | None:
    if infos is None:
        return None
    offsets = []
    for info in infos:
        offsets.append(offset)
        offset += len(info.token)
    return LegacyLogprobs(
        tokens=[i.token for i in infos],
        token_logprobs=[i.logprob for i in infos],
        top_logprobs=[{t.token: t.logprob for t in i.top} for i in infos],
        text_offset=offsets,
    )


def best_of(done: Completion, n: int) -> Completion:
    """The n choices with the highest mean log-probability, re-indexed; usage unchanged."""
    ranked = sorted(done.choices, key=lambda c: c.mean_logprob, reverse=True)[:n]
    chosen = [
        ChoiceResult(i, c.text, c.finish_reason, c.logprobs, c.tokens, c.mean_logprob)
        for i, c in enumerate(ranked)
    ]
    return Completion(chosen, done.prompt_tokens, done.completion_tokens)


def text_completion(done: Completion, *, id_: str, model: str, created: int) -> TextCompletion:
    return TextCompletion(
        id=id_,
        choices=[
            TextChoice(c.text, c.index, _legacy_logprobs(c.logprobs, 0), c.finish_reason)
            for c in done.choices
        ],
        created=created,
        model=model,
        usage=usage(done.prompt_tokens, done.completion_tokens),
    )


class TextChunks:
    """Streamed text_completion objects, one choice each."""

    def __init__(self, *, id_: str, model: str, include_usage: bool) -> None:
        self.id = id_
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self._offsets: dict[int, int] = {}

    def _chunk(self, choices: list[TextChoice], use: Usage | None = None) -> TextCompletion:
        return TextCompletion(
            self.id,
            choices,
            self.created,
            self.model,
            usage=use if use is not None else (None if self.include_usage else UNSET),
        )

    def delta(self, d: ChoiceDelta) -> list[TextCompletion]:
        offset = self._offsets.get(d.index, 0)
        self._offsets[d.index] = offset + len(d.text)
        lp = _legacy_logprobs(d.logprobs, offset)
        return [self._chunk([TextChoice(d.text, d.index, lp, d.finish_reason)])]

    def closing(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> list[TextCompletion]:
        # the legacy usage shape has no cached-token detail; the count is dropped here
        if not self.include_usage:
            return []
        return [self._chunk([], usage(prompt_tokens, completion_tokens))]


_Chunk = TypeVar("_Chunk")


class _Chunks(Protocol[_Chunk]):
    def delta(self, d: ChoiceDelta) -> list[_Chunk]: ...

    def closing(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> list[_Chunk]: ...


def chat_chunk_stream(
    stream: RequestStream, chunks: ChatChunks
) -> AsyncIterator[ChatCompletionChunk]:
    """The chunks of one streamed chat request, in order (``[DONE]`` not included)."""
    return _chunk_stream(stream, chunks, chunks.opening())


def text_chunk_stream(stream: RequestStream, chunks: TextChunks) -> AsyncIterator[TextCompletion]:
    return _chunk_stream(stream, chunks, [])


async def _chunk_stream(
    stream: RequestStream, chunks: _Chunks[_Chunk], opening: list[_Chunk]
) -> AsyncIterator[_Chunk]:
    for chunk in opening:
        yield chunk
    async for events in stream:
        for event in events:
            if isinstance(event, ChoiceDelta):
                for chunk in chunks.delta(event):
                    yield chunk
            elif isinstance(event, RequestDone):
                for chunk in chunks.closing(
                    event.prompt_tokens, event.completion_tokens, event.cached_tokens
                ):
                    yield chunk
