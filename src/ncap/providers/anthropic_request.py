"""Request out: a validated OpenAI chat request → Anthropic's Messages body.

- system and developer messages → ``system`` (text blocks, in order); user content parts
  → text, image (base64 data URL or URL) and document (PDF data URL) blocks; assistant
  ``tool_calls`` → ``tool_use`` blocks; ``role: tool`` results → ``tool_result`` blocks in
  the next user turn; consecutive messages of one role are merged into one turn;
- ``tools`` → ``tools`` (``parameters`` as ``input_schema``); ``tool_choice`` auto /
  required / a named function / none → auto / any / tool / none;
  ``parallel_tool_calls: false`` → ``disable_parallel_tool_use``;
- ``stop`` → ``stop_sequences``; the output ceiling → ``max_tokens`` (required there);
  ``temperature`` (Anthropic's range is 0 to 1: above it is a 400 naming the field,
  never clamped) and ``top_p`` as they are; ``user`` → ``metadata.user_id``;
- ``response_format`` json_schema (or json_object) → one forced tool whose input schema
  is the schema (its input comes back as the message's JSON content: ``Shape``).

Fields that would change the answer and have no Anthropic equivalent (``logit_bias``,
``logprobs``, penalties, audio, predicted outputs, …) are refused with a 400 naming the
field. ``seed`` is not sent: Anthropic has none, and it does not change what may be drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from msgspec import UNSET, UnsetType

from ncap.errors import InvalidValue
from ncap.protocol.chat import (
    ChatCompletionMessageToolCall,
    ChatCompletionNamedToolChoice,
    ChatCompletionRequest,
    ChatCompletionRequestAssistantMessage,
    ChatCompletionRequestDeveloperMessage,
    ChatCompletionRequestFunctionMessage,
    ChatCompletionRequestMessage,
    ChatCompletionRequestMessageContentPartFile,
    ChatCompletionRequestMessageContentPartImage,
    ChatCompletionRequestMessageContentPartText,
    ChatCompletionRequestSystemMessage,
    ChatCompletionRequestToolMessage,
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

__all__ = ["MAX_TEMPERATURE", "UPSTREAM", "Shape", "to_anthropic_request"]

UPSTREAM = "Anthropic"
_JSON_OBJECT_TOOL = "json_answer"
_CACHE_CONTROL = {"type": "ephemeral"}

MAX_TEMPERATURE = 1.0
"""Anthropic's temperature range is 0 to 1 (OpenAI's is 0 to 2)."""


@dataclass(frozen=True, slots=True)
class Shape:
    """What reading the answer needs to know about the request: the forced tool that
    carries a ``response_format`` answer (None without one)."""

    json_tool: str | None = None


def to_anthropic_request(req: ChatCompletionRequest, *, model: str) -> tuple[dict[str, Any], Shape]:
    """The Messages body for ``req`` and what reading its answer needs. A content part
    marked with OpenAI's ``prompt_cache_breakpoint`` becomes a block marked with
    ``cache_control``: Anthropic caches the prompt up to it for the requests that follow
    (how a cache-primed fan-out lets its later branches read the first one's prompt)."""
    _refuse_unsupported(req)
    system, messages = _messages(req.messages)
    body: dict[str, Any] = {"model": model, "max_tokens": _ceiling(req), "messages": messages}
    if system:
        body["system"] = system
    _sampling(req, body)
    shape = _tools(req, body)
    if req.stream is True:
        body["stream"] = True
    return body, shape


def _unsupported(param: str, what: str) -> InvalidValue:
    return unsupported(param, what, UPSTREAM)


def _refuse_unsupported(req: ChatCompletionRequest) -> None:
    """Fields that would change the answer and have no Anthropic equivalent. Fields that
    do not change it (metadata, store, service_tier, prompt_cache_*, seed) are not sent."""
    refuse(
        [
            *sampling_refusals(req),
            (given(req.top_logprobs) not in (UNSET, 0), "top_logprobs", "top_logprobs"),
            (
                given(req.frequency_penalty) not in (UNSET, 0),
                "frequency_penalty",
                "frequency_penalty",
            ),
            (given(req.presence_penalty) not in (UNSET, 0), "presence_penalty", "presence_penalty"),
            *output_refusals(req),
            *legacy_refusals(req),
            (given(req.n) not in (UNSET, 1), "n", "n > 1 in one request (fan-out sends n = 1)"),
        ],
        UPSTREAM,
    )
    _refuse_hot(req)


def _refuse_hot(req: ChatCompletionRequest) -> None:
    """A temperature above Anthropic's range: a 400 naming it, never clamped."""
    temperature = given(req.temperature)
    if not isinstance(temperature, UnsetType) and temperature > MAX_TEMPERATURE:
        raise InvalidValue(
            f"Invalid value for 'temperature': {temperature:g} is above {MAX_TEMPERATURE:g}, "
            "the most this model's route (Anthropic) accepts; send 0 to 1.",
            param="temperature",
        )


def _ceiling(req: ChatCompletionRequest) -> int:
    for value in (req.max_completion_tokens, req.max_tokens):
        if isinstance(value, int):
            return value
    raise InvalidValue(
        "Anthropic routes need an output ceiling: set max_completion_tokens.",
        param="max_completion_tokens",
    )


def _sampling(req: ChatCompletionRequest, body: dict[str, Any]) -> None:
    temperature, top_p = given(req.temperature), given(req.top_p)
    if not isinstance(temperature, UnsetType):
        body["temperature"] = temperature
    if not isinstance(top_p, UnsetType):
        body["top_p"] = top_p
    stop = given(req.stop)
    if isinstance(stop, str):
        body["stop_sequences"] = [stop]
    elif isinstance(stop, list):
        body["stop_sequences"] = list(stop)
    user = req.user if isinstance(req.user, str) else given(req.safety_identifier)
    if isinstance(user, str) and user:
        body["metadata"] = {"user_id": user}


def _marked(content: object) -> bool:
    """Whether any part of ``content`` carries a ``prompt_cache_breakpoint``."""
    parts = content if isinstance(content, list) else []
    return any(getattr(p, "prompt_cache_breakpoint", UNSET) is not UNSET for p in parts)


def _cached(block: dict[str, Any], marked: bool) -> dict[str, Any]:
    if marked:
        block["cache_control"] = dict(_CACHE_CONTROL)
    return block


def _messages(
    messages: list[ChatCompletionRequestMessage],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(system blocks, turns): system/developer text goes to ``system``; every other
    message becomes blocks of a user or assistant turn, one turn per run of a role."""
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if isinstance(
            msg, ChatCompletionRequestSystemMessage | ChatCompletionRequestDeveloperMessage
        ):
            text = {"type": "text", "text": text_of(msg.content)}
            system.append(_cached(text, _marked(msg.content)))
            continue
        if isinstance(msg, ChatCompletionRequestFunctionMessage):
            raise _unsupported(f"messages[{i}].role", "The legacy function role (use tool)")
        if isinstance(msg, ChatCompletionRequestToolMessage):
            role, blocks = "user", [_tool_result(msg)]
        elif isinstance(msg, ChatCompletionRequestAssistantMessage):
            role, blocks = "assistant", _assistant_blocks(msg, i)
        else:
            role, blocks = "user", _user_blocks(msg.content, i)
        if not blocks:
            continue
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return system, turns


def _user_blocks(content: str | list[UserContentPart], i: int) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [_user_block(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content)]


def _user_block(part: UserContentPart, param: str) -> dict[str, Any]:
    return _cached(_user_block_of(part, param), _marked([part]))


def _user_block_of(part: UserContentPart, param: str) -> dict[str, Any]:
    if isinstance(part, ChatCompletionRequestMessageContentPartText):
        return {"type": "text", "text": part.text}
    if isinstance(part, ChatCompletionRequestMessageContentPartImage):
        url = part.image_url.url
        if url.startswith(("http://", "https://")):
            return {"type": "image", "source": {"type": "url", "url": url}}
        return {"type": "image", "source": _base64_source(url, param)}
    if isinstance(part, ChatCompletionRequestMessageContentPartFile):
        data = part.file.file_data
        if isinstance(data, str):
            return {"type": "document", "source": _base64_source(data, param)}
        raise _unsupported(param, "A file by file_id")
    raise _unsupported(param, "Audio input")


def _base64_source(data_url: str, param: str) -> dict[str, str]:
    m = DATA_URL.match(data_url)
    if m is None:
        raise InvalidValue(
            "Expected an http(s) URL or a base64 data URL (data:<type>;base64,...).",
            param=param,
        )
    return {"type": "base64", "media_type": m.group(1), "data": m.group(2)}


def _assistant_blocks(msg: ChatCompletionRequestAssistantMessage, i: int) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    content = given(msg.content)
    if isinstance(content, str):
        if content:
            blocks.append({"type": "text", "text": content})
    elif isinstance(content, list):
        for part in content:
            text = (
                part.text
                if isinstance(part, ChatCompletionRequestMessageContentPartText)
                else part.refusal
            )
            blocks.append(_cached({"type": "text", "text": text}, _marked([part])))
    for j, call in enumerate(msg.tool_calls or []):
        if not isinstance(call, ChatCompletionMessageToolCall):
            raise _unsupported(f"messages[{i}].tool_calls[{j}]", "Custom tool calls")
        param = f"messages[{i}].tool_calls[{j}].function.arguments"
        blocks.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.function.name,
                "input": json_object(call.function.arguments, param),
            }
        )
    return blocks


def _tool_result(msg: ChatCompletionRequestToolMessage) -> dict[str, Any]:
    block = {
        "type": "tool_result",
        "tool_use_id": msg.tool_call_id,
        "content": text_of(msg.content),
    }
    return _cached(block, _marked(msg.content))


def _tools(req: ChatCompletionRequest, body: dict[str, Any]) -> Shape:
    """``tools`` and ``tool_choice``, or the forced tool of a ``response_format``."""
    fmt = req.response_format
    tools = [_tool(t, j) for j, t in enumerate(req.tools or [])]
    if isinstance(fmt, ResponseFormatJsonSchema | ResponseFormatJsonObject):
        if tools:
            raise InvalidValue(
                "On Anthropic routes response_format is answered through a forced tool, "
                "so it cannot be combined with tools.",
                param="response_format",
            )
        name, schema = _format_tool(fmt)
        body["tools"] = [
            {
                "name": name,
                "description": "Answer with JSON of this schema.",
                "input_schema": schema,
            }
        ]
        body["tool_choice"] = {"type": "tool", "name": name}
        return Shape(json_tool=name)
    if tools:
        body["tools"] = tools
        choice = _tool_choice(req, {t["name"] for t in tools})
        if choice is not None:
            body["tool_choice"] = choice
    return Shape()


def _format_tool(fmt: ResponseFormatJsonSchema | ResponseFormatJsonObject) -> tuple[str, Any]:
    if isinstance(fmt, ResponseFormatJsonObject):
        return _JSON_OBJECT_TOOL, {"type": "object"}
    schema = fmt.json_schema.schema
    if isinstance(schema, UnsetType):
        return fmt.json_schema.name, {"type": "object"}
    if schema.get("type") != "object":
        raise InvalidValue(
            "On Anthropic routes a json_schema must describe an object (type: object).",
            param="response_format.json_schema.schema",
        )
    return fmt.json_schema.name, schema


def _tool(tool: object, j: int) -> dict[str, Any]:
    if not isinstance(tool, ChatCompletionTool):
        raise _unsupported(f"tools[{j}]", "Custom tools")
    fn = tool.function
    schema = fn.parameters if not isinstance(fn.parameters, UnsetType) else None
    out: dict[str, Any] = {
        "name": fn.name,
        "input_schema": schema or {"type": "object", "properties": {}},
    }
    if isinstance(fn.description, str):
        out["description"] = fn.description
    return out


def _tool_choice(req: ChatCompletionRequest, names: set[str]) -> dict[str, Any] | None:
    choice = req.tool_choice
    parallel_off = req.parallel_tool_calls is False
    out: dict[str, Any] | None
    if choice == "none":
        return {"type": "none"}
    if choice == "required":
        out = {"type": "any"}
    elif isinstance(choice, ChatCompletionNamedToolChoice):
        if choice.function.name not in names:
            raise InvalidValue(
                f"tool_choice names {choice.function.name!r}, which is not in tools.",
                param="tool_choice",
            )
        out = {"type": "tool", "name": choice.function.name}
    elif choice == "auto" or isinstance(choice, UnsetType):
        out = {"type": "auto"} if parallel_off or choice == "auto" else None
    else:  # allowed_tools, a custom tool
        raise _unsupported("tool_choice", "This tool_choice")
    if out is not None and parallel_off:
        out["disable_parallel_tool_use"] = True
    return out
