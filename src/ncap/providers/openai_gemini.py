"""The translator for one schema pair: OpenAI Chat Completions ↔ Gemini generateContent.

Pure: no I/O, no clock, no randomness (ids and ``created`` are parameters), so every
mapping is a table test. The adapter (the HTTP provider) sends what
``to_gemini_request`` builds, and relays what ``to_chat_completion`` / ``GeminiStream``
/ ``translate_error`` make of the answer.

What it keeps right where peers do not:

- candidates are keyed by Gemini's own ``candidate.index``, never by list position; an
  absent index is proto3's 0, accepted only while no other candidate of the same
  response also claims 0 (two candidates without an index are ambiguous: a protocol
  error, not a guess);
- per-choice stream state is one object per upstream index (``_ChoiceState``);
- usage: ``thoughtsTokenCount`` is reasoning *and* output (Gemini's
  ``candidatesTokenCount`` excludes it), ``cachedContentTokenCount`` is cached input;
- a 400 refusing several candidates becomes ``route_does_not_support_candidates`` with
  the maximum the message states, and other errors keep their meaning.

OpenAI fields Gemini cannot honour are refused with a 400 naming the field, rather than
dropped: a dropped ``logit_bias`` or ``logprobs`` would silently change the answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from ncap.errors import (
    ContextLengthExceeded,
    InvalidValue,
    NcapError,
    Overloaded,
    RateLimitExceeded,
    RouteDoesNotSupportCandidates,
    UpstreamError,
    UpstreamTimeout,
)
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
    TextContent,
    UserContentPart,
)
from ncap.protocol.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    CompletionTokensDetails,
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
from ncap.streaming.sse import DONE, StreamEvent, encode_event

__all__ = [
    "GeminiError",
    "GeminiErrorKind",
    "GeminiStream",
    "decode_response",
    "decode_stream_event",
    "finish_reason",
    "summarize",
    "to_chat_completion",
    "to_gemini_request",
    "translate_error",
    "usage_of",
]

_T = TypeVar("_T")
_encode = msgspec.json.Encoder().encode
_decode_response = msgspec.json.Decoder(g.GenerateContentResponse).decode
_decode_error = msgspec.json.Decoder(g.GoogleErrorEnvelope).decode
_SIGNED = "__thought__"  # tool call id = Gemini's call id + _SIGNED + thought signature
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)(?:;[^,;]*)*;base64,(.*)$", re.DOTALL)


def _given(value: _T | UnsetType | None) -> _T | UnsetType:
    """OpenAI's ``null`` and an absent field mean the same here: not set."""
    return UNSET if value is None else value


# --- request: OpenAI → Gemini ---


