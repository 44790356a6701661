"""Validate request bodies on the hot path: JSON → dict (forwarded) + typed struct (read).

msgspec decodes the body to builtins once; the top-level field check is a set
operation; ``msgspec.convert`` then checks types, ranges, enums and nested shapes in
C. Only the cross-field rules the structs cannot express run in Python.

Every failure is an ``ncap.errors.InvalidRequest`` subclass whose ``param`` follows
OpenAI's own convention:

- a top-level field is its name: ``temperature``;
- nested object fields are joined with ``.``, array indexes are ``[i]`` segments:
  ``messages.[0].content``, ``messages.[1].content.[0].image_url.detail``,
  ``response_format.json_schema.name``, ``stop.[2]``;
- a missing or unknown field is named by its own path (``messages.[0].tool_call_id``);
- an array or object that is too long, and a bad key or value of a map
  (``logit_bias``, ``metadata``), is reported on the container itself: ``stop``,
  ``logit_bias``;
- a cross-field rule names the field that is not allowed or is missing
  (``top_logprobs``, ``stream_options``, ``audio``);
- a body that is not JSON, or not a JSON object, has ``param`` None.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from functools import cache
from types import EllipsisType
from typing import Any, NamedTuple, TypeVar

import msgspec
import msgspec.inspect as mi
from msgspec import UNSET

from ncap.errors import (
    InvalidJSON,
    InvalidRequest,
    InvalidType,
    InvalidValue,
    MissingParameter,
    UnknownParameter,
)
from ncap.protocol.chat import (
    ChatCompletionAllowedToolsChoice,
    ChatCompletionRequest,
    ChatCompletionRequestAssistantMessage,
    ChatCompletionTool,
    ResponseFormatJsonSchema,
)
from ncap.protocol.completions import CompletionRequest

__all__ = [
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "MAX_DEPTH",
    "MULTI_CANDIDATE_FIELDS",
    "ExtraFields",
    "parse_chat_request",
    "parse_completion_request",
]

ExtraFields = Callable[[object], Collection[str]]
"""Given the body's ``model`` value, the extra top-level fields its route allow-lists."""

MAX_DEPTH = 128
"""Deepest nesting accepted inside free-form JSON (function parameters, JSON schemas,
allow-listed extras; the typed parts are shallow by construction). Well inside the
interpreter's recursion limit, so that whatever later encodes or walks the forwarded body
cannot exhaust it."""

MULTI_CANDIDATE_FIELDS = frozenset(
    {
        "best_of",
        "candidate_count",
        "candidateCount",
        "num_return_sequences",
        "num_generations",
        "num_samples",
        "n_candidates",
    }
)
"""Body fields, unknown to the chat reference, that could ask a provider for several
choices: refused as any unknown field, but recorded as denials and counted apart
(``multi_candidate="true"``) so that the operator's search for such callers is one
query."""

CHAT_FIELDS = frozenset(ChatCompletionRequest.__struct_fields__)
COMPLETION_FIELDS = frozenset(CompletionRequest.__struct_fields__)

_Request = TypeVar("_Request", ChatCompletionRequest, CompletionRequest)
_Segment = str | int | EllipsisType


def parse_chat_request(
    raw: bytes, *, extra_fields: ExtraFields | None = None
) -> tuple[dict[str, Any], ChatCompletionRequest]:
    """Return the decoded body (allow-listed extras kept) and the validated request.

    ``extra_fields`` is called with the body's ``model`` value (any JSON value, or
    None when absent) only when the body has fields beyond the reference's 37.
    """
    body = _decode_object(raw)
    fields = _known_fields(body, CHAT_FIELDS, extra_fields)
    request = _convert(fields, ChatCompletionRequest)
    _check_chat_rules(request)
    free = _free_form(request)
    if free or body is not fields:  # else nothing is of unbounded depth
        _check_depth(raw, free + _extras(body, fields))
    return body, request


