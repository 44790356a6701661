"""Anthropic Messages API wire shapes, as far as the gateway reads them: the response
(``POST /v1/messages``), its stream events and its error envelope.

Decoding is lenient about fields the gateway does not read (Anthropic adds fields over
time), strict about the ones it does: a block without its ``type`` is a protocol error.
The request is built as plain JSON by the translator (``providers.openai_anthropic``).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "AnthropicErrorBody",
    "AnthropicErrorEnvelope",
    "AnthropicUsage",
    "ContentBlock",
    "Message",
    "StreamEvent",
]


class AnthropicUsage(msgspec.Struct, kw_only=True):
    """Input tokens exclude the cached ones: read and written cache tokens are their own
    counts (``cache_read_input_tokens``, ``cache_creation_input_tokens``)."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class ContentBlock(msgspec.Struct, kw_only=True):
    """One content block: ``text`` (text), ``tool_use`` (id, name, input), or another
    kind (``thinking``, …) the translator does not relay."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None


class Message(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str = ""
    content: list[ContentBlock] = []
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage | None = None


class Delta(msgspec.Struct, kw_only=True):
    """``content_block_delta``'s delta (text_delta, input_json_delta, …) or
    ``message_delta``'s (stop_reason)."""

    type: str | None = None
    text: str | None = None
    partial_json: str | None = None
    stop_reason: str | None = None
    stop_sequence: str | None = None


class AnthropicErrorBody(msgspec.Struct, kw_only=True):
    type: str = "api_error"
    message: str = ""


class AnthropicErrorEnvelope(msgspec.Struct, kw_only=True):
    type: str = "error"
    error: AnthropicErrorBody
    request_id: str | None = None


class StreamEvent(msgspec.Struct, kw_only=True):
    """One SSE event's data; which fields are set depends on ``type``."""

    type: str
    message: Message | None = None
    index: int | None = None
    content_block: ContentBlock | None = None
    delta: Delta | None = None
    usage: AnthropicUsage | None = None
    error: AnthropicErrorBody | None = None
