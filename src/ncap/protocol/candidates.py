"""What the gateway reads of the candidates themselves, to compare them (and nothing
else): each choice's index, its text (chat ``message.content`` / ``delta.content``,
legacy ``text``) and its tool calls' names and arguments. Decoded only for answers of
two or more candidates, and only into ``ncap.domain.evidence``'s hashes; lenient
(unknown fields ignored, every field optional). Decoded JSON holds no reference cycle,
so none of these is tracked by the cyclic garbage collector (``gc=False``: a stream
decodes one per chunk)."""

from __future__ import annotations

import msgspec

from ncap.protocol.responses import ResponseSummary, SummaryChoice

__all__ = ["CandidateChoice", "CandidateSummary", "CandidatesWire", "ChoiceWire"]


class FunctionWire(msgspec.Struct, gc=False):
    name: str | None = None
    arguments: str | None = None


class ToolCallWire(msgspec.Struct, gc=False):
    index: int | None = None  # in a stream's delta: which call of the choice
    function: FunctionWire | None = None


class MessageWire(msgspec.Struct, gc=False):
    """A whole answer's ``message`` or a chunk's ``delta``."""

    content: str | None = None
    tool_calls: list[ToolCallWire] | None = None


class ChoiceWire(msgspec.Struct, gc=False):
    index: int | None = None
    message: MessageWire | None = None
    delta: MessageWire | None = None
    text: str | None = None  # the legacy completions endpoint


class CandidatesWire(msgspec.Struct, gc=False):
    """A chat.completion, a chat.completion.chunk or a text_completion, either whole."""

    choices: list[ChoiceWire] = []


class CandidateChoice(SummaryChoice, gc=False):
    """A stream chunk's choice as settlement reads it, with what the candidates'
    evidence reads of it too."""

    delta: MessageWire | None = None
    text: str | None = None  # the legacy completions endpoint


class CandidateSummary(ResponseSummary, gc=False):
    """``ResponseSummary`` and the candidates' text in one decode: what a stream of two
    or more candidates is read into (``EventSplitter.read_candidates``)."""

    # msgspec copies a mutable default per instance
    choices: list[CandidateChoice] = []  # type: ignore[assignment]  # noqa: RUF012