def to_gemini_request(
    req: ChatCompletionRequest, *, replay_signature: str | None = None
) -> g.GenerateContentRequest:
    """The Gemini body for a validated chat request (the upstream model goes in the URL).

    ``replay_signature`` is set on replayed function calls that carry no thought
    signature of their own: Gemini 3 refuses such a history, and Google documents the
    sentinel ``skip_thought_signature_validator`` for it (the adapter passes it for
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
    return InvalidValue(f"{what} is not supported on Gemini routes.", param=param)


def _refuse_unsupported(req: ChatCompletionRequest) -> None:
    """Fields that would change the answer and have no Gemini equivalent here. Fields
    that do not change it (metadata, user, store, service_tier, prompt_cache_*) are
    not sent and need no refusal."""
    checks: list[tuple[bool, str, str]] = [
        (bool(_given(req.logit_bias)), "logit_bias", "logit_bias"),
        (req.logprobs is True, "logprobs", "logprobs"),
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
        (req.parallel_tool_calls is False, "parallel_tool_calls", "parallel_tool_calls=false"),
        (req.functions is not UNSET, "functions", "The legacy functions field (use tools)"),
        (req.function_call is not UNSET, "function_call", "The legacy function_call field"),
    ]
    for refused, param, what in checks:
        if refused:
            raise _unsupported(param, what)
    seed = _given(req.seed)
    if isinstance(seed, int) and not -(2**31) <= seed < 2**31:
        raise InvalidValue("Gemini routes take a seed that fits in 32 bits.", param="seed")


def _generation_config(req: ChatCompletionRequest) -> g.GenerationConfig:
    ceiling = _given(req.max_completion_tokens)
    if ceiling is UNSET:
        ceiling = _given(req.max_tokens)
    mime, schema = _response_format(req)
    return g.GenerationConfig(
        stop_sequences=_stop(req),
        response_mime_type=mime,
        response_json_schema=schema,
        candidate_count=_given(req.n),
        max_output_tokens=ceiling,
        temperature=_given(req.temperature),
        top_p=_given(req.top_p),
        seed=_given(req.seed),
        presence_penalty=_given(req.presence_penalty),
        frequency_penalty=_given(req.frequency_penalty),
    )


def _stop(req: ChatCompletionRequest) -> list[str] | UnsetType:
    stop = _given(req.stop)
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


def _text_of(content: TextContent) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


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
                system.append(g.Part(text=_text_of(message.content)))
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
            data = _given(part.file.file_data)
            if data is UNSET:
                raise _unsupported(f"{param}.file.file_id", "A file_id")
            return g.Part(inline_data=_blob(data, f"{param}.file.file_data"))


def _blob(data_url: str, param: str) -> g.Blob:
    match = _DATA_URL.match(data_url)
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
    content = _given(message.content)
    if isinstance(content, str):
        parts += [g.Part(text=content)] if content else []
    elif isinstance(content, list):
        parts += [g.Part(text=_assistant_text(part)) for part in content]
    calls = message.tool_calls if message.tool_calls is not UNSET else []
    for j, call in enumerate(calls):
        param = f"messages.[{i}].tool_calls.[{j}]"
        if not isinstance(call, ChatCompletionMessageToolCall):
            raise _unsupported(param, "A custom tool call")
        args = _arguments(call.function.arguments, f"{param}.function.arguments")
        call_names[call.id] = call.function.name
        call_id, _, signature = call.id.partition(_SIGNED)
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


def _arguments(raw: str, param: str) -> dict[str, Any]:
    try:
        args = json.loads(raw) if raw.strip() else {}
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise InvalidValue("Tool call arguments must be a JSON object.", param=param)
    return args


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
        id=message.tool_call_id.partition(_SIGNED)[0],
        name=name,
        response=_result_object(_text_of(message.content)),
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


# --- response: Gemini → OpenAI ---

_CONTENT_FILTER = frozenset(
    {
        "SAFETY",
        "RECITATION",
        "BLOCKLIST",
        "PROHIBITED_CONTENT",
        "SPII",
        "IMAGE_SAFETY",
        "IMAGE_PROHIBITED_CONTENT",
        "IMAGE_RECITATION",
    }
)


def finish_reason(native: str | None, *, tool_calls: bool) -> FinishReason:
    """Gemini's ``finishReason`` as OpenAI's: STOP → stop (tool_calls when the candidate
    called a function), MAX_TOKENS → length, the safety family → content_filter; the
    rest (OTHER, LANGUAGE, MALFORMED_FUNCTION_CALL, …) has no OpenAI value and → stop."""
    if native == "MAX_TOKENS":
        return "length"
    if native in _CONTENT_FILTER:
        return "content_filter"
    return "tool_calls" if tool_calls else "stop"


def usage_of(meta: g.UsageMetadata | None) -> Usage | None:
    """OpenAI usage from ``usageMetadata``; None when Gemini did not report the prompt's
    count (then usage is unknown, not zero). Tool-use prompt tokens are input too."""
    if meta is None or meta.prompt_token_count is None:
        return None
    prompt = meta.prompt_token_count + (meta.tool_use_prompt_token_count or 0)
    thoughts = meta.thoughts_token_count or 0
    completion = (meta.candidates_token_count or 0) + thoughts
    return Usage(
        completion_tokens=completion,
        prompt_tokens=prompt,
        total_tokens=prompt + completion,
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=thoughts),
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=meta.cached_content_token_count or 0
        ),
    )


def decode_response(
    body: bytes, *, provider_request_id: str | None = None
) -> g.GenerateContentResponse:
    """A 200 body; undecodable JSON is a ``protocol`` failure."""
    try:
        return _decode_response(body)
    except msgspec.DecodeError as exc:
        raise GeminiError(
            "protocol",
            200,
            "The upstream provider sent a malformed response.",
            provider_request_id=provider_request_id,
            upstream_message=str(exc),
        ) from exc


class _StreamEvent(g.GenerateContentResponse, kw_only=True):
    """A stream event; Google ends a failing stream with an ``{"error": …}`` event, which
    is not part of GenerateContentResponse (hence fenced off here)."""

    error: g.GoogleError | None = None


_decode_event = msgspec.json.Decoder(_StreamEvent).decode


def decode_stream_event(data: bytes) -> g.GenerateContentResponse:
    """One SSE event's ``data`` (a whole GenerateContentResponse); an error event raises
    its ``GeminiError``."""
    try:
        event = _decode_event(data)
    except msgspec.DecodeError as exc:
        raise GeminiError(
            "protocol",
            200,
            "The upstream provider sent a malformed stream event.",
            upstream_message=str(exc),
        ) from exc
    if event.error is not None:
        raise _from_google(event.error.code or 500, event.error, None, None)
    return event


def _keyed(candidates: Iterable[g.Candidate]) -> dict[int, g.Candidate]:
    """Candidates by their own index, in upstream order; a repeated index (two absent
    ones included) is a protocol error."""
    keyed: dict[int, g.Candidate] = {}
    for candidate in candidates:
        index = candidate.index if candidate.index is not None else 0
        if index in keyed:
            raise GeminiError(
                "protocol",
                200,
                "The upstream provider sent two candidates with the same index.",
                upstream_message=f"duplicate candidate index {index}",
            )
        keyed[index] = candidate
    return keyed


_Call = tuple[g.ResponseFunctionCall, str | None]  # a function call and its thought signature


def _call_id(call: _Call, prefix: str, index: int, k: int) -> str:
    """Gemini's id (or a stable one), with the call's thought signature appended after
    ``_SIGNED``: the client sends the id back with the tool result, which is how the
    signature Gemini 3 requires on a replayed call survives an OpenAI round trip."""
    function, signature = call
    base = function.id or f"call_{prefix}_{index}_{k}"
    return f"{base}{_SIGNED}{signature}" if signature else base


def _parts(candidate: g.Candidate) -> tuple[str | None, list[_Call]]:
    """Visible text (thought summaries left out) and function calls of a candidate."""
    texts: list[str] = []
    calls: list[_Call] = []
    parts = candidate.content.parts if candidate.content is not None else []
    for part in parts:
        if part.thought:
            continue
        if part.text is not None:
            texts.append(part.text)
        if part.function_call is not None:
            calls.append((part.function_call, part.thought_signature))
    return ("".join(texts) if texts else None), calls


def _args_json(call: _Call) -> str:
    return json.dumps(call[0].args or {}, ensure_ascii=False, separators=(",", ":"))


def _blocked(resp: g.GenerateContentResponse, provider_request_id: str | None) -> GeminiError:
    reason = resp.prompt_feedback.block_reason if resp.prompt_feedback else None
    return GeminiError(
        "blocked",
        200,
        f"The provider's safety filters blocked the prompt ({reason or 'no reason given'}).",
        param="messages",
        provider_request_id=provider_request_id,
        usage=usage_of(resp.usage_metadata),
    )


def to_chat_completion(
    resp: g.GenerateContentResponse,
    *,
    completion_id: str,
    created: int,
    model: str,
    provider_request_id: str | None = None,
) -> ChatCompletion:
    """One chat.completion: a choice per candidate, at the candidate's own index (sorted);
    usage absent when Gemini reported none. A prompt blocked before any candidate was
    generated raises ``GeminiError`` ``blocked``."""
    if not resp.candidates and resp.prompt_feedback and resp.prompt_feedback.block_reason:
        raise _blocked(resp, provider_request_id)
    keyed = _keyed(resp.candidates)
    choices = [_choice(index, keyed[index], completion_id) for index in sorted(keyed)]
    usage = usage_of(resp.usage_metadata)
    return ChatCompletion(
        id=completion_id,
        choices=choices,
        created=created,
        model=model,
        usage=UNSET if usage is None else usage,
    )


def _choice(index: int, candidate: g.Candidate, prefix: str) -> Choice:
    text, calls = _parts(candidate)
    tool_calls = [
        ToolCall(
            id=_call_id(call, prefix, index, k),
            type="function",
            function=FunctionCall(name=call[0].name, arguments=_args_json(call)),
        )
        for k, call in enumerate(calls)
    ]
    return Choice(
        finish_reason=finish_reason(candidate.finish_reason, tool_calls=bool(calls)),
        index=index,
        message=Message(content=text, refusal=None, tool_calls=tool_calls or UNSET),
        logprobs=None,
    )


# --- stream ---


@dataclass(slots=True)
class _ChoiceState:
    """One choice of a stream, keyed by Gemini's candidate index."""

    started: bool = False  # the role was sent
    tool_calls: int = 0  # tool calls sent so far (the next one's OpenAI index)
    finish: FinishReason | None = None


