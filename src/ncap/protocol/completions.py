"""Wire shapes of the legacy ``POST /v1/completions``: the request, and the
``text_completion`` object (whole, or one per streamed chunk).

Mirrors ``CreateCompletionRequest`` of OpenAI's OpenAPI description (API version
2.3.0), https://platform.openai.com/docs/api-reference/completions/create, fields
in the reference's order, with the conventions of ``ncap.protocol.chat``.

``prompt`` is one of a string, an array of strings, an array of token ids or an
array of token-id arrays; msgspec unions hold one array type only, so the struct
accepts an array of any of those items and ``ncap.protocol.validate`` rejects
mixed arrays.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, UnsetType

from ncap.protocol.chat import (
    CandidateCount,
    ChatCompletionStreamOptions,
    LogitBias,
    Penalty,
    Seed,
    Stop,
    Temperature,
    TopP,
)
from ncap.protocol.responses import Usage

__all__ = ["CompletionRequest", "LegacyLogprobs", "PromptItem", "TextChoice", "TextCompletion"]

PromptItem = str | int | Annotated[list[int], Meta(min_length=1)]


class CompletionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """The 18 body fields of ``CreateCompletionRequest``, in the reference's order."""

    model: str
    prompt: str | list[PromptItem] | None
    best_of: Annotated[int, Meta(ge=0, le=20)] | UnsetType | None = UNSET
    echo: bool | UnsetType | None = UNSET
    frequency_penalty: Penalty | UnsetType | None = UNSET
    logit_bias: LogitBias | UnsetType | None = UNSET
    logprobs: Annotated[int, Meta(ge=0, le=5)] | UnsetType | None = UNSET
    max_tokens: Annotated[int, Meta(ge=0)] | UnsetType | None = UNSET
    n: CandidateCount | UnsetType | None = UNSET
    presence_penalty: Penalty | UnsetType | None = UNSET
    seed: Seed | UnsetType | None = UNSET
    stop: Stop | UnsetType | None = UNSET
    stream: bool | UnsetType | None = UNSET
    stream_options: ChatCompletionStreamOptions | UnsetType | None = UNSET
    suffix: str | UnsetType | None = UNSET
    temperature: Temperature | UnsetType | None = UNSET
    top_p: TopP | UnsetType | None = UNSET
    user: str | UnsetType = UNSET


# --- the response: ``text_completion`` (streamed as one such object per chunk) ---


class LegacyLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class TextChoice(msgspec.Struct):
    text: str
    index: int
    logprobs: LegacyLogprobs | None
    finish_reason: str | None


class TextCompletion(msgspec.Struct):
    id: str
    choices: list[TextChoice]
    created: int
    model: str
    object: str = "text_completion"
    usage: Usage | UnsetType | None = UNSET