def parse_completion_request(
    raw: bytes, *, extra_fields: ExtraFields | None = None
) -> tuple[dict[str, Any], CompletionRequest]:
    """The same for the legacy ``/v1/completions`` body (where ``best_of`` is known)."""
    body = _decode_object(raw)
    fields = _known_fields(body, COMPLETION_FIELDS, extra_fields)
    request = _convert(fields, CompletionRequest)
    _check_completion_rules(request)
    _check_depth(raw, _extras(body, fields))
    return body, request


# --- steps ---


def _decode_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise InvalidJSON("The request body is empty; expected a JSON object.")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        reason = str(exc).partition(_AT)[0]
        raise InvalidJSON(f"We could not parse the JSON body of your request: {reason}.") from None
    except RecursionError:
        raise InvalidJSON(
            f"The JSON body of your request is nested more than {MAX_DEPTH} levels deep."
        ) from None
    if not isinstance(body, dict):
        raise InvalidJSON("The request body must be a JSON object.")
    return body


def _known_fields(
    body: dict[str, Any], known: frozenset[str], extra_fields: ExtraFields | None
) -> dict[str, Any]:
    """The body without the route's allow-listed extras; any other unknown field is an error."""
    if known.issuperset(body):
        return body
    allowed = extra_fields(body.get("model")) if extra_fields is not None else ()
    for key in body:
        if key not in known and key not in allowed:
            raise UnknownParameter(
                f"Unrecognized request argument supplied: '{_clip(key)}'. Fields the API "
                "reference does not define are rejected unless the route allow-lists them.",
                param=key,
            )
    return {key: value for key, value in body.items() if key in known}


def _convert(fields: dict[str, Any], cls: type[_Request]) -> _Request:
    try:
        return msgspec.convert(fields, cls)
    except msgspec.ValidationError as exc:
        raise _translate(str(exc), fields, cls) from None


def _check_chat_rules(request: ChatCompletionRequest) -> None:
    if _given(request.top_logprobs) and request.logprobs is not True:
        raise InvalidValue(
            "Invalid value for 'top_logprobs': it is only allowed when 'logprobs' is true.",
            param="top_logprobs",
        )
    _check_stream_options(request.stream_options, request.stream)
    if request.modalities and "audio" in request.modalities and not _given(request.audio):
        raise MissingParameter(
            "Missing required parameter: 'audio' (required when 'modalities' includes 'audio').",
            param="audio",
        )
    for index, message in enumerate(request.messages):
        if (
            type(message) is ChatCompletionRequestAssistantMessage
            and (message.content is None or message.content is UNSET)
            and not _has_other_content(message)
        ):
            raise MissingParameter(
                f"Missing required parameter: 'messages.[{index}].content' (an assistant "
                "message needs content unless it has tool_calls, function_call, refusal or "
                "audio).",
                param=f"messages.[{index}].content",
            )


def _check_completion_rules(request: CompletionRequest) -> None:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt:
        kind = type(prompt[0])
        if any(type(item) is not kind for item in prompt):
            raise InvalidValue(
                "Invalid value for 'prompt': expected a string, an array of strings, an array "
                "of token ids or an array of token-id arrays, not a mix of them.",
                param="prompt",
            )
    _check_stream_options(request.stream_options, request.stream)
    best_of = request.best_of
    if isinstance(best_of, int) and isinstance(request.n, int) and best_of < request.n:
        raise InvalidValue(
            f"Invalid value for 'best_of': it must be >= 'n' ({request.n}), but got {best_of}.",
            param="best_of",
        )
    n = request.n if isinstance(request.n, int) else 1
    if isinstance(best_of, int) and best_of > n and request.stream is True:
        raise InvalidValue(
            "Invalid value for 'best_of': results cannot be streamed when 'best_of' > 'n' "
            "(the best candidates are chosen once all are complete).",
            param="best_of",
        )


def _check_stream_options(stream_options: object, stream: object) -> None:
    if _given(stream_options) and stream is not True:
        raise InvalidValue(
            "The 'stream_options' parameter is only allowed when 'stream' is true.",
            param="stream_options",
        )