class GeminiStream:
    """Gemini stream events in, OpenAI chunks out, one chunk per choice change.

    Usage rides on Gemini's events (the last one wins); ``close()`` turns it into the
    final ``choices: []`` usage chunk when the stream ends cleanly."""

    def __init__(self, *, completion_id: str, created: int, model: str) -> None:
        self.completion_id = completion_id
        self.created = created
        self.model = model
        self.choices: dict[int, _ChoiceState] = {}
        self.usage: Usage | None = None
        self.model_version: str | None = None

    def feed(self, event: g.GenerateContentResponse) -> list[ChatCompletionChunk]:
        if not event.candidates and event.prompt_feedback and event.prompt_feedback.block_reason:
            raise _blocked(event, None)
        chunks: list[ChatCompletionChunk] = []
        for index, candidate in _keyed(event.candidates).items():
            chunks += self._candidate(index, candidate)
        usage = usage_of(event.usage_metadata)
        if usage is not None:
            self.usage = usage
        self.model_version = event.model_version or self.model_version
        return chunks

    @property
    def complete(self) -> bool:
        """Every choice seen has finished. Gemini has no end marker and reports usage on
        every event, so a stream cut between events looks clean: this tells them apart."""
        return bool(self.choices) and all(c.finish is not None for c in self.choices.values())

    def close(self) -> list[ChatCompletionChunk]:
        """The usage chunk, when Gemini reported usage and the stream is complete; a cut
        stream's running usage is not the attempt's usage, so it stays unreported."""
        if self.usage is None or not self.complete:
            return []
        return [self._chunk([], usage=self.usage)]

    def events(self, data: bytes) -> list[StreamEvent]:
        """One Gemini event's ``data`` in, the OpenAI SSE events to relay out (raw bytes
        with their settlement summary): what the adapter yields to the relay."""
        return [_event(chunk) for chunk in self.feed(decode_stream_event(data))]

    def end(self) -> list[StreamEvent]:
        """At the upstream's end of stream: the usage event and ``[DONE]`` when the stream
        is complete; nothing when it was cut, so the relay sees a stream that ended
        without usage or ``[DONE]`` (its row stays pending, its hold reserved, until reconciled)."""
        if not self.complete:
            return []
        return [*map(_event, self.close()), StreamEvent(DONE, None, done=True)]

    def _candidate(self, index: int, candidate: g.Candidate) -> list[ChatCompletionChunk]:
        state = self.choices.setdefault(index, _ChoiceState())
        if state.finish is not None:
            raise GeminiError(
                "protocol",
                200,
                "The upstream provider continued a candidate after it finished.",
                upstream_message=f"candidate {index} after finishReason",
            )
        text, calls = _parts(candidate)
        out: list[ChatCompletionChunk] = []
        delta = self._delta(index, state, text, calls)
        if delta is not None:
            out.append(self._chunk([ChunkChoice(delta=delta, finish_reason=None, index=index)]))
        if candidate.finish_reason is not None:
            state.finish = finish_reason(candidate.finish_reason, tool_calls=state.tool_calls > 0)
            finish = Delta() if state.started else Delta(role="assistant")
            state.started = True
            out.append(
                self._chunk([ChunkChoice(delta=finish, finish_reason=state.finish, index=index)])
            )
        return out

    def _delta(
        self,
        index: int,
        state: _ChoiceState,
        text: str | None,
        calls: list[_Call],
    ) -> Delta | None:
        if text is None and not calls:
            return None
        deltas = [
            ToolCallDelta(
                index=state.tool_calls + k,
                id=_call_id(call, self.completion_id, index, state.tool_calls + k),
                type="function",
                function={"name": call[0].name, "arguments": _args_json(call)},
            )
            for k, call in enumerate(calls)
        ]
        state.tool_calls += len(calls)
        delta = Delta(
            content=UNSET if text is None else text,
            role=UNSET if state.started else "assistant",
            tool_calls=deltas or UNSET,
        )
        state.started = True
        return delta

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


