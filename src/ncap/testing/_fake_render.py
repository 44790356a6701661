"""Wire bytes of the fake upstream, shaped and ordered like OpenAI's own responses.

Local structs rather than ``ncap.protocol.responses``: the fake must emit every field
OpenAI emits (``object``, ``role``, zero token details), which the gateway's structs
omit when they equal their defaults. Stream chunks share one precomputed prefix and
suffix per response, so a chunk costs one small encode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from ncap.testing._fake_content import ChoiceText

__all__ = [
    "SERIAL_MARK",
    "Events",
    "Generation",
    "Template",
    "UsageMode",
    "chat_body",
    "chat_events",
    "text_body",
    "text_events",
]

UsageMode = Literal["separate", "with_choices", "none"]
_FINGERPRINT = "fp_ncapfake"
SERIAL_MARK = "@@serial@@"  # stands for the id's serial in a Template
_DONE = b"data: [DONE]\n\n"
_ENCODE = msgspec.json.Encoder().encode


class _Wire(msgspec.Struct, kw_only=True):
    pass


class _PromptDetails(_Wire, kw_only=True):
    cached_tokens: int
    audio_tokens: int = 0


class _CompletionDetails(_Wire, kw_only=True):
    reasoning_tokens: int
    audio_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class _Usage(_Wire, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: _PromptDetails
    completion_tokens_details: _CompletionDetails


class _Function(_Wire, kw_only=True):
    name: str | UnsetType = UNSET
    arguments: str


class _ToolCall(_Wire, kw_only=True):
    index: int | UnsetType = UNSET  # in a stream's delta only
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: _Function


class _Message(_Wire, kw_only=True):
    role: str = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[_ToolCall] | UnsetType = UNSET
    annotations: list[Any] = []


class _Choice(_Wire, kw_only=True):
    index: int
    message: _Message
    logprobs: None = None
    finish_reason: str


class _Delta(_Wire, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    refusal: UnsetType | None = UNSET
    tool_calls: list[_ToolCall] | UnsetType = UNSET


class _ChunkChoice(_Wire, kw_only=True):
    index: int
    delta: _Delta
    logprobs: None = None
    finish_reason: str | None


class _TextChoice(_Wire, kw_only=True):
    text: str
    index: int
    logprobs: None = None
    finish_reason: str | None


class _Envelope(_Wire, kw_only=True):
    """chat.completion, chat.completion.chunk or text_completion (choices vary)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: _Usage | UnsetType | None = UNSET
    service_tier: str | UnsetType = UNSET
    system_fingerprint: str = _FINGERPRINT


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    """What one request produced; ``extra_completion_tokens`` are billed but not
    returned (legacy ``best_of`` candidates, hidden reasoning)."""

    id: str
    created: int
    model: str
    choices: list[ChoiceText]
    prompt_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    extra_completion_tokens: int = 0

    def usage(self) -> _Usage:
        visible = sum(len(choice.pieces) for choice in self.choices)
        completion = visible + self.reasoning_tokens + self.extra_completion_tokens
        return _Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
            prompt_tokens_details=_PromptDetails(
                cached_tokens=min(self.cached_tokens, self.prompt_tokens)
            ),
            completion_tokens_details=_CompletionDetails(reasoning_tokens=self.reasoning_tokens),
        )


class Events(msgspec.Struct, frozen=True):
    """SSE events of one stream; ``first_content`` and ``first_finish`` are positions
    in ``data`` that the stream faults cut or insert at."""

    data: list[bytes]
    first_content: int
    first_finish: int


class Template(msgspec.Struct, frozen=True):
    """A rendered answer with its id serial and ``created`` left open, so that a repeated
    request costs one join instead of a generation and an encode."""

    head: bytes
    middle: bytes
    tail: bytes

    @classmethod
    def split(cls, body: bytes) -> Template:
        """``body`` was rendered with ``SERIAL_MARK`` in its id and ``created`` 0; both
        precede every user-supplied string, so the first matches are the fields."""
        head, mark, rest = body.partition(SERIAL_MARK.encode())
        middle, created, tail = rest.partition(b'"created":0,')
        if not (mark and created):
            raise ValueError("body was not rendered for a template")
        return cls(head, middle + b'"created":', b"," + tail)

    def render(self, serial: int, created: int) -> bytes:
        return b"%b%d%b%d%b" % (self.head, serial, self.middle, created, self.tail)


def chat_body(gen: Generation, *, with_usage: bool) -> bytes:
    choices = [
        _Choice(index=i, message=_message(i, choice), finish_reason=choice.finish_reason)
        for i, choice in enumerate(gen.choices)
    ]
    return _ENCODE(
        _Envelope(
            id=gen.id,
            object="chat.completion",
            created=gen.created,
            model=gen.model,
            choices=choices,
            usage=gen.usage() if with_usage else UNSET,
            service_tier="default",
        )
    )


def _message(i: int, choice: ChoiceText) -> _Message:
    if choice.tool is None:
        return _Message(content=choice.content)
    call = _ToolCall(
        id=f"call_fake_{i}",
        type="function",
        function=_Function(name=choice.tool, arguments=choice.content),
    )
    return _Message(content=None, tool_calls=[call])


