"""Response wire shapes: chat.completion, chat.completion.chunk, usage, error envelope.

Mirrors ``CreateChatCompletionResponse`` / ``CreateChatCompletionStreamResponse`` of
OpenAI's OpenAPI description (fields in its order). No behaviour, no I/O. Optional
fields default to ``UNSET`` so that encoding writes only what was set.

The ``*Summary`` structs are the gateway's view of an upstream body: the few fields it
needs for settlement (ids, choice indexes, finish reasons, usage), decoded without
materialising message text.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "Choice",
    "ChoiceLogprobs",
    "ChunkChoice",
    "CompletionTokensDetails",
    "Delta",
    "ErrorBody",
    "ErrorEnvelope",
    "Message",
    "PromptTokensDetails",
    "ResponseSummary",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
]

FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


class _Wire(msgspec.Struct):
    """Fields set to ``UNSET`` are left out; every other field is written, defaults
    included (``object``, ``role``, ``logprobs.refusal`` are required by the reference)."""


class TopLogprob(_Wire):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Wire):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Wire):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class FunctionCall(_Wire):
    name: str
    arguments: str


class ToolCall(_Wire):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(_Wire):
    content: str | None
    refusal: str | None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET
    annotations: list[Any] | UnsetType = UNSET


class Choice(_Wire):
    finish_reason: FinishReason
    index: int
    message: Message
    logprobs: ChoiceLogprobs | None


class PromptTokensDetails(_Wire):
    cached_tokens: int = 0
    audio_tokens: int | UnsetType = UNSET
    # prompt tokens written to the provider's cache (Anthropic's
    # ``cache_creation_input_tokens``), where the provider reports them
    cache_write_tokens: int | UnsetType = UNSET


class CompletionTokensDetails(_Wire):
    reasoning_tokens: int = 0
    audio_tokens: int | UnsetType = UNSET
    accepted_prediction_tokens: int | UnsetType = UNSET
    rejected_prediction_tokens: int | UnsetType = UNSET


class Usage(_Wire):
    completion_tokens: int
    prompt_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET


class ChatCompletion(_Wire):
    id: str
    choices: list[Choice]
    created: int
    model: str
    object: Literal["chat.completion"] = "chat.completion"
    service_tier: str | UnsetType = UNSET
    system_fingerprint: str | UnsetType = UNSET
    usage: Usage | UnsetType = UNSET


class ToolCallDelta(_Wire):
    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: dict[str, str] | UnsetType = UNSET


class Delta(_Wire):
    content: str | UnsetType | None = UNSET
    refusal: str | UnsetType | None = UNSET
    role: Literal["assistant"] | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChunkChoice(_Wire):
    delta: Delta
    finish_reason: FinishReason | None
    index: int
    logprobs: ChoiceLogprobs | UnsetType | None = UNSET


class ChatCompletionChunk(_Wire):
    id: str
    choices: list[ChunkChoice]
    created: int
    model: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    service_tier: str | UnsetType = UNSET
    system_fingerprint: str | UnsetType = UNSET
    usage: Usage | UnsetType | None = UNSET


class ErrorBody(_Wire):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(_Wire):
    error: ErrorBody


# --- what the gateway reads of an upstream body (lenient: unknown fields ignored) ---
# Not tracked by the cyclic garbage collector (``gc=False``): decoded JSON and the
# translators' summaries hold no reference cycle, and a stream makes one per chunk.


class _SummaryUsageDetails(msgspec.Struct, gc=False):
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    cache_write_tokens: int | None = None


SummaryUsageDetails = _SummaryUsageDetails  # built by the local engine's summaries


class SummaryUsage(msgspec.Struct, gc=False):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    prompt_tokens_details: _SummaryUsageDetails | None = None
    completion_tokens_details: _SummaryUsageDetails | None = None


class SummaryChoice(msgspec.Struct, gc=False):
    index: int | None = None
    finish_reason: str | None = None


class ResponseSummary(msgspec.Struct, gc=False):
    """Settlement fields of a chat.completion or a chat.completion.chunk."""

    id: str | None = None
    choices: list[SummaryChoice] = []
    usage: SummaryUsage | None = None