def _event(chunk: ChatCompletionChunk) -> StreamEvent:
    data = _encode(chunk)  # kept: the fan-out merge rewrites chunks from their data
    return StreamEvent(encode_event(data), summarize(chunk), data=data)


def summarize(obj: ChatCompletion | ChatCompletionChunk) -> ResponseSummary:
    """The settlement view (ids, indexes, finish reasons, usage) of what the translator
    produced, without encoding and decoding it again."""
    return msgspec.convert(msgspec.to_builtins(obj), ResponseSummary)


# --- errors ---

GeminiErrorKind = Literal[
    "invalid",  # the request is at fault: relayed as 400 invalid_value
    "context",  # the prompt is too long: 400 context_length_exceeded
    "blocked",  # the prompt was blocked by safety filters: 400 content_filter
    "candidates",  # n > 1 refused: 400 route_does_not_support_candidates
    "rate_limit",  # 429 RESOURCE_EXHAUSTED
    "overloaded",  # 503 UNAVAILABLE
    "timeout",  # 504 DEADLINE_EXCEEDED
    "auth",  # the route's credential was refused: 502, not the client's fault
    "route",  # the route is misconfigured (unknown model, billing): 502
    "upstream",  # 5xx, HTML error pages, anything else: 502
    "protocol",  # a 200 whose body is not what Gemini sends: 502
]