def _piece(i: int, choice: ChoiceText, step: int) -> _Delta:
    """A content delta, or for a tool call its arguments' next fragment (the first
    also names the call, as OpenAI streams them)."""
    piece = choice.pieces[step]
    if choice.tool is None:
        return _Delta(content=piece)
    first = step == 0
    call = _ToolCall(
        index=0,
        id=f"call_fake_{i}" if first else UNSET,
        type="function" if first else UNSET,
        function=_Function(name=choice.tool if first else UNSET, arguments=piece),
    )
    return _Delta(tool_calls=[call])


def text_body(gen: Generation, *, with_usage: bool) -> bytes:
    choices = [
        _TextChoice(text=choice.content, index=i, finish_reason=choice.finish_reason)
        for i, choice in enumerate(gen.choices)
    ]
    envelope = _Envelope(
        id=gen.id,
        object="text_completion",
        created=gen.created,
        model=gen.model,
        choices=choices,
        usage=gen.usage() if with_usage else UNSET,
    )
    return _ENCODE(envelope)


def _framing(gen: Generation, obj: str, usage: _Usage | UnsetType | None) -> tuple[bytes, bytes]:
    """(prefix, suffix) around one chunk's choice list, from one encode with no choices."""
    tier: str | UnsetType = "default" if obj == "chat.completion.chunk" else UNSET
    whole = _ENCODE(
        _Envelope(
            id=gen.id,
            object=obj,
            created=gen.created,
            model=gen.model,
            choices=[],
            usage=usage,
            service_tier=tier,
        )
    )
    cut = whole.index(b'"choices":[]') + len(b'"choices":[')
    return b"data: " + whole[:cut], whole[cut:] + b"\n\n"


def _interleave(
    choices: list[ChoiceText],
    content: Callable[[int, int], bytes],
    finish: Callable[[int, str], bytes],
) -> tuple[list[bytes], int]:
    """Round-robin one piece per choice (``content(choice, step)``); a choice's finish
    chunk follows its last piece."""
    out: list[bytes] = []
    first_finish = -1
    for step in range(max((len(c.pieces) for c in choices), default=0) + 1):
        for i, choice in enumerate(choices):
            if step < len(choice.pieces):
                out.append(content(i, step))
            elif step == len(choice.pieces):
                first_finish = len(out) if first_finish < 0 else first_finish
                out.append(finish(i, choice.finish_reason))
    return out, (len(out) if first_finish < 0 else first_finish)


def _usage_tail(gen: Generation, obj: str, mode: UsageMode) -> list[bytes]:
    if mode != "separate":
        return [_DONE]
    prefix, suffix = _framing(gen, obj, gen.usage())
    return [prefix + suffix, _DONE]


def chat_events(gen: Generation, mode: UsageMode) -> Events:
    """Role chunks, interleaved content, per-choice finish, usage (per ``mode``), [DONE]."""
    prefix, suffix = _framing(gen, "chat.completion.chunk", None if mode != "none" else UNSET)

    def chunk(choice: _ChunkChoice) -> bytes:
        return prefix + _ENCODE(choice) + suffix

    roles = [
        chunk(
            _ChunkChoice(
                index=i,
                delta=_Delta(role="assistant", content="", refusal=None),
                finish_reason=None,
            )
        )
        for i in range(len(gen.choices))
    ]
    body, first_finish = _interleave(
        gen.choices,
        lambda i, step: chunk(
            _ChunkChoice(index=i, delta=_piece(i, gen.choices[i], step), finish_reason=None)
        ),
        lambda i, reason: chunk(_ChunkChoice(index=i, delta=_Delta(), finish_reason=reason)),
    )
    if mode == "with_choices" and body:
        last_prefix, last_suffix = _framing(gen, "chat.completion.chunk", gen.usage())
        body[-1] = last_prefix + body[-1][len(prefix) : -len(suffix)] + last_suffix
    data = roles + body + _usage_tail(gen, "chat.completion.chunk", mode)
    return Events(data, len(roles), len(roles) + first_finish)


def text_events(gen: Generation, mode: UsageMode) -> Events:
    """Legacy completions stream: text pieces interleaved, finish on an empty text."""
    prefix, suffix = _framing(gen, "text_completion", None if mode != "none" else UNSET)

    def chunk(i: int, text: str, reason: str | None) -> bytes:
        return prefix + _ENCODE(_TextChoice(text=text, index=i, finish_reason=reason)) + suffix

    body, first_finish = _interleave(
        gen.choices,
        lambda i, step: chunk(i, gen.choices[i].pieces[step], None),
        lambda i, r: chunk(i, "", r),
    )
    if mode == "with_choices" and body:
        last_prefix, last_suffix = _framing(gen, "text_completion", gen.usage())
        body[-1] = last_prefix + body[-1][len(prefix) : -len(suffix)] + last_suffix
    return Events(body + _usage_tail(gen, "text_completion", mode), 0, first_finish)
