"""Stream chunk in: Anthropic's Messages stream (``message_start``,
``content_block_*``, ``message_delta`` with usage, ``ping``, ``error``) → OpenAI's
``chat.completion.chunk`` events at choice index 0 (a fan-out branch's chunks are moved
to the branch's index by the merge)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from msgspec import UNSET, UnsetType

from ncap.protocol import anthropic as a
from ncap.protocol.responses import (
    ChatCompletionChunk,
    ChunkChoice,
    Delta,
    FinishReason,
    ToolCallDelta,
    Usage,
)
from ncap.providers.anthropic_errors import stream_failure
from ncap.providers.anthropic_request import Shape
from ncap.providers.anthropic_response import finish_reason, usage_of
from ncap.providers.base import AttemptFailed
from ncap.providers.openai_side import chunk, last_piece, piece
from ncap.streaming.sse import StreamPiece

__all__ = ["AnthropicStream"]

_decode_event = msgspec.json.Decoder(a.StreamEvent).decode


@dataclass(slots=True)
class _Block:
    kind: str  # text, tool (a tool call of the client's), json (the forced tool), other
    tool_index: int = -1


@dataclass(slots=True)
class AnthropicStream:
    """Anthropic stream events in, OpenAI chunks out (choice index 0: a fan-out branch's
    chunks are moved to the branch's index by the merge)."""

    completion_id: str
    created: int
    model: str
    shape: Shape = field(default_factory=Shape)
    blocks: dict[int, _Block] = field(default_factory=dict)
    tool_calls: int = 0
    input_usage: a.AnthropicUsage | None = None
    output_tokens: int | None = None
    finish: FinishReason | None = None
    stopped: bool = False
    provider_request_id: str | None = None  # from the response head

    def events(self, data: bytes) -> StreamPiece | None:
        """One Anthropic event's ``data`` in, the OpenAI SSE events to relay out, as one
        piece (None when the event changed no choice)."""
        try:
            event = _decode_event(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise AttemptFailed("protocol", 200, detail=f"unreadable stream event: {exc}") from exc
        return piece(self.feed(event))

    def feed(self, event: a.StreamEvent) -> list[ChatCompletionChunk]:
        handler = _HANDLERS.get(event.type)
        if event.type == "error":
            raise stream_failure(event.error)
        return handler(self, event) if handler is not None else []  # ping, unknown

    def end(self) -> StreamPiece | None:
        """At the upstream's end: the usage chunk and ``[DONE]`` once ``message_stop``
        arrived; nothing for a cut stream (it settles as pending)."""
        if not self.stopped:
            return None
        usage = self.usage
        return last_piece([self._chunk([], usage=usage)] if usage is not None else [])

    @property
    def usage(self) -> Usage | None:
        if self.input_usage is None:
            return None
        reported = msgspec.structs.replace(self.input_usage, output_tokens=self.output_tokens)
        return usage_of(reported)

    def _start(self, event: a.StreamEvent) -> list[ChatCompletionChunk]:
        msg = event.message
        if msg is not None:
            self.input_usage = msg.usage
            if msg.usage is not None:
                self.output_tokens = msg.usage.output_tokens
        return [self._delta(Delta(role="assistant", content=""))]

    def _block_start(self, event: a.StreamEvent) -> list[ChatCompletionChunk]:
        block = event.content_block
        index = event.index if event.index is not None else len(self.blocks)
        if block is None or block.type != "tool_use":
            kind = "text" if block is not None and block.type == "text" else "other"
            self.blocks[index] = _Block(kind)
            text = block.text if block is not None and kind == "text" else None
            return [self._delta(Delta(content=text))] if text else []
        if block.name == self.shape.json_tool:
            self.blocks[index] = _Block("json")
            return []
        self.blocks[index] = _Block("tool", self.tool_calls)
        self.tool_calls += 1
        call = ToolCallDelta(
            index=self.blocks[index].tool_index,
            id=block.id or f"call_{index}",
            type="function",
            function={"name": block.name or "", "arguments": ""},
        )
        return [self._delta(Delta(tool_calls=[call]))]

    def _block_delta(self, event: a.StreamEvent) -> list[ChatCompletionChunk]:
        delta = event.delta
        block = self.blocks.get(event.index if event.index is not None else -1)
        if delta is None or block is None:
            return []
        if delta.type == "text_delta" and block.kind == "text" and delta.text:
            return [self._delta(Delta(content=delta.text))]
        if delta.type != "input_json_delta" or not delta.partial_json:
            return []  # thinking, signatures, citations: not relayed
        if block.kind == "json":
            return [self._delta(Delta(content=delta.partial_json))]
        if block.kind == "tool":
            call = ToolCallDelta(index=block.tool_index, function={"arguments": delta.partial_json})
            return [self._delta(Delta(tool_calls=[call]))]
        return []

    def _message_delta(self, event: a.StreamEvent) -> list[ChatCompletionChunk]:
        usage = event.usage
        if usage is not None:
            self.output_tokens = usage.output_tokens
            if usage.input_tokens is not None:  # newer API versions repeat the input
                self.input_usage = usage
        if event.delta is None or event.delta.stop_reason is None:
            return []
        self.finish = finish_reason(event.delta.stop_reason, self.shape)
        choice = ChunkChoice(delta=Delta(), finish_reason=self.finish, index=0)
        return [self._chunk([choice])]

    def _stop(self, _: a.StreamEvent) -> list[ChatCompletionChunk]:
        if self.finish is None:
            raise AttemptFailed(
                "protocol", 200, detail="message_stop before a stop reason", partial=True
            )
        self.stopped = True
        return []

    def _delta(self, delta: Delta) -> ChatCompletionChunk:
        return self._chunk([ChunkChoice(delta=delta, finish_reason=None, index=0)])

    def _chunk(
        self, choices: list[ChunkChoice], *, usage: Usage | UnsetType = UNSET
    ) -> ChatCompletionChunk:
        return chunk(self.completion_id, self.created, self.model, choices, usage)


_HANDLERS = {
    "message_start": AnthropicStream._start,
    "content_block_start": AnthropicStream._block_start,
    "content_block_delta": AnthropicStream._block_delta,
    "message_delta": AnthropicStream._message_delta,
    "message_stop": AnthropicStream._stop,
}