# kind -> (the client's error class, retryable on the same route)
_KINDS: dict[str, tuple[type[NcapError], bool]] = {
    "invalid": (InvalidValue, False),
    "context": (ContextLengthExceeded, False),
    "blocked": (InvalidValue, False),
    "candidates": (RouteDoesNotSupportCandidates, False),
    "rate_limit": (RateLimitExceeded, True),
    "overloaded": (Overloaded, True),
    "timeout": (UpstreamTimeout, True),
    "auth": (UpstreamError, False),
    "route": (UpstreamError, False),
    "upstream": (UpstreamError, True),
    "protocol": (UpstreamError, False),
}
_CLIENT_FAULTS = frozenset({"invalid", "context", "blocked"})


@dataclass(slots=True)
class GeminiError(Exception):
    """One Gemini failure, normalized: what the client is told and whether to retry.

    ``client_fault`` failures are the request's own (no retry, no fallback); the others
    are the route's (a fallback may serve). ``max_candidates`` is set on a candidates
    refusal: the most the provider says it accepts (1 unless the message states a
    range). ``upstream_message`` is the provider's own text, for logs."""

    kind: GeminiErrorKind
    upstream_status: int | None
    message: str
    param: str | None = None
    retry_after: float | None = None
    provider_request_id: str | None = None
    max_candidates: int | None = None
    upstream_message: str = ""
    usage: Usage | None = field(default=None)

    @property
    def error_class(self) -> type[NcapError]:
        return _KINDS[self.kind][0]

    @property
    def status(self) -> int:
        return self.error_class.status

    @property
    def code(self) -> str | None:
        return "content_filter" if self.kind == "blocked" else self.error_class.code

    @property
    def retryable(self) -> bool:
        return _KINDS[self.kind][1]

    @property
    def client_fault(self) -> bool:
        return self.kind in _CLIENT_FAULTS

    def as_ncap_error(self) -> NcapError:
        """The error the client receives (OpenAI's envelope via the edge handler)."""
        code = "content_filter" if self.kind == "blocked" else None
        return self.error_class(
            self.message, param=self.param, retry_after=self.retry_after, code=code
        )

    def __str__(self) -> str:
        return f"gemini {self.kind} {self.upstream_status or ''} {self.upstream_message}".strip()


_RANGE = re.compile(r"candidate_?count.*?to (\d+) \(exclusive\)", re.IGNORECASE | re.DOTALL)
_MUST_BE = re.compile(r"candidate_?count must be (\d+)", re.IGNORECASE)
_REFUSES = re.compile(
    r"multiple candidates is not enabled|only one candidate|candidate_?count", re.IGNORECASE
)
_TOO_LONG = re.compile(r"input token count.*exceeds the maximum", re.IGNORECASE | re.DOTALL)
_DELAY = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s*$")