def _free_form(request: ChatCompletionRequest) -> list[Any]:
    """The request's free-form JSON (typed as ``Any``), the only parts of unbounded depth."""
    values: list[Any] = []
    if request.tools:
        values.extend(t.function.parameters for t in request.tools if type(t) is ChatCompletionTool)
    if request.functions:
        values.extend(function.parameters for function in request.functions)
    if type(request.response_format) is ResponseFormatJsonSchema:
        values.append(request.response_format.json_schema.schema)
    if type(request.tool_choice) is ChatCompletionAllowedToolsChoice:
        values.append(request.tool_choice.allowed_tools.tools)
    return values


def _extras(body: dict[str, Any], fields: dict[str, Any]) -> list[Any]:
    """The allow-listed extra fields' values (forwarded as they are, so of unbounded depth)."""
    return [value for key, value in body.items() if key not in fields] if body is not fields else []


def _check_depth(raw: bytes, values: list[Any]) -> None:
    """Reject containers nested beyond ``MAX_DEPTH`` in free-form values.

    The typed parts of a request are shallow by construction, so only free-form values
    are walked, and only when the body has enough brackets to be that deep at all.
    """
    containers = [value for value in values if type(value) in _CONTAINERS] if values else values
    if containers and raw.count(b"{") + raw.count(b"[") > MAX_DEPTH and _too_deep(containers):
        raise InvalidJSON(
            f"The JSON body of your request is nested more than {MAX_DEPTH} levels deep."
        )


_CONTAINERS = (dict, list)


def _too_deep(level: list[Any]) -> bool:
    """Whether these containers nest beyond ``MAX_DEPTH``, walked one level at a time
    (iteratively, so the walk itself cannot exhaust the stack)."""
    for _ in range(MAX_DEPTH):
        level = [
            child
            for node in level
            for child in (node.values() if type(node) is dict else node)
            if type(child) in _CONTAINERS
        ]
        if not level:
            return False
    return True


def _given(value: object) -> bool:
    return value is not UNSET and value is not None


def _has_other_content(message: ChatCompletionRequestAssistantMessage) -> bool:
    return (
        bool(message.tool_calls)
        or _given(message.function_call)
        or _given(message.refusal)
        or _given(message.audio)
    )


# --- msgspec.ValidationError → ncap error ---


class _Where(NamedTuple):
    param: str
    segments: tuple[_Segment, ...]
    is_key: bool
    value: Any
    type: mi.Type | None


_Render = Callable[[re.Match[str], _Where], str]

_AT = " - at `"
_KEY_PREFIX = "key` in `"
_SEGMENT = re.compile(r"\.(\w+)|\[(\d+)\]|\[\.\.\.\]")

_RULES: tuple[tuple[re.Pattern[str], type[InvalidRequest], _Render, bool], ...] = (
    # pattern on msgspec's message, error class, message, whether the param is a child field
    (
        re.compile(r"Object missing required field `(?P<field>.*)`\Z", re.S),
        MissingParameter,
        lambda m, w: f"Missing required parameter: '{_clip(w.param)}'.",
        True,
    ),
    (
        re.compile(r"Object contains unknown field `(?P<field>.*)`\Z", re.S),
        UnknownParameter,
        lambda m, w: f"Unrecognized request argument supplied: '{_clip(w.param)}'.",
        True,
    ),
    (
        re.compile(r"Expected `(?P<expected>[^`]+)`, got `(?P<got>[^`]+)`\Z"),
        InvalidType,
        lambda m, w: (
            f"Invalid type for '{w.param}': expected {_type_names(m['expected'])}, "
            f"but got {_type_names(m['got'])} instead."
        ),
        False,
    ),
    (
        re.compile(r"Invalid (?:enum )?value (?P<value>.*)\Z", re.S),
        InvalidValue,
        lambda m, w: _render_enum(_clip(m["value"]), w),
        False,
    ),
    (
        re.compile(r"Expected `(?P<kind>[^`]+)` (?P<constraint>.+)\Z", re.S),
        InvalidValue,
        lambda m, w: _render_constraint(m["kind"], m["constraint"], w),
        False,
    ),
)


