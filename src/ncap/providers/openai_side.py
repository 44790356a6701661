"""The OpenAI side of every translated pair: what each translator reads of an OpenAI
chat request the same way (fields it must refuse, text, data URLs, tool arguments) and
how each writes OpenAI's answer (chunks, SSE pieces, settlement summaries)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from ncap.errors import InvalidValue
from ncap.protocol.chat import ChatCompletionRequest, TextContent
from ncap.protocol.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    ResponseSummary,
    Usage,
)
from ncap.protocol.validate import CHAT_FIELDS
from ncap.providers.base import RequestKind
from ncap.streaming.sse import DONE, StreamPiece, encode_event

__all__ = [
    "DATA_URL",
    "Refusal",
    "chat_request",
    "chunk",
    "given",
    "json_object",
    "last_piece",
    "legacy_refusals",
    "output_refusals",
    "piece",
    "refuse",
    "sampling_refusals",
    "summarize",
    "text_of",
    "unsupported",
]

_T = TypeVar("_T")
_encode = msgspec.json.Encoder().encode

DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)(?:;[^,;]*)*;base64,(.*)$", re.DOTALL)
"""A base64 data URL: group 1 its media type, group 2 its data."""

Refusal = tuple[bool, str, str]
"""(refused, the field, what it is in a sentence)."""


def chat_request(
    body: Mapping[str, Any], kind: RequestKind, upstream: str
) -> ChatCompletionRequest:
    """The chat request in the OpenAI body the lifecycle routed: the route's allow-listed
    extras have no meaning upstream and are not sent; the legacy endpoint is refused."""
    if kind != "chat":
        raise InvalidValue(
            f"{upstream} routes serve /v1/chat/completions only, not the legacy /v1/completions.",
            param="model",
        )
    fields = {k: v for k, v in body.items() if k in CHAT_FIELDS}
    try:
        return msgspec.convert(fields, ChatCompletionRequest)
    except msgspec.ValidationError as exc:  # validated at the edge; kept for safety
        raise InvalidValue(f"The request cannot be sent to {upstream}: {exc}") from None


def given(value: _T | UnsetType | None) -> _T | UnsetType:
    """OpenAI's ``null`` and an absent field mean the same here: not set."""
    return UNSET if value is None else value


def text_of(content: TextContent) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def unsupported(param: str, what: str, upstream: str) -> InvalidValue:
    return InvalidValue(f"{what} is not supported on {upstream} routes.", param=param)


def refuse(checks: Iterable[Refusal], upstream: str) -> None:
    """A 400 naming the first refused field, in the order the checks are given."""
    for refused, param, what in checks:
        if refused:
            raise unsupported(param, what, upstream)


def sampling_refusals(req: ChatCompletionRequest) -> list[Refusal]:
    """Fields that change how tokens are drawn, which no translated upstream honours."""
    return [
        (bool(given(req.logit_bias)), "logit_bias", "logit_bias"),
        (req.logprobs is True, "logprobs", "logprobs"),
    ]


def output_refusals(req: ChatCompletionRequest) -> list[Refusal]:
    """Outputs and options only OpenAI's own models have."""
    return [
        (given(req.audio) is not UNSET, "audio", "Audio output"),
        (
            isinstance(req.modalities, list) and "audio" in req.modalities,
            "modalities",
            "Audio output",
        ),
        (given(req.prediction) is not UNSET, "prediction", "Predicted outputs"),
        (req.web_search_options is not UNSET, "web_search_options", "web_search_options"),
        (given(req.reasoning_effort) is not UNSET, "reasoning_effort", "reasoning_effort"),
        (given(req.verbosity) is not UNSET, "verbosity", "verbosity"),
        (given(req.moderation) is not UNSET, "moderation", "moderation"),
    ]


def legacy_refusals(req: ChatCompletionRequest) -> list[Refusal]:
    """The legacy ``functions`` fields (tools replaced them)."""
    return [
        (req.functions is not UNSET, "functions", "The legacy functions field (use tools)"),
        (req.function_call is not UNSET, "function_call", "The legacy function_call field"),
    ]


def json_object(raw: str, param: str) -> dict[str, Any]:
    """Tool call arguments as the object they must be (empty text: no arguments)."""
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidValue("Tool call arguments must be a JSON object.", param=param)
    return value


def summarize(obj: ChatCompletion | ChatCompletionChunk) -> ResponseSummary:
    """The settlement view (ids, indexes, finish reasons, usage) of what a translator
    produced, without encoding and decoding it again."""
    return msgspec.convert(msgspec.to_builtins(obj), ResponseSummary)


def chunk(
    completion_id: str,
    created: int,
    model: str,
    choices: list[ChunkChoice],
    usage: Usage | UnsetType = UNSET,
) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        id=completion_id, choices=choices, created=created, model=model, usage=usage
    )


def piece(chunks: list[ChatCompletionChunk]) -> StreamPiece | None:
    """Chunks as the SSE events of one piece (their bytes together, with each one's
    summary); None for no chunk."""
    if not chunks:
        return None
    raw = b"".join(encode_event(_encode(c)) for c in chunks)
    return StreamPiece(raw, [summarize(c) for c in chunks])


def last_piece(chunks: list[ChatCompletionChunk]) -> StreamPiece:
    """A completed stream's last piece: its final chunks (usage), then ``[DONE]``."""
    last = piece(chunks)
    if last is None:
        return StreamPiece(DONE, [], done=True)
    return StreamPiece(last.raw + DONE, last.summaries, done=True)
