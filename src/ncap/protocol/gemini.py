"""Wire shapes of the Gemini API's ``generateContent`` and ``streamGenerateContent``.

Mirrors the v1beta REST reference, https://ai.google.dev/api/generate-content
(``GenerateContentRequest``, ``GenerationConfig``, ``GenerateContentResponse``,
``Candidate``, ``UsageMetadata``, ``FinishReason``), https://ai.google.dev/api/caching
(``Content``, ``Part``, ``Tool``, ``FunctionDeclaration``, ``ToolConfig``) and Google's
error model, https://ai.google.dev/gemini-api/docs/troubleshooting (``google.rpc.Status``
in an ``{"error": …}`` envelope). Fields are in the reference's order, snake_case here
and camelCase on the wire (``rename="camel"``). Only the fields ncap reads or writes are
declared.

A stream (``:streamGenerateContent?alt=sse``) is a sequence of ``data:`` events, each a
whole ``GenerateContentResponse`` holding the new parts of some candidates, each
candidate naming its ``index``; there is no ``[DONE]`` marker.

Conventions:

- Request structs (what ncap sends) default to ``UNSET``, so only what was set is
  written.
- Response structs (what ncap reads) ignore unknown fields: Google adds output fields
  without notice, and a new field must not break decoding. Proto3's JSON mapping omits
  zero values, which is why ``Candidate.index`` and the token counts may be absent.

No behaviour here: ``ncap.providers.openai_gemini`` translates.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

__all__ = [
    "Blob",
    "Candidate",
    "Content",
    "ErrorDetail",
    "FileData",
    "FinishReason",
    "FunctionCall",
    "FunctionCallingConfig",
    "FunctionDeclaration",
    "FunctionResponse",
    "GenerateContentRequest",
    "GenerateContentResponse",
    "GenerationConfig",
    "GoogleError",
    "GoogleErrorEnvelope",
    "Part",
    "PromptFeedback",
    "ResponseContent",
    "ResponseFunctionCall",
    "ResponsePart",
    "ThinkingConfig",
    "Tool",
    "ToolConfig",
    "UsageMetadata",
]

# FinishReason enum, in the reference's order (a str on the wire: new values may appear)
FinishReason = Literal[
    "FINISH_REASON_UNSPECIFIED",
    "STOP",
    "MAX_TOKENS",
    "SAFETY",
    "RECITATION",
    "LANGUAGE",
    "OTHER",
    "BLOCKLIST",
    "PROHIBITED_CONTENT",
    "SPII",
    "MALFORMED_FUNCTION_CALL",
    "IMAGE_SAFETY",
    "IMAGE_PROHIBITED_CONTENT",
    "IMAGE_OTHER",
    "NO_IMAGE",
    "IMAGE_RECITATION",
    "UNEXPECTED_TOOL_CALL",
    "TOO_MANY_TOOL_CALLS",
    "MISSING_THOUGHT_SIGNATURE",
]


class _Out(msgspec.Struct, rename="camel", kw_only=True, gc=False):
    """What ncap sends: camelCase, unset fields left out."""


class _In(msgspec.Struct, rename="camel", kw_only=True, gc=False):
    """What ncap reads: camelCase, unknown fields ignored."""


# --- request: Content and Part ---


class Blob(_Out):
    mime_type: str
    data: str  # base64


class FileData(_Out, kw_only=True):
    mime_type: str | UnsetType = UNSET
    file_uri: str


class FunctionCall(_Out, kw_only=True):
    id: str | UnsetType = UNSET
    name: str
    args: dict[str, Any] | UnsetType = UNSET


class FunctionResponse(_Out, kw_only=True):
    id: str | UnsetType = UNSET
    name: str
    response: dict[str, Any]


class Part(_Out):
    """One part; exactly one of the data fields (``text`` … ``file_data``) is set."""

    thought: bool | UnsetType = UNSET
    thought_signature: str | UnsetType = UNSET
    text: str | UnsetType = UNSET
    inline_data: Blob | UnsetType = UNSET
    function_call: FunctionCall | UnsetType = UNSET
    function_response: FunctionResponse | UnsetType = UNSET
    file_data: FileData | UnsetType = UNSET


class Content(_Out):
    parts: list[Part]
    role: Literal["user", "model"] | UnsetType = UNSET


# --- request: tools ---


class FunctionDeclaration(_Out):
    name: str
    description: str | UnsetType = UNSET
    # JSON Schema as OpenAI's tools carry it (``parameters`` takes Google's OpenAPI subset)
    parameters_json_schema: dict[str, Any] | UnsetType = UNSET


class Tool(_Out):
    function_declarations: list[FunctionDeclaration]


class FunctionCallingConfig(_Out):
    mode: Literal["MODE_UNSPECIFIED", "AUTO", "ANY", "NONE", "VALIDATED"]
    allowed_function_names: list[str] | UnsetType = UNSET


class ToolConfig(_Out):
    function_calling_config: FunctionCallingConfig


# --- request: generation config ---


class ThinkingConfig(_Out):
    include_thoughts: bool | UnsetType = UNSET
    thinking_budget: int | UnsetType = UNSET
    thinking_level: str | UnsetType = UNSET


class GenerationConfig(_Out):
    stop_sequences: list[str] | UnsetType = UNSET
    response_mime_type: str | UnsetType = UNSET
    response_schema: dict[str, Any] | UnsetType = UNSET
    response_json_schema: dict[str, Any] | UnsetType = UNSET
    candidate_count: int | UnsetType = UNSET
    max_output_tokens: int | UnsetType = UNSET
    temperature: float | UnsetType = UNSET
    top_p: float | UnsetType = UNSET
    top_k: int | UnsetType = UNSET
    seed: int | UnsetType = UNSET
    presence_penalty: float | UnsetType = UNSET
    frequency_penalty: float | UnsetType = UNSET
    thinking_config: ThinkingConfig | UnsetType = UNSET


class GenerateContentRequest(_Out):
    """The body of ``POST /v1beta/models/{model}:generateContent`` (the model is in the
    path)."""

    contents: list[Content]
    tools: list[Tool] | UnsetType = UNSET
    tool_config: ToolConfig | UnsetType = UNSET
    system_instruction: Content | UnsetType = UNSET
    generation_config: GenerationConfig | UnsetType = UNSET
    cached_content: str | UnsetType = UNSET


# --- response ---


class ResponseFunctionCall(_In):
    id: str | None = None
    name: str = ""
    args: dict[str, Any] | None = None


class ResponsePart(_In):
    thought: bool | None = None
    thought_signature: str | None = None
    text: str | None = None
    function_call: ResponseFunctionCall | None = None


class ResponseContent(_In):
    parts: list[ResponsePart] = []
    role: str | None = None


class Candidate(_In):
    """``content`` is absent when the candidate was blocked (``finishReason: SAFETY``);
    ``index`` is absent when it is 0 (proto3 JSON omits zero values)."""

    content: ResponseContent | None = None
    finish_reason: str | None = None
    safety_ratings: list[dict[str, Any]] | None = None
    token_count: int | None = None
    avg_logprobs: float | None = None
    index: int | None = None
    finish_message: str | None = None


class PromptFeedback(_In):
    block_reason: str | None = None
    safety_ratings: list[dict[str, Any]] | None = None


class UsageMetadata(_In):
    """``promptTokenCount`` includes ``cachedContentTokenCount``; ``candidatesTokenCount``
    is summed over all candidates and excludes ``thoughtsTokenCount``."""

    prompt_token_count: int | None = None
    cached_content_token_count: int | None = None
    candidates_token_count: int | None = None
    tool_use_prompt_token_count: int | None = None
    thoughts_token_count: int | None = None
    total_token_count: int | None = None


class GenerateContentResponse(_In):
    """A whole ``generateContent`` answer, or one event of a stream."""

    candidates: list[Candidate] = []
    prompt_feedback: PromptFeedback | None = None
    usage_metadata: UsageMetadata | None = None
    model_version: str | None = None
    response_id: str | None = None


# --- errors (google.rpc.Status) ---


class ErrorDetail(_In):
    """One entry of ``details``; ``@type`` names the kind (``RetryInfo``, ``ErrorInfo``)."""

    type: str | None = msgspec.field(default=None, name="@type")
    reason: str | None = None
    retry_delay: str | None = None


class GoogleError(_In):
    code: int | None = None
    message: str = ""
    status: str | None = None
    details: list[ErrorDetail] = []


class GoogleErrorEnvelope(_In):
    error: GoogleError