def _translate(text: str, body: dict[str, Any], cls: type) -> InvalidRequest:
    """Map msgspec's stable message format onto the error classes, via ``_RULES``."""
    detail, _, location = text.rpartition(_AT) if _AT in text else (text, "", "$`")
    is_key = location.startswith(_KEY_PREFIX)
    segments = _parse_path(location.removeprefix(_KEY_PREFIX)[:-1])
    for pattern, error, render, child in _RULES:
        match = pattern.match(detail)
        if match is not None:
            path = (*segments, match["field"]) if child else segments
            where = _Where(_param(path), path, is_key, *_resolve(cls, path, body, is_key))
            return error(render(match, where), param=where.param or None)
    param = _param(segments)
    return InvalidValue(f"Invalid value for '{param}': {detail}.", param=param or None)


def _parse_path(path: str) -> tuple[_Segment, ...]:
    """``$.messages[0].content`` → ("messages", 0, "content"); ``[...]`` (a map value) → ``...``."""
    segments: list[_Segment] = []
    for match in _SEGMENT.finditer(path):
        name, index = match.groups()
        segments.append(name if name is not None else int(index) if index is not None else ...)
    return tuple(segments)


def _param(segments: tuple[_Segment, ...]) -> str:
    parts: list[str] = []
    for segment in segments:
        if segment is ...:
            break
        parts.append(f"[{segment}]" if isinstance(segment, int) else str(segment))
    return ".".join(parts)


def _render_enum(value: str, where: _Where) -> str:
    literal = _member(where.type, "enum")
    allowed = literal.values if isinstance(literal, mi.LiteralType) else ()
    supported = ", ".join(f"'{item}'" for item in allowed)
    tail = f" Supported values are: {supported}." if supported else ""
    return f"Invalid value for '{where.param}': {value}.{tail}"


def _render_constraint(kind: str, constraint: str, where: _Where) -> str:
    member = _member(where.type, kind)
    expected = _describe(member) if member is not None else f"{_type_names(kind)} {constraint}"
    if where.is_key:
        return f"Invalid key in '{where.param}': every key must be {expected}."
    if ... in where.segments:
        return f"Invalid value in '{where.param}': every value must be {expected}."
    return f"Invalid value for '{where.param}': expected {expected}, but got {_show(where.value)}."


# --- the type and value at a path (error path only) ---


@cache
def _type_info(cls: type) -> mi.Type:
    return mi.type_info(cls)


def _resolve(
    cls: type, segments: tuple[_Segment, ...], body: Any, is_key: bool
) -> tuple[Any, mi.Type | None]:
    """Walk the body and the struct's type info together; the tag field yields its tags."""
    kind: mi.Type | None = _type_info(cls)
    value = body
    for segment in segments:
        kind = _narrow(kind, value)
        if isinstance(kind, mi.UnionType | mi.StructType) and segment == _tag_field(kind):
            return None, mi.LiteralType(values=_tags(kind))
        kind, value = _step(kind, value, segment)
    if is_key:
        narrowed = _narrow(kind, value)
        kind = narrowed.key_type if isinstance(narrowed, mi.DictType) else None
    return value, kind


def _step(kind: mi.Type | None, value: Any, segment: _Segment) -> tuple[mi.Type | None, Any]:
    if isinstance(kind, mi.StructType) and isinstance(segment, str):
        fields = {field.encode_name: field.type for field in kind.fields}
        child = value.get(segment) if isinstance(value, dict) else None
        return fields.get(segment), child
    if isinstance(kind, mi.ListType) and isinstance(segment, int):
        child = value[segment] if isinstance(value, list) and segment < len(value) else None
        return kind.item_type, child
    if isinstance(kind, mi.DictType) and segment is ...:
        return kind.value_type, None
    return None, None