def _refused_maximum(message: str) -> int | None:
    """The most candidates a 400 says the model accepts, or None when the 400 is not a
    refusal of the candidate count. Known wordings: "Multiple candidates is not enabled
    for this model", "candidateCount must be 1 but the entered value was 3", "…supported
    range is from 1 (inclusive) to 9 (exclusive)", "Only one candidate can be
    specified"."""
    if not _REFUSES.search(message):
        return None
    if (match := _RANGE.search(message)) is not None:
        return max(1, int(match.group(1)) - 1)
    if (match := _MUST_BE.search(message)) is not None:
        return max(1, int(match.group(1)))
    return 1


def _retry_delay(error: g.GoogleError, header: str | None) -> float | None:
    """``RetryInfo.retryDelay`` ("17s") in the error's details, else ``Retry-After``."""
    for detail in error.details:
        if detail.retry_delay and (match := _DELAY.match(detail.retry_delay)):
            return float(match.group(1))
    if header is not None:
        try:
            return max(0.0, float(header))
        except ValueError:
            return None
    return None


def _parse_error(body: bytes) -> g.GoogleError | None:
    try:
        return _decode_error(body).error
    except msgspec.DecodeError:
        return None


def translate_error(
    status: int,
    body: bytes,
    *,
    retry_after: str | None = None,
    provider_request_id: str | None = None,
) -> GeminiError:
    """A non-200 Gemini answer as a ``GeminiError`` (``retry_after``: the raw
    ``Retry-After`` header, used only when the body has no ``RetryInfo``)."""
    error = _parse_error(body)
    if error is None:
        return GeminiError(
            "upstream",
            status,
            f"The upstream provider failed (HTTP {status}).",
            retry_after=_header_delay(retry_after),
            provider_request_id=provider_request_id,
            upstream_message=body[:200].decode("utf-8", "replace"),
        )
    return _from_google(status, error, retry_after, provider_request_id)


def _from_google(
    status: int, error: g.GoogleError, retry_after: str | None, provider_request_id: str | None
) -> GeminiError:
    kind, message, param, maximum = _classify(status, error)
    return GeminiError(
        kind,
        status,
        message,
        param=param,
        retry_after=_retry_delay(error, retry_after) if _KINDS[kind][1] else None,
        provider_request_id=provider_request_id,
        max_candidates=maximum,
        upstream_message=error.message,
    )


def _header_delay(header: str | None) -> float | None:
    return _retry_delay(g.GoogleError(), header)


def _classify(
    status: int, error: g.GoogleError
) -> tuple[GeminiErrorKind, str, str | None, int | None]:
    """(kind, client message, param, max candidates) for a Google error envelope."""
    upstream = error.message or error.status or f"HTTP {status}"
    reasons = {d.reason for d in error.details if d.reason}
    if status in (401, 403) or reasons & {"API_KEY_INVALID", "API_KEY_SERVICE_BLOCKED"}:
        return (
            "auth",
            "The upstream provider refused the gateway's credential for this route.",
            None,
            None,
        )
    if status == 400 and error.status in (None, "INVALID_ARGUMENT"):
        maximum = _refused_maximum(upstream)
        if maximum is not None:
            message = (
                f"The route's provider refused n > 1 (Upstream: {upstream}); it accepts at "
                f"most {maximum} candidate(s). Send n <= {maximum}."
            )
            return "candidates", message, "n", maximum
        if _TOO_LONG.search(upstream):
            return "context", f"Upstream: {upstream}", "messages", None
        return "invalid", f"Upstream: {upstream}", None, None
    return _by_status(status, upstream)


def _by_status(status: int, upstream: str) -> tuple[GeminiErrorKind, str, str | None, int | None]:
    if status == 429:
        return "rate_limit", "The upstream provider's quota is exhausted; retry later.", None, None
    if status == 503:
        return (
            "overloaded",
            "The upstream model is overloaded; retry after a brief delay.",
            None,
            None,
        )
    if status == 504:
        return "timeout", "The upstream provider timed out.", None, None
    if status in (400, 404):  # FAILED_PRECONDITION, NOT_FOUND: the route, not the request
        return "route", f"The route's upstream rejected its configuration ({upstream}).", None, None
    return "upstream", f"The upstream provider failed (HTTP {status}).", None, None
