"""Request out: a validated OpenAI chat request → Gemini's ``generateContent`` body.

System and developer messages become ``systemInstruction``; the rest become
``contents``, consecutive messages of one Gemini role merged into one turn (parallel
tool results must arrive in one turn). OpenAI fields Gemini cannot honour are refused
with a 400 naming the field, rather than dropped: a dropped ``logit_bias`` or
``logprobs`` would silently change the answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from msgspec import UNSET, UnsetType

from ncap.errors import InvalidValue
from ncap.protocol import gemini as g
from ncap.protocol.chat import (
    ChatCompletionAllowedToolsChoice,
    ChatCompletionMessageToolCall,
    ChatCompletionNamedToolChoice,
    ChatCompletionRequest,
    ChatCompletionRequestAssistantMessage,
    ChatCompletionRequestDeveloperMessage,
    ChatCompletionRequestFunctionMessage,
    ChatCompletionRequestMessage,
    ChatCompletionRequestMessageContentPartAudio,
    ChatCompletionRequestMessageContentPartFile,
    ChatCompletionRequestMessageContentPartImage,
    ChatCompletionRequestMessageContentPartRefusal,
    ChatCompletionRequestMessageContentPartText,
    ChatCompletionRequestSystemMessage,
    ChatCompletionRequestToolMessage,
    ChatCompletionRequestUserMessage,
    ChatCompletionTool,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    UserContentPart,
)
from ncap.providers.openai_side import (
    DATA_URL,
    given,
    json_object,
    legacy_refusals,
    output_refusals,
    refuse,
    sampling_refusals,
    text_of,
    unsupported,
)

__all__ = ["SIGNED", "UPSTREAM", "to_gemini_request"]

UPSTREAM = "Gemini"
SIGNED = "__thought__"
"""Tool call id = Gemini's call id + ``SIGNED`` + the call's thought signature: the client
sends the id back with the tool result, which is how the signature Gemini 3 requires on
a replayed call survives an OpenAI round trip."""


def to_gemini_request(
    req: ChatCompletionRequest, *, replay_signature: str | None = None
) -> g.GenerateContentRequest:
    """The Gemini body for a validated chat request (the upstream model goes in the URL).

    ``replay_signature`` is set on replayed function calls that carry no thought
    signature of their own: Gemini 3 refuses such a history, and Google documents the
    sentinel ``skip_thought_signature_validator`` for it (``GeminiTranslator`` passes it for
    Gemini 3 models). Raises ``InvalidValue`` (400, ``param`` naming the field) for what
    Gemini cannot honour."""
    _refuse_unsupported(req)
    system, contents = _contents(req.messages, replay_signature)
    tools, tool_config = _tools(req)
    return g.GenerateContentRequest(
        contents=contents,
        tools=tools,
        tool_config=tool_config,
        system_instruction=system,
        generation_config=_generation_config(req),
    )


def _unsupported(param: str, what: str) -> InvalidValue:
    return unsupported(param, what, UPSTREAM)


def _refuse_unsupported(req: ChatCompletionRequest) -> None:
    """Fields that would change the answer and have no Gemini equivalent here. Fields
    that do not change it (metadata, user, store, service_tier, prompt_cache_*) are
    not sent and need no refusal."""
    parallel_off = req.parallel_tool_calls is False
    refuse(
        [
            *sampling_refusals(req),
            *output_refusals(req),
            (parallel_off, "parallel_tool_calls", "parallel_tool_calls=false"),
            *legacy_refusals(req),
        ],
        UPSTREAM,
    )
    seed = given(req.seed)
    if isinstance(seed, int) and not -(2**31) <= seed < 2**31:
        raise InvalidValue("Gemini routes take a seed that fits in 32 bits.", param="seed")


def _generation_config(req: ChatCompletionRequest) -> g.GenerationConfig:
    ceiling = given(req.max_completion_tokens)
    if ceiling is UNSET:
        ceiling = given(req.max_tokens)
    mime, schema = _response_format(req)
    return g.GenerationConfig(
        stop_sequences=_stop(req),
        response_mime_type=mime,
        response_json_schema=schema,
        candidate_count=given(req.n),
        max_output_tokens=ceiling,
        temperature=given(req.temperature),
        top_p=given(req.top_p),
        seed=given(req.seed),
        presence_penalty=given(req.presence_penalty),
        frequency_penalty=given(req.frequency_penalty),
    )


def _stop(req: ChatCompletionRequest) -> list[str] | UnsetType:
    stop = given(req.stop)
    if isinstance(stop, str):
        return [stop]
    return UNSET if stop is UNSET else list(stop)


def _response_format(
    req: ChatCompletionRequest,
) -> tuple[str | UnsetType, dict[str, Any] | UnsetType]:
    """json_schema → JSON with ``responseJsonSchema`` (Gemini's field that takes JSON
    Schema as OpenAI carries it; ``responseSchema`` takes Google's OpenAPI subset)."""
    fmt = req.response_format
    if isinstance(fmt, ResponseFormatJsonSchema):
        return "application/json", fmt.json_schema.schema
    if isinstance(fmt, ResponseFormatJsonObject):
        return "application/json", UNSET
    return UNSET, UNSET


def _contents(
    messages: list[ChatCompletionRequestMessage], replay_signature: str | None
) -> tuple[g.Content | UnsetType, list[g.Content]]:
    """System/developer messages become ``systemInstruction`` (in order); the rest become
    ``contents``, consecutive messages of one Gemini role merged into one turn (parallel
    tool results must arrive in one turn)."""
    system: list[g.Part] = []
    contents: list[g.Content] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, for tool results
    for i, message in enumerate(messages):
        match message:
            case ChatCompletionRequestSystemMessage() | ChatCompletionRequestDeveloperMessage():
                system.append(g.Part(text=text_of(message.content)))
            case ChatCompletionRequestUserMessage():
                _append(contents, "user", _user_parts(message.content, i))
            case ChatCompletionRequestAssistantMessage():
                parts = _assistant_parts(message, i, call_names, replay_signature)
                _append(contents, "model", parts)
            case ChatCompletionRequestToolMessage():
                _append(contents, "user", [_tool_result(message, i, call_names)])
            case ChatCompletionRequestFunctionMessage():
                response = g.FunctionResponse(
                    name=message.name, response=_result_object(message.content or "")
                )
                _append(contents, "user", [g.Part(function_response=response)])
    if not contents:
        raise InvalidValue(
            "Gemini routes need at least one message that is not a system or developer message.",
            param="messages",
        )
    return (g.Content(parts=system) if system else UNSET), contents


def _append(contents: list[g.Content], role: Literal["user", "model"], parts: list[g.Part]) -> None:
    if not parts:
        return
    if contents and contents[-1].role == role:
        contents[-1].parts.extend(parts)
    else:
        contents.append(g.Content(parts=parts, role=role))


def _user_parts(content: str | list[UserContentPart], i: int) -> list[g.Part]:
    if isinstance(content, str):
        return [g.Part(text=content)]
    return [_user_part(part, f"messages.[{i}].content.[{j}]") for j, part in enumerate(content)]


def _user_part(part: UserContentPart, param: str) -> g.Part:
    match part:
        case ChatCompletionRequestMessageContentPartText():
            return g.Part(text=part.text)
        case ChatCompletionRequestMessageContentPartImage():
            url = part.image_url.url
            if url.startswith("data:"):
                return g.Part(inline_data=_blob(url, f"{param}.image_url.url"))
            return g.Part(file_data=g.FileData(file_uri=url))
        case ChatCompletionRequestMessageContentPartAudio():
            mime = f"audio/{part.input_audio.format}"
            return g.Part(inline_data=g.Blob(mime_type=mime, data=part.input_audio.data))
        case ChatCompletionRequestMessageContentPartFile():
            data = given(part.file.file_data)
            if data is UNSET:
                raise _unsupported(f"{param}.file.file_id", "A file_id")
            return g.Part(inline_data=_blob(data, f"{param}.file.file_data"))


def _blob(data_url: str, param: str) -> g.Blob:
    match = DATA_URL.match(data_url)
    if match is None:
        raise InvalidValue("Expected a base64 data URL (data:<mime>;base64,…).", param=param)
    return g.Blob(mime_type=match.group(1), data=match.group(2))


def _assistant_parts(
    message: ChatCompletionRequestAssistantMessage,
    i: int,
    call_names: dict[str, str],
    replay_signature: str | None,
) -> list[g.Part]:
    parts: list[g.Part] = []
    content = given(message.content)
    if isinstance(content, str):
        parts += [g.Part(text=content)] if content else []
    elif isinstance(content, list):
        parts += [g.Part(text=_assistant_text(part)) for part in content]
    calls = message.tool_calls if message.tool_calls is not UNSET else []
    for j, call in enumerate(calls):
        param = f"messages.[{i}].tool_calls.[{j}]"
        if not isinstance(call, ChatCompletionMessageToolCall):
            raise _unsupported(param, "A custom tool call")
        args = json_object(call.function.arguments, f"{param}.function.arguments")
        call_names[call.id] = call.function.name
        call_id, _, signature = call.id.partition(SIGNED)
        fc = g.FunctionCall(id=call_id, name=call.function.name, args=args)
        signed = signature or replay_signature
        parts.append(g.Part(thought_signature=signed or UNSET, function_call=fc))
    return parts


def _assistant_text(
    part: ChatCompletionRequestMessageContentPartText
    | ChatCompletionRequestMessageContentPartRefusal,
) -> str:
    if isinstance(part, ChatCompletionRequestMessageContentPartText):
        return part.text
    return part.refusal


def _tool_result(
    message: ChatCompletionRequestToolMessage, i: int, call_names: Mapping[str, str]
) -> g.Part:
    name = call_names.get(message.tool_call_id)
    if name is None:
        raise InvalidValue(
            "A tool message must answer a tool call of an earlier assistant message "
            "(Gemini needs the function's name).",
            param=f"messages.[{i}].tool_call_id",
        )
    response = g.FunctionResponse(
        id=message.tool_call_id.partition(SIGNED)[0],
        name=name,
        response=_result_object(text_of(message.content)),
    )
    return g.Part(function_response=response)


def _result_object(text: str) -> dict[str, Any]:
    """Gemini's ``response`` is an object: a JSON object result is passed as is, anything
    else is wrapped as ``{"result": text}``."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"result": text}


def _tools(req: ChatCompletionRequest) -> tuple[list[g.Tool] | UnsetType, g.ToolConfig | UnsetType]:
    if req.tools is UNSET or not req.tools:
        return UNSET, UNSET
    declarations = [_declaration(tool, j) for j, tool in enumerate(req.tools)]
    mode, allowed = _tool_choice(req, {d.name for d in declarations})
    if mode == "AUTO" and allowed is not UNSET:  # allowed_tools in auto mode: offer only those
        declarations = [d for d in declarations if d.name in allowed]
        allowed = UNSET
    if mode is None:
        return [g.Tool(function_declarations=declarations)], UNSET
    calling = g.FunctionCallingConfig(mode=mode, allowed_function_names=allowed)
    return [g.Tool(function_declarations=declarations)], g.ToolConfig(
        function_calling_config=calling
    )


def _declaration(tool: object, j: int) -> g.FunctionDeclaration:
    if not isinstance(tool, ChatCompletionTool):
        raise _unsupported(f"tools.[{j}]", "A custom tool")
    function = tool.function
    return g.FunctionDeclaration(
        name=function.name,
        description=function.description,
        parameters_json_schema=function.parameters,
    )


_Mode = Literal["AUTO", "ANY", "NONE"]


def _tool_choice(
    req: ChatCompletionRequest, names: set[str]
) -> tuple[_Mode | None, list[str] | UnsetType]:
    choice = req.tool_choice
    match choice:
        case "none":
            return "NONE", UNSET
        case "auto":
            return "AUTO", UNSET
        case "required":
            return "ANY", UNSET
        case ChatCompletionNamedToolChoice():
            _known(choice.function.name, names, "tool_choice.function.name")
            return "ANY", [choice.function.name]
        case ChatCompletionAllowedToolsChoice():
            allowed = [_allowed_name(t, names) for t in choice.allowed_tools.tools]
            return ("ANY" if choice.allowed_tools.mode == "required" else "AUTO"), allowed
        case UnsetType():
            return None, UNSET
        case _:
            raise _unsupported("tool_choice", "A custom tool choice")


def _known(name: str, names: set[str], param: str) -> None:
    if name not in names:
        raise InvalidValue(f"No tool named {name!r} is declared in tools.", param=param)


def _allowed_name(tool: Mapping[str, Any], names: set[str]) -> str:
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool.get("type") != "function" or not isinstance(name, str):
        raise _unsupported(
            "tool_choice.allowed_tools.tools", "An allowed tool other than a function"
        )
    _known(name, names, "tool_choice.allowed_tools.tools")
    return name