def _narrow(kind: mi.Type | None, value: Any) -> mi.Type | None:
    """The member of a union that the value's JSON kind (and tag, for objects) selects."""
    if not isinstance(kind, mi.UnionType):
        return kind
    if isinstance(value, list):
        return next((t for t in kind.types if isinstance(t, mi.ListType)), kind)
    if isinstance(value, dict):
        objects = [t for t in kind.types if isinstance(t, mi.StructType | mi.DictType)]
        tagged = [t for t in objects if isinstance(t, mi.StructType) and t.tag_field]
        tag = value.get(tagged[0].tag_field) if tagged and tagged[0].tag_field else None
        matching = [t for t in tagged if t.tag == tag]
        return matching[0] if matching else objects[0] if len(objects) == 1 else kind
    return kind


def _tag_field(kind: mi.UnionType | mi.StructType) -> str | None:
    members = kind.types if isinstance(kind, mi.UnionType) else (kind,)
    fields = {t.tag_field for t in members if isinstance(t, mi.StructType)}
    return fields.pop() if len(fields) == 1 else None


def _tags(kind: mi.UnionType | mi.StructType) -> tuple[str, ...]:
    members = kind.types if isinstance(kind, mi.UnionType) else (kind,)
    return tuple(str(t.tag) for t in members if isinstance(t, mi.StructType))


_KINDS: dict[str, tuple[type[mi.Type], ...]] = {
    "int": (mi.IntType,),
    "float": (mi.FloatType,),
    "str": (mi.StrType,),
    "array": (mi.ListType,),
    "object": (mi.DictType, mi.StructType),
    "enum": (mi.LiteralType,),
}


def _member(kind: mi.Type | None, name: str) -> mi.Type | None:
    members = kind.types if isinstance(kind, mi.UnionType) else (kind,)
    wanted = _KINDS.get(name, ())
    return next((t for t in members if isinstance(t, wanted)), None)


# --- human-readable text ---

_TYPE_NAMES = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "a boolean",
    "null": "null",
    "object": "an object",
    "array": "an array",
}


def _type_names(names: str) -> str:
    words = [_TYPE_NAMES.get(name, f"`{name}`") for name in names.split(" | ")]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _describe(kind: mi.Type) -> str:
    """What a constrained type accepts, e.g. "a number between 0 and 2"."""
    if isinstance(kind, mi.IntType | mi.FloatType):
        noun = "an integer" if isinstance(kind, mi.IntType) else "a number"
        return noun + _span(kind.ge, kind.le, " between {} and {}", " >= {}", " <= {}")
    if isinstance(kind, mi.StrType):
        pattern = f" matching the pattern '{kind.pattern}'" if kind.pattern else ""
        return "a string" + _length(kind.min_length, kind.max_length, "character") + pattern
    if isinstance(kind, mi.ListType):
        return "an array" + _length(kind.min_length, kind.max_length, "item")
    if isinstance(kind, mi.DictType):
        return "an object" + _length(kind.min_length, kind.max_length, "key")
    return "a valid value"


def _length(low: int | None, high: int | None, unit: str) -> str:
    units = unit if (high if high is not None else low) == 1 else unit + "s"
    both, low_only, high_only = " of {} to {} ", " of at least {} ", " of at most {} "
    return _span(low, high, both + units, low_only + units, high_only + units)


def _span(low: float | None, high: float | None, both: str, low_only: str, high_only: str) -> str:
    if low is not None and high is not None:
        return both.format(_number(low), _number(high))
    if low is not None:
        return low_only.format(_number(low))
    if high is not None:
        return high_only.format(_number(high))
    return ""


def _number(value: float) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _show(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "null" if value is None else str(value).lower()
    if isinstance(value, int | float):
        return _number(value)
    if isinstance(value, str):
        return f"'{value}'" if len(value) <= 40 else f"a string of {len(value)} characters"
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    if isinstance(value, dict):
        return f"an object with {len(value)} keys"
    return "another value"


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
