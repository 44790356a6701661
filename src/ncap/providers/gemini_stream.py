"""Stream chunk in: Gemini's ``streamGenerateContent?alt=sse`` events → OpenAI's
``chat.completion.chunk`` events, one chunk per choice change, each choice's state kept
per upstream candidate index (``_ChoiceState``).

Gemini has no end marker and reports running usage on every event: a stream is complete
when every candidate it started has finished, and only then is its usage reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from ncap.protocol import gemini as g
from ncap.protocol.responses import (
    ChatCompletionChunk,
    ChunkChoice,
    Delta,
    FinishReason,
    ToolCallDelta,
    Usage,
)
from ncap.providers.gemini_errors import (
    GeminiError,
    as_attempt_failed,
    from_google,
    protocol_error,
)
from ncap.providers.gemini_response import (
    Call,
    args_json,
    blocked,
    by_index,
    call_id,
    finish_reason,
    parts_of,
    usage_of,
)
from ncap.providers.openai_side import chunk, last_piece, piece
from ncap.streaming.sse import StreamPiece

__all__ = ["GeminiStream", "decode_stream_event", "response_id"]


class _StreamEvent(g.GenerateContentResponse, kw_only=True):
    """A stream event; Google ends a failing stream with an ``{"error": …}`` event, which
    is not part of GenerateContentResponse (hence fenced off here)."""

    error: g.GoogleError | None = None


_decode_event = msgspec.json.Decoder(_StreamEvent).decode


def decode_stream_event(data: bytes) -> g.GenerateContentResponse:
    """One SSE event's ``data`` (a whole GenerateContentResponse); an error event raises
    its ``GeminiError``."""
    try:
        event = _decode_event(data)
    except msgspec.DecodeError as exc:
        message = "The upstream provider sent a malformed stream event."
        raise protocol_error(message, str(exc)) from exc
    if event.error is not None:
        raise from_google(event.error.code or 500, event.error, None, None)
    return event


def response_id(data: bytes | None) -> str | None:
    """The ``responseId`` of a raw event, read without translating it (that happens once,
    in ``GeminiStream.events``); None when absent or unreadable (translating it then
    reports it)."""
    if data is None:
        return None
    try:
        value = msgspec.json.decode(data, type=dict[str, Any]).get("responseId")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return value if isinstance(value, str) else None


@dataclass(slots=True)
class _ChoiceState:
    """One choice of a stream, keyed by Gemini's candidate index."""

    started: bool = False  # the role was sent
    tool_calls: int = 0  # tool calls sent so far (the next one's OpenAI index)
    finish: FinishReason | None = None


class GeminiStream:
    """Gemini stream events in, OpenAI chunks out, one chunk per choice change.

    Usage rides on Gemini's events (the last one wins); ``close()`` turns it into the
    final ``choices: []`` usage chunk when the stream ends cleanly."""

    def __init__(
        self,
        *,
        completion_id: str,
        created: int,
        model: str,
        provider_request_id: str | None = None,
    ) -> None:
        self.completion_id = completion_id
        self.provider_request_id = provider_request_id
        self.created = created
        self.model = model
        self.choices: dict[int, _ChoiceState] = {}
        self.usage: Usage | None = None
        self.model_version: str | None = None

    def feed(self, event: g.GenerateContentResponse) -> list[ChatCompletionChunk]:
        if not event.candidates and event.prompt_feedback and event.prompt_feedback.block_reason:
            raise blocked(event, None)
        chunks: list[ChatCompletionChunk] = []
        for index, candidate in by_index(event.candidates).items():
            chunks += self._candidate(index, candidate)
        usage = usage_of(event.usage_metadata)
        if usage is not None:
            self.usage = usage
        self.model_version = event.model_version or self.model_version
        return chunks

    @property
    def complete(self) -> bool:
        """Every choice seen has finished. Gemini has no end marker and reports usage on
        every event, so a stream cut between events looks clean: this tells them apart."""
        return bool(self.choices) and all(c.finish is not None for c in self.choices.values())

    def close(self) -> list[ChatCompletionChunk]:
        """The usage chunk, when Gemini reported usage and the stream is complete; a cut
        stream's running usage is not the attempt's usage, so it stays unreported."""
        if self.usage is None or not self.complete:
            return []
        return [self._chunk([], usage=self.usage)]

    def events(self, data: bytes) -> StreamPiece | None:
        """One Gemini event's ``data`` in, the OpenAI SSE events to relay out, as one
        piece (their bytes together, with each one's settlement summary): what the
        adapter yields to the relay. None when the event changed no choice. A failure
        is raised as the facts the failure table reads."""
        try:
            return piece(self.feed(decode_stream_event(data)))
        except GeminiError as exc:
            raise as_attempt_failed(exc) from exc

    def end(self) -> StreamPiece | None:
        """At the upstream's end of stream: the usage event and ``[DONE]`` when the stream
        is complete; nothing when it was cut, so the relay sees a stream that ended
        without usage or ``[DONE]`` (its row stays pending, its hold reserved, until reconciled)."""
        return last_piece(self.close()) if self.complete else None

    def _candidate(self, index: int, candidate: g.Candidate) -> list[ChatCompletionChunk]:
        state = self.choices.setdefault(index, _ChoiceState())
        if state.finish is not None:
            message = "The upstream provider continued a candidate after it finished."
            raise protocol_error(message, f"candidate {index} after finishReason")
        text, calls = parts_of(candidate)
        out: list[ChatCompletionChunk] = []
        delta = self._delta(index, state, text, calls)
        if delta is not None:
            out.append(self._chunk([ChunkChoice(delta=delta, finish_reason=None, index=index)]))
        if candidate.finish_reason is not None:
            state.finish = finish_reason(candidate.finish_reason, tool_calls=state.tool_calls > 0)
            finish = Delta() if state.started else Delta(role="assistant")
            state.started = True
            out.append(
                self._chunk([ChunkChoice(delta=finish, finish_reason=state.finish, index=index)])
            )
        return out

    def _delta(
        self,
        index: int,
        state: _ChoiceState,
        text: str | None,
        calls: list[Call],
    ) -> Delta | None:
        if text is None and not calls:
            return None
        deltas = [
            ToolCallDelta(
                index=state.tool_calls + k,
                id=call_id(call, self.completion_id, index, state.tool_calls + k),
                type="function",
                function={"name": call[0].name, "arguments": args_json(call)},
            )
            for k, call in enumerate(calls)
        ]
        state.tool_calls += len(calls)
        delta = Delta(
            content=UNSET if text is None else text,
            role=UNSET if state.started else "assistant",
            tool_calls=deltas or UNSET,
        )
        state.started = True
        return delta

    def _chunk(
        self, choices: list[ChunkChoice], *, usage: Usage | UnsetType = UNSET
    ) -> ChatCompletionChunk:
        return chunk(self.completion_id, self.created, self.model, choices, usage)
