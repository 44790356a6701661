"""The translator for one schema pair: OpenAI Chat Completions ↔ Anthropic Messages.

Pure: no I/O, no clock (ids and ``created`` are parameters), so every mapping is a
table test. The adapter (``providers.anthropic``) sends what ``to_anthropic_request``
builds and relays what ``to_chat_completion`` / ``AnthropicStream`` make of the answer;
``anthropic_failure`` turns an error answer into facts (status, message, code) for the
one failure table.

The mapping, field by field:

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
  is the schema: the tool's input comes back as the message's JSON content, finish
  reason ``stop``;
- stop reasons: end_turn / stop_sequence / pause_turn → stop, max_tokens /
  model_context_window_exceeded → length, tool_use → tool_calls, refusal → content_filter;
- usage: input + cache read + cache write tokens → ``prompt_tokens``, cache reads as
  ``prompt_tokens_details.cached_tokens``.

Fields that would change the answer and have no Anthropic equivalent (``logit_bias``,
``logprobs``, penalties, audio, predicted outputs, …) are refused with a 400 naming the
field. ``seed`` is not sent: Anthropic has none, and it does not change what may be drawn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from ncap.errors import InvalidValue
from ncap.protocol import anthropic as a
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
    TextContent,
    UserContentPart,
)
from ncap.protocol.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    Delta,
    FinishReason,
    FunctionCall,
    Message,
    PromptTokensDetails,
    ResponseSummary,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from ncap.providers.base import AttemptFailed, UpstreamErrorDetail
from ncap.providers.transport import parse_retry_after
from ncap.streaming.sse import DONE, StreamEvent, encode_event

__all__ = [
    "ERROR_STATUS",
    "MAX_TEMPERATURE",
    "AnthropicStream",
    "Shape",
    "anthropic_failure",
    "decode_message",
    "finish_reason",
    "stream_failure",
    "to_anthropic_request",
    "to_chat_completion",
    "usage_of",
]

_T = TypeVar("_T")
_encode = msgspec.json.Encoder().encode
_decode_message = msgspec.json.Decoder(a.Message).decode
_decode_event = msgspec.json.Decoder(a.StreamEvent).decode
_decode_error = msgspec.json.Decoder(a.AnthropicErrorEnvelope).decode
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)(?:;[^,;]*)*;base64,(.*)$", re.DOTALL)
_JSON_OBJECT_TOOL = "json_answer"
_CONTEXT = re.compile(r"prompt is too long|context window|too many tokens", re.IGNORECASE)

MAX_TEMPERATURE = 1.0
"""Anthropic's temperature range is 0 to 1 (OpenAI's is 0 to 2)."""

ERROR_STATUS: dict[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}
"""Anthropic's error ``type`` → the HTTP status it comes with (a stream's ``error``
event has no status of its own)."""

_FINISH: dict[str, FinishReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


def _given(value: _T | UnsetType | None) -> _T | UnsetType:
    return UNSET if value is None else value


@dataclass(frozen=True, slots=True)
class Shape:
    """What reading the answer needs to know about the request: the forced tool that
    carries a ``response_format`` answer (None without one)."""

    json_tool: str | None = None


# --- request ---


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
    return InvalidValue(f"{what} is not supported on Anthropic routes.", param=param)


def _refuse_unsupported(req: ChatCompletionRequest) -> None:
    """Fields that would change the answer and have no Anthropic equivalent. Fields that
    do not change it (metadata, store, service_tier, prompt_cache_*, seed) are not sent."""
    checks: list[tuple[bool, str, str]] = [
        (bool(_given(req.logit_bias)), "logit_bias", "logit_bias"),
        (req.logprobs is True, "logprobs", "logprobs"),
        (_given(req.top_logprobs) not in (UNSET, 0), "top_logprobs", "top_logprobs"),
        (_given(req.frequency_penalty) not in (UNSET, 0), "frequency_penalty", "frequency_penalty"),
        (_given(req.presence_penalty) not in (UNSET, 0), "presence_penalty", "presence_penalty"),
        (_given(req.audio) is not UNSET, "audio", "Audio output"),
        (
            isinstance(req.modalities, list) and "audio" in req.modalities,
            "modalities",
            "Audio output",
        ),
        (_given(req.prediction) is not UNSET, "prediction", "Predicted outputs"),
        (req.web_search_options is not UNSET, "web_search_options", "web_search_options"),
        (_given(req.reasoning_effort) is not UNSET, "reasoning_effort", "reasoning_effort"),
        (_given(req.verbosity) is not UNSET, "verbosity", "verbosity"),
        (_given(req.moderation) is not UNSET, "moderation", "moderation"),
        (req.functions is not UNSET, "functions", "The legacy functions field (use tools)"),
        (req.function_call is not UNSET, "function_call", "The legacy function_call field"),
        (_given(req.n) not in (UNSET, 1), "n", "n > 1 in one request (fan-out sends n = 1)"),
    ]
    for refused, param, what in checks:
        if refused:
            raise _unsupported(param, what)
    temperature = _given(req.temperature)
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
    temperature, top_p = _given(req.temperature), _given(req.top_p)
    if not isinstance(temperature, UnsetType):
        body["temperature"] = temperature
    if not isinstance(top_p, UnsetType):
        body["top_p"] = top_p
    stop = _given(req.stop)
    if isinstance(stop, str):
        body["stop_sequences"] = [stop]
    elif isinstance(stop, list):
        body["stop_sequences"] = list(stop)
    user = req.user if isinstance(req.user, str) else _given(req.safety_identifier)
    if isinstance(user, str) and user:
        body["metadata"] = {"user_id": user}


_CACHE_CONTROL = {"type": "ephemeral"}


def _text_of(content: TextContent) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


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
            text = {"type": "text", "text": _text_of(msg.content)}
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
    m = _DATA_URL.match(data_url)
    if m is None:
        raise InvalidValue(
            "Expected an http(s) URL or a base64 data URL (data:<type>;base64,...).",
            param=param,
        )
    return {"type": "base64", "media_type": m.group(1), "data": m.group(2)}


def _assistant_blocks(msg: ChatCompletionRequestAssistantMessage, i: int) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    content = _given(msg.content)
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
                "input": _arguments(call.function.arguments, param),
            }
        )
    return blocks


def _arguments(raw: str, param: str) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise InvalidValue("Tool call arguments must be a JSON object.", param=param) from None
    if not isinstance(value, dict):
        raise InvalidValue("Tool call arguments must be a JSON object.", param=param)
    return value


def _tool_result(msg: ChatCompletionRequestToolMessage) -> dict[str, Any]:
    block = {
        "type": "tool_result",
        "tool_use_id": msg.tool_call_id,
        "content": _text_of(msg.content),
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


# --- response ---


def decode_message(payload: bytes) -> a.Message:
    """The 200 answer; ``msgspec`` errors surface to the adapter as a protocol failure."""
    return _decode_message(payload)


def finish_reason(stop_reason: str | None, shape: Shape) -> FinishReason:
    reason = _FINISH.get(stop_reason or "end_turn", "stop")
    if reason == "tool_calls" and shape.json_tool is not None:
        return "stop"  # the forced tool carried the JSON answer: no call for the client
    return reason


def usage_of(usage: a.AnthropicUsage | None) -> Usage | None:
    """OpenAI usage; None when Anthropic reported no input count (unknown, not zero).
    Cache reads and writes are prompt tokens too: Anthropic's ``input_tokens`` excludes
    them."""
    if usage is None or usage.input_tokens is None:
        return None
    read = usage.cache_read_input_tokens or 0
    written = usage.cache_creation_input_tokens or 0
    prompt = usage.input_tokens + read + written
    completion = usage.output_tokens or 0
    details = PromptTokensDetails(cached_tokens=read, cache_write_tokens=written or UNSET)
    return Usage(
        completion_tokens=completion,
        prompt_tokens=prompt,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )


def to_chat_completion(
    msg: a.Message, *, completion_id: str, created: int, model: str, shape: Shape
) -> ChatCompletion:
    text: list[str] = []
    calls: list[ToolCall] = []
    for block in msg.content:
        if block.type == "text" and block.text is not None:
            text.append(block.text)
        elif block.type == "tool_use" and block.name == shape.json_tool:
            text.append(json.dumps(block.input, separators=(",", ":")))
        elif block.type == "tool_use":
            arguments = json.dumps(block.input or {}, separators=(",", ":"))
            calls.append(
                ToolCall(
                    id=block.id or f"call_{len(calls)}",
                    type="function",
                    function=FunctionCall(name=block.name or "", arguments=arguments),
                )
            )
    content = "".join(text) if text or not calls else None
    choice = Choice(
        finish_reason=finish_reason(msg.stop_reason, shape),
        index=0,
        message=Message(content=content, refusal=None, tool_calls=calls or UNSET),
        logprobs=None,
    )
    usage = usage_of(msg.usage)
    return ChatCompletion(
        id=completion_id,
        choices=[choice],
        created=created,
        model=msg.model or model,
        usage=UNSET if usage is None else usage,
    )


def summarize(obj: ChatCompletion | ChatCompletionChunk) -> ResponseSummary:
    """The settlement view of what the translator produced, without re-decoding it."""
    return msgspec.convert(msgspec.to_builtins(obj), ResponseSummary)


# --- stream ---


@dataclass(slots=True)
class _Block:
    kind: str  # text, tool (a tool call of the client's), json (the forced tool), other
    tool_index: int = -1


@dataclass(slots=True)
class AnthropicStream:
    """Anthropic stream events in, OpenAI chunks out (choice index 0: a fan-out branch's
    chunks are moved to the branch's index by the merge)."""

    completion_id: str
    created: int
    model: str
    shape: Shape = field(default_factory=Shape)
    blocks: dict[int, _Block] = field(default_factory=dict)
    tool_calls: int = 0
    input_usage: a.AnthropicUsage | None = None
    output_tokens: int | None = None
    finish: FinishReason | None = None
    stopped: bool = False

    def events(self, data: bytes) -> list[StreamEvent]:
        """One Anthropic event's ``data`` in, the OpenAI SSE events to relay out."""
        try:
            event = _decode_event(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise AttemptFailed("protocol", 200, detail=f"unreadable stream event: {exc}") from exc
        return [_event(chunk) for chunk in self.feed(event)]

    def feed(self, event: a.StreamEvent) -> list[ChatCompletionChunk]:
        handler = _HANDLERS.get(event.type)
        if event.type == "error":
            raise stream_failure(event.error)
        return handler(self, event) if handler is not None else []  # ping, unknown

    def end(self) -> list[StreamEvent]:
        """At the upstream's end: the usage chunk and ``[DONE]`` once ``message_stop``
        arrived; nothing for a cut stream (it settles as pending)."""
        if not self.stopped:
            return []
        out: list[StreamEvent] = []
        usage = self.usage
        if usage is not None:
            out.append(_event(self._chunk([], usage=usage)))
        return [*out, StreamEvent(DONE, None, done=True)]

    @property
    def usage(self) -> Usage | None:
        if self.input_usage is None:
            return None
        reported = msgspec.structs.replace(self.input_usage, output_tokens=self.output_tokens)
        return usage_of(reported)

    def _start(self, event: a.StreamEvent) -> list[ChatCompletionChunk]:
        msg = event.message
        if msg is not None:
            self.input_usage = msg.usage
            if msg.usage is not None:
                self.output_tokens = msg.usage.output_tokens
        return [self._delta(Delta(role="assistant", content=""))]

    def _block_start(self, event: a.StreamEvent) -> list[ChatCompletionChunk]:
        block = event.content_block
        index = event.index if event.index is not None else len(self.blocks)
        if block is None or block.type != "tool_use":
            kind = "text" if block is not None and block.type == "text" else "other"
            self.blocks[index] = _Block(kind)
            text = block.text if block is not None and kind == "text" else None
            return [self._delta(Delta(content=text))] if text else []
        if block.name == self.shape.json_tool:
            self.blocks[index] = _Block("json")
            return []
        self.blocks[index] = _Block("tool", self.tool_calls)
        self.tool_calls += 1
        call = ToolCallDelta(
            index=self.blocks[index].tool_index,
            id=block.id or f"call_{index}",
            type="function",
            function={"name": block.name or "", "arguments": ""},
        )
        return [self._delta(Delta(tool_calls=[call]))]

    def _block_delta(self, event: a.StreamEvent) -> list[ChatCompletionChunk]:
        delta = event.delta
        block = self.blocks.get(event.index if event.index is not None else -1)
        if delta is None or block is None:
            return []
        if delta.type == "text_delta" and block.kind == "text" and delta.text:
            return [self._delta(Delta(content=delta.text))]
        if delta.type != "input_json_delta" or not delta.partial_json:
            return []  # thinking, signatures, citations: not relayed
        if block.kind == "json":
            return [self._delta(Delta(content=delta.partial_json))]
        if block.kind == "tool":
            call = ToolCallDelta(index=block.tool_index, function={"arguments": delta.partial_json})
            return [self._delta(Delta(tool_calls=[call]))]
        return []

    def _message_delta(self, event: a.StreamEvent) -> list[ChatCompletionChunk]:
        usage = event.usage
        if usage is not None:
            self.output_tokens = usage.output_tokens
            if usage.input_tokens is not None:  # newer API versions repeat the input
                self.input_usage = usage
        if event.delta is None or event.delta.stop_reason is None:
            return []
        self.finish = finish_reason(event.delta.stop_reason, self.shape)
        choice = ChunkChoice(delta=Delta(), finish_reason=self.finish, index=0)
        return [self._chunk([choice])]

    def _stop(self, _: a.StreamEvent) -> list[ChatCompletionChunk]:
        if self.finish is None:
            raise AttemptFailed(
                "protocol", 200, detail="message_stop before a stop reason", partial=True
            )
        self.stopped = True
        return []

    def _delta(self, delta: Delta) -> ChatCompletionChunk:
        return self._chunk([ChunkChoice(delta=delta, finish_reason=None, index=0)])

    def _chunk(
        self, choices: list[ChunkChoice], *, usage: Usage | UnsetType = UNSET
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.completion_id,
            choices=choices,
            created=self.created,
            model=self.model,
            usage=usage,
        )


_HANDLERS = {
    "message_start": AnthropicStream._start,
    "content_block_start": AnthropicStream._block_start,
    "content_block_delta": AnthropicStream._block_delta,
    "message_delta": AnthropicStream._message_delta,
    "message_stop": AnthropicStream._stop,
}


def _event(chunk: ChatCompletionChunk) -> StreamEvent:
    data = _encode(chunk)  # kept: the fan-out merge rewrites chunks from their data
    return StreamEvent(encode_event(data), summarize(chunk), data=data)


# --- errors: facts for the failure table ---


def anthropic_failure(status: int, headers: Mapping[str, str], payload: bytes) -> AttemptFailed:
    """A non-200 answer, as facts: its status (529 ``overloaded_error`` stays 529), the
    retry delay, and Anthropic's message with the OpenAI code it amounts to."""
    body = _error_body(payload)
    return AttemptFailed(
        "status",
        status,
        retry_after=parse_retry_after(headers),
        error=_detail(status, body) if body is not None else None,
        provider_request_id=headers.get("request-id"),
        detail=body.type if body is not None else "",
    )


def stream_failure(error: a.AnthropicErrorBody | None) -> AttemptFailed:
    """A stream's ``error`` event: the status its type comes with, the same facts."""
    body = error or a.AnthropicErrorBody()
    status = ERROR_STATUS.get(body.type, 500)
    return AttemptFailed("status", status, error=_detail(status, body), detail=body.type)


def _error_body(payload: bytes) -> a.AnthropicErrorBody | None:
    try:
        return _decode_error(payload).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _detail(status: int, body: a.AnthropicErrorBody) -> UpstreamErrorDetail:
    """OpenAI's code for what Anthropic said: a rate limit, a prompt over the context
    window, or none (the message says it)."""
    code: str | None = None
    if status == 429 or body.type == "rate_limit_error":
        code = "rate_limit_exceeded"
    elif status == 400 and _CONTEXT.search(body.message):
        code = "context_length_exceeded"
    return UpstreamErrorDetail(body.message or body.type, code=code)
