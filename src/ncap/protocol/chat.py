"""Request wire shape of ``POST /v1/chat/completions``.

Mirrors ``CreateChatCompletionRequest`` of OpenAI's OpenAPI description (API
version 2.3.0), https://platform.openai.com/docs/api-reference/chat/create, with
its 37 body fields in the reference's order: first those of
``ModelResponseProperties`` and ``CreateModelResponseProperties`` (which it
``allOf``-includes), then its own. Components keep the reference's schema names.

Conventions:

- Optional fields default to ``UNSET`` (absent); ``None`` is accepted exactly where
  the reference says ``nullable`` (or ``anyOf: [..., null]``).
- Every struct forbids unknown fields; free-form JSON objects (a JSON Schema, a
  function's ``parameters``) stay ``dict[str, Any]``.
- Ranges and lengths the reference states (in the schema or, for ``logit_bias``
  and ``metadata``, in the description) are ``msgspec.Meta`` constraints.
- Unions of objects are tagged on their discriminator (``role`` or ``type``).
  msgspec checks a tag only inside a union, so where the reference allows a
  single kind of object (text-only content) ``type`` is a plain ``Literal`` field.

No behaviour here: cross-field rules live in ``ncap.protocol.validate``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

__all__ = [
    "AssistantAudio",
    "AssistantContentPart",
    "AssistantFunctionCall",
    "CandidateCount",
    "ChatCompletionAllowedTools",
    "ChatCompletionAllowedToolsChoice",
    "ChatCompletionAudioParam",
    "ChatCompletionFunctionCallOption",
    "ChatCompletionFunctions",
    "ChatCompletionMessageCustomToolCall",
    "ChatCompletionMessageToolCall",
    "ChatCompletionNamedToolChoice",
    "ChatCompletionNamedToolChoiceCustom",
    "ChatCompletionRequest",
    "ChatCompletionRequestAssistantMessage",
    "ChatCompletionRequestDeveloperMessage",
    "ChatCompletionRequestFunctionMessage",
    "ChatCompletionRequestMessage",
    "ChatCompletionRequestMessageContentPartAudio",
    "ChatCompletionRequestMessageContentPartFile",
    "ChatCompletionRequestMessageContentPartImage",
    "ChatCompletionRequestMessageContentPartRefusal",
    "ChatCompletionRequestMessageContentPartText",
    "ChatCompletionRequestSystemMessage",
    "ChatCompletionRequestToolMessage",
    "ChatCompletionRequestUserMessage",
    "ChatCompletionStreamOptions",
    "ChatCompletionTool",
    "CustomToolCallInput",
    "CustomToolChatCompletions",
    "CustomToolDefinition",
    "CustomToolFormatGrammar",
    "CustomToolFormatText",
    "CustomToolGrammar",
    "CustomVoice",
    "FileInput",
    "FunctionCallArguments",
    "FunctionObject",
    "ImageUrl",
    "InputAudio",
    "JSONObject",
    "JSONSchema",
    "LogitBias",
    "Metadata",
    "ModerationConfigParam",
    "ModerationParam",
    "ModerationPolicyParam",
    "Penalty",
    "PredictionContent",
    "PromptCacheBreakpointParam",
    "PromptCacheOptionsParam",
    "ResponseFormatJsonObject",
    "ResponseFormatJsonSchema",
    "ResponseFormatText",
    "Seed",
    "Stop",
    "Temperature",
    "TextContent",
    "TextOnlyContentPart",
    "TokenId",
    "ToolName",
    "TopP",
    "UserContentPart",
    "WebSearchLocation",
    "WebSearchOptions",
    "WebSearchUserLocation",
]

# --- shared scalar types (also used by ncap.protocol.completions) ---

Penalty = Annotated[float, Meta(ge=-2, le=2)]
Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(ge=0, le=1)]
CandidateCount = Annotated[int, Meta(ge=1, le=128)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[str, Meta(pattern=r"^[0-9]+$")]
LogitBias = dict[TokenId, Annotated[int, Meta(ge=-100, le=100)]]
Stop = str | Annotated[list[str], Meta(min_length=1, max_length=4)]
Metadata = Annotated[
    dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
    Meta(max_length=16),
]
JSONObject = dict[str, Any]


class _Wire(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """Unknown fields are errors; ``gc=False`` because decoded JSON cannot form cycles
    (it makes ``msgspec.convert`` about 10% faster)."""


class ChatCompletionStreamOptions(_Wire):
    include_usage: bool | UnsetType = UNSET
    include_obfuscation: bool | UnsetType = UNSET


# --- content parts ---


class PromptCacheBreakpointParam(_Wire):
    mode: Literal["explicit"]


class ChatCompletionRequestMessageContentPartText(_Wire, tag_field="type", tag="text"):
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpointParam | UnsetType = UNSET


class TextOnlyContentPart(_Wire):
    """``ChatCompletionRequestMessageContentPartText`` where it is the only kind allowed."""

    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpointParam | UnsetType = UNSET


class ImageUrl(_Wire):
    url: str
    detail: Literal["auto", "low", "high"] | UnsetType = UNSET


class ChatCompletionRequestMessageContentPartImage(_Wire, tag_field="type", tag="image_url"):
    image_url: ImageUrl
    prompt_cache_breakpoint: PromptCacheBreakpointParam | UnsetType = UNSET


class InputAudio(_Wire):
    data: str
    format: Literal["wav", "mp3"]


class ChatCompletionRequestMessageContentPartAudio(_Wire, tag_field="type", tag="input_audio"):
    input_audio: InputAudio
    prompt_cache_breakpoint: PromptCacheBreakpointParam | UnsetType = UNSET


class FileInput(_Wire):
    filename: str | UnsetType = UNSET
    file_data: str | UnsetType = UNSET
    file_id: str | UnsetType = UNSET


class ChatCompletionRequestMessageContentPartFile(_Wire, tag_field="type", tag="file"):
    file: FileInput
    prompt_cache_breakpoint: PromptCacheBreakpointParam | UnsetType = UNSET


class ChatCompletionRequestMessageContentPartRefusal(_Wire, tag_field="type", tag="refusal"):
    refusal: str


UserContentPart = (
    ChatCompletionRequestMessageContentPartText
    | ChatCompletionRequestMessageContentPartImage
    | ChatCompletionRequestMessageContentPartAudio
    | ChatCompletionRequestMessageContentPartFile
)
AssistantContentPart = (
    ChatCompletionRequestMessageContentPartText | ChatCompletionRequestMessageContentPartRefusal
)
TextContent = str | Annotated[list[TextOnlyContentPart], Meta(min_length=1)]

# --- messages (tagged on ``role``) ---


class ChatCompletionRequestDeveloperMessage(_Wire, tag_field="role", tag="developer"):
    content: TextContent
    name: str | UnsetType = UNSET


class ChatCompletionRequestSystemMessage(_Wire, tag_field="role", tag="system"):
    content: TextContent
    name: str | UnsetType = UNSET


class ChatCompletionRequestUserMessage(_Wire, tag_field="role", tag="user"):
    content: str | Annotated[list[UserContentPart], Meta(min_length=1)]
    name: str | UnsetType = UNSET


class AssistantAudio(_Wire):
    id: str


class FunctionCallArguments(_Wire):
    name: str
    arguments: str


class ChatCompletionMessageToolCall(_Wire, tag_field="type", tag="function"):
    id: str
    function: FunctionCallArguments


class CustomToolCallInput(_Wire):
    name: str
    input: str


class ChatCompletionMessageCustomToolCall(_Wire, tag_field="type", tag="custom"):
    id: str
    custom: CustomToolCallInput


class AssistantFunctionCall(_Wire):
    arguments: str
    name: str


class ChatCompletionRequestAssistantMessage(_Wire, tag_field="role", tag="assistant"):
    content: str | Annotated[list[AssistantContentPart], Meta(min_length=1)] | UnsetType | None = (
        UNSET
    )
    refusal: str | UnsetType | None = UNSET
    name: str | UnsetType = UNSET
    audio: AssistantAudio | UnsetType | None = UNSET
    tool_calls: (
        list[ChatCompletionMessageToolCall | ChatCompletionMessageCustomToolCall] | UnsetType
    ) = UNSET
    function_call: AssistantFunctionCall | UnsetType | None = UNSET


class ChatCompletionRequestToolMessage(_Wire, tag_field="role", tag="tool"):
    content: TextContent
    tool_call_id: str


class ChatCompletionRequestFunctionMessage(_Wire, tag_field="role", tag="function"):
    content: str | None
    name: str


ChatCompletionRequestMessage = (
    ChatCompletionRequestDeveloperMessage
    | ChatCompletionRequestSystemMessage
    | ChatCompletionRequestUserMessage
    | ChatCompletionRequestAssistantMessage
    | ChatCompletionRequestToolMessage
    | ChatCompletionRequestFunctionMessage
)

# --- other request objects, in the order the request first uses them ---


class PromptCacheOptionsParam(_Wire):
    ttl: Literal["30m"] | UnsetType = UNSET
    mode: Literal["implicit", "explicit"] | UnsetType = UNSET


class WebSearchLocation(_Wire):
    country: str | UnsetType = UNSET
    region: str | UnsetType = UNSET
    city: str | UnsetType = UNSET
    timezone: str | UnsetType = UNSET


class WebSearchUserLocation(_Wire):
    type: Literal["approximate"]
    approximate: WebSearchLocation


class WebSearchOptions(_Wire):
    user_location: WebSearchUserLocation | UnsetType | None = UNSET
    search_context_size: Literal["low", "medium", "high"] | UnsetType = UNSET


class ResponseFormatText(_Wire, tag_field="type", tag="text"):
    pass


class JSONSchema(_Wire, kw_only=True):
    description: str | UnsetType = UNSET
    name: str
    schema: JSONObject | UnsetType = UNSET
    strict: bool | UnsetType | None = UNSET


class ResponseFormatJsonSchema(_Wire, tag_field="type", tag="json_schema"):
    json_schema: JSONSchema


class ResponseFormatJsonObject(_Wire, tag_field="type", tag="json_object"):
    pass


class CustomVoice(_Wire):
    id: str


class ChatCompletionAudioParam(_Wire):
    voice: str | CustomVoice
    format: Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]


class ModerationConfigParam(_Wire):
    mode: Literal["score", "block"]


class ModerationPolicyParam(_Wire):
    input: ModerationConfigParam | UnsetType | None = UNSET
    output: ModerationConfigParam | UnsetType | None = UNSET


class ModerationParam(_Wire):
    model: str
    policy: ModerationPolicyParam | UnsetType | None = UNSET


class PredictionContent(_Wire):
    type: Literal["content"]
    content: TextContent


class FunctionObject(_Wire, kw_only=True):
    description: str | UnsetType = UNSET
    name: str
    parameters: JSONObject | UnsetType = UNSET
    strict: bool | UnsetType | None = UNSET


class ChatCompletionTool(_Wire, tag_field="type", tag="function"):
    function: FunctionObject


class CustomToolFormatText(_Wire, tag_field="type", tag="text"):
    pass


class CustomToolGrammar(_Wire):
    definition: str
    syntax: Literal["lark", "regex"]


class CustomToolFormatGrammar(_Wire, tag_field="type", tag="grammar"):
    grammar: CustomToolGrammar


class CustomToolDefinition(_Wire):
    name: str
    description: str | UnsetType = UNSET
    format: CustomToolFormatText | CustomToolFormatGrammar | UnsetType = UNSET


class CustomToolChatCompletions(_Wire, tag_field="type", tag="custom"):
    custom: CustomToolDefinition


class ChatCompletionAllowedTools(_Wire):
    mode: Literal["auto", "required"]
    tools: list[JSONObject]


class ChatCompletionAllowedToolsChoice(_Wire, tag_field="type", tag="allowed_tools"):
    allowed_tools: ChatCompletionAllowedTools


class ToolName(_Wire):
    name: str


class ChatCompletionNamedToolChoice(_Wire, tag_field="type", tag="function"):
    function: ToolName


class ChatCompletionNamedToolChoiceCustom(_Wire, tag_field="type", tag="custom"):
    custom: ToolName


class ChatCompletionFunctionCallOption(_Wire):
    name: str


class ChatCompletionFunctions(_Wire, kw_only=True):
    description: str | UnsetType = UNSET
    name: str
    parameters: JSONObject | UnsetType = UNSET


# --- the request ---


class ChatCompletionRequest(_Wire, kw_only=True):
    """The 37 body fields of ``CreateChatCompletionRequest``, in the reference's order."""

    # ModelResponseProperties
    metadata: Metadata | UnsetType | None = UNSET
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | UnsetType | None = UNSET
    temperature: Temperature | UnsetType | None = UNSET
    top_p: TopP | UnsetType | None = UNSET
    user: str | UnsetType = UNSET
    safety_identifier: Annotated[str, Meta(max_length=64)] | UnsetType | None = UNSET
    prompt_cache_key: str | UnsetType | None = UNSET
    prompt_cache_retention: Literal["in_memory", "24h"] | UnsetType | None = UNSET
    # CreateModelResponseProperties
    prompt_cache_options: PromptCacheOptionsParam | UnsetType = UNSET
    # CreateChatCompletionRequest
    messages: Annotated[list[ChatCompletionRequestMessage], Meta(min_length=1)]
    model: str
    service_tier: (
        Literal["auto", "default", "flex", "scale", "priority", "fast"] | UnsetType | None
    ) = UNSET
    modalities: list[Literal["text", "audio"]] | UnsetType | None = UNSET
    verbosity: Literal["low", "medium", "high"] | UnsetType | None = UNSET
    reasoning_effort: (
        Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | UnsetType | None
    ) = UNSET
    max_completion_tokens: Annotated[int, Meta(ge=1)] | UnsetType | None = UNSET
    frequency_penalty: Penalty | UnsetType | None = UNSET
    presence_penalty: Penalty | UnsetType | None = UNSET
    web_search_options: WebSearchOptions | UnsetType = UNSET
    response_format: (
        ResponseFormatText | ResponseFormatJsonSchema | ResponseFormatJsonObject | UnsetType
    ) = UNSET
    audio: ChatCompletionAudioParam | UnsetType | None = UNSET
    store: bool | UnsetType | None = UNSET
    moderation: ModerationParam | UnsetType | None = UNSET
    stream: bool | UnsetType | None = UNSET
    stop: Stop | UnsetType | None = UNSET
    logit_bias: LogitBias | UnsetType | None = UNSET
    logprobs: bool | UnsetType | None = UNSET
    max_tokens: Annotated[int, Meta(ge=1)] | UnsetType | None = UNSET
    n: CandidateCount | UnsetType | None = UNSET
    prediction: PredictionContent | UnsetType | None = UNSET
    seed: Seed | UnsetType | None = UNSET
    stream_options: ChatCompletionStreamOptions | UnsetType | None = UNSET
    tools: list[ChatCompletionTool | CustomToolChatCompletions] | UnsetType = UNSET
    tool_choice: (
        Literal["none", "auto", "required"]
        | ChatCompletionAllowedToolsChoice
        | ChatCompletionNamedToolChoice
        | ChatCompletionNamedToolChoiceCustom
        | UnsetType
    ) = UNSET
    parallel_tool_calls: bool | UnsetType = UNSET
    function_call: Literal["none", "auto"] | ChatCompletionFunctionCallOption | UnsetType = UNSET
    functions: (
        Annotated[list[ChatCompletionFunctions], Meta(min_length=1, max_length=128)] | UnsetType
    ) = UNSET
