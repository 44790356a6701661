"""Per-choice demultiplexing of a ``chat.completion.chunk`` stream.

With ``n > 1`` the deltas of the n completions arrive interleaved, and each delta's
``index`` is the only thing saying which completion it belongs to: code that appends
``choices[0].delta.content`` splices n answers into one string. ``demux`` keeps one
``ChoiceBuffer`` per index instead (one object per choice, not parallel lists).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ncap.client._access import field_of, plain

__all__ = ["ChoiceBuffer", "Demuxed", "StreamError", "ToolCall", "ademux", "demux"]


class StreamError(Exception):
    """The stream carried an error event (e.g. the gateway's upstream failed mid-way)."""

    def __init__(self, error: Any) -> None:
        self.error = plain(error)
        message = field_of(self.error, "message") or "the stream reported an error"
        super().__init__(str(message))


@dataclass(slots=True)
class ToolCall:
    """One tool call of one choice, assembled from the deltas sharing its ``index``."""

    index: int
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str = ""

    def add(self, delta: Any) -> None:
        """Ids and names are sent once (kept, not repeated); arguments arrive in pieces."""
        self.id = self.id or field_of(delta, "id")
        self.type = self.type or field_of(delta, "type")
        function = field_of(delta, "function")
        if function is None:  # a legacy ``function_call`` delta is the function itself
            function = delta
        self.name = self.name or field_of(function, "name")
        self.arguments += field_of(function, "arguments") or ""

    def to_dict(self) -> dict[str, Any]:
        """The tool call as it appears in a non-streamed ``message.tool_calls``."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": self.type or "function", "function": function}


@dataclass(slots=True)
class ChoiceBuffer:
    """Everything one completion (one ``index``) said over the stream."""

    index: int
    role: str | None = None
    content: str | None = None
    refusal: str | None = None
    tool_calls: dict[int, ToolCall] = field(default_factory=dict)
    function_call: ToolCall | None = None  # the deprecated ``functions`` API
    logprobs: list[Any] = field(default_factory=list)
    refusal_logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, choice: Any) -> None:
        """Fold one chunk's ``choices[i]`` (already known to carry this index) in."""
        delta = field_of(choice, "delta")
        if delta is not None:
            self._add_delta(delta)
        logprobs = field_of(choice, "logprobs")
        self.logprobs.extend(field_of(logprobs, "content") or ())
        self.refusal_logprobs.extend(field_of(logprobs, "refusal") or ())
        reason = field_of(choice, "finish_reason")
        if reason is not None:
            self.finish_reason = reason

    def _add_delta(self, delta: Any) -> None:
        self.role = field_of(delta, "role") or self.role
        self.content = _concat(self.content, field_of(delta, "content"))
        self.refusal = _concat(self.refusal, field_of(delta, "refusal"))
        for call in field_of(delta, "tool_calls") or ():
            index = _index(call)
            self.tool_calls.setdefault(index, ToolCall(index)).add(call)
        function_call = field_of(delta, "function_call")
        if function_call is not None:
            self.function_call = self.function_call or ToolCall(0)
            self.function_call.add(function_call)

    def ordered_tool_calls(self) -> list[ToolCall]:
        return [self.tool_calls[i] for i in sorted(self.tool_calls)]

    def to_dict(self) -> dict[str, Any]:
        """The choice in the shape of a non-streamed ``chat.completion`` choice."""
        message: dict[str, Any] = {
            "role": self.role or "assistant",
            "content": self.content,
            "refusal": self.refusal,
        }
        if self.tool_calls:
            message["tool_calls"] = [call.to_dict() for call in self.ordered_tool_calls()]
        if self.function_call is not None:
            fc = self.function_call
            message["function_call"] = {"name": fc.name, "arguments": fc.arguments}
        logprobs = None
        if self.logprobs or self.refusal_logprobs:
            logprobs = {
                "content": [plain(e) for e in self.logprobs] or None,
                "refusal": [plain(e) for e in self.refusal_logprobs] or None,
            }
        return {
            "index": self.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self.finish_reason,
        }


@dataclass(slots=True)
class Demuxed:
    """The n buffers of one stream, keyed on ``index``, and the usage if it arrived."""

    choices: dict[int, ChoiceBuffer] = field(default_factory=dict)
    usage: Any = None
    id: str | None = None
    model: str | None = None

    def add(self, chunk: Any) -> None:
        """Fold one chunk in; usable live, while the stream is still arriving."""
        error = field_of(chunk, "error")
        if error is not None:
            raise StreamError(error)
        self.id = self.id or field_of(chunk, "id")
        self.model = self.model or field_of(chunk, "model")
        for choice in field_of(chunk, "choices") or ():
            index = _index(choice)
            buffer = self.choices.get(index)
            if buffer is None:
                buffer = self.choices[index] = ChoiceBuffer(index)
            buffer.add(choice)
        usage = field_of(chunk, "usage")
        if usage is not None:
            self.usage = usage

    def to_choices(self) -> list[ChoiceBuffer]:
        """The buffers ordered by ``index`` (arrival order says nothing)."""
        return [self.choices[i] for i in sorted(self.choices)]

    @property
    def unfinished(self) -> list[int]:
        """Indexes without a ``finish_reason``: a cut stream, or one still arriving."""
        return [i for i in sorted(self.choices) if self.choices[i].finish_reason is None]


def demux(stream: Iterable[Any]) -> Demuxed:
    """Consume a chunk stream (the SDK's ``Stream`` or dicts) into per-choice buffers."""
    result = Demuxed()
    for chunk in stream:
        result.add(chunk)
    return result


async def ademux(stream: AsyncIterable[Any]) -> Demuxed:
    """``demux`` for an async stream (the SDK's ``AsyncStream``)."""
    result = Demuxed()
    async for chunk in stream:
        result.add(chunk)
    return result


def _index(item: Any) -> int:
    index = field_of(item, "index")
    return int(index) if index is not None else 0


def _concat(have: str | None, more: str | None) -> str | None:
    if more is None:
        return have
    return more if have is None else have + more
