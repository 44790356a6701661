"""Generation parameters: the engine's own input, built from a request body.

The engine does not depend on the wire structs: ``chat_params`` and
``completion_params`` read an already-validated request dict (``ncap.protocol.validate``)
and keep what generation needs. Type checks here are a second line, so that the engine
fails with a 400 rather than a crash if it is handed something odd.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ncap.engine.tools import ToolSpec, tool_spec
from ncap.errors import InvalidType, InvalidValue

__all__ = ["GenerationParams", "JsonGrammar", "LegacyRequest", "chat_params", "completion_params"]


@dataclass(frozen=True, slots=True)
class JsonGrammar:
    """Constrain output to JSON: any object (``schema`` None) or one matching ``schema``."""

    schema: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """Everything the engine needs for one request of ``n`` choices."""

    messages: tuple[Mapping[str, Any], ...] | None = None
    prompt: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    json: JsonGrammar | None = None
    # score every sampled token even without logprobs (best_of ranks by it)
    score: bool = False
    tools: ToolSpec | None = None


@dataclass(frozen=True, slots=True)
class LegacyRequest:
    """A /v1/completions request: generate ``params.n`` (= best_of), return ``n``."""

    params: GenerationParams
    n: int
    stream: bool
    include_usage: bool


def chat_params(body: Mapping[str, Any]) -> GenerationParams:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidValue("messages must be a non-empty list", param="messages")
    tools = tool_spec(body)
    json_format = _response_format(body.get("response_format"))
    if tools is not None and json_format is not None:
        raise InvalidValue(
            "the local engine cannot combine tools with a JSON response_format",
            param="response_format",
        )
    return GenerationParams(
        messages=tuple(messages),
        n=_int(body, "n", 1),
        max_tokens=_max_tokens(body),
        logprobs=bool(body.get("logprobs") or False),
        top_logprobs=_int(body, "top_logprobs", 0),
        json=json_format,
        tools=tools,
        **_sampling(body),
    )


def completion_params(body: Mapping[str, Any]) -> LegacyRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidValue("the local engine takes one prompt string", param="prompt")
    for name in ("echo", "suffix"):
        if body.get(name):
            raise InvalidValue(f"{name} is not supported by the local engine", param=name)
    n = _int(body, "n", 1)
    best_of = _int(body, "best_of", n)
    if best_of < n:
        raise InvalidValue("best_of must be greater than or equal to n", param="best_of")
    stream = bool(body.get("stream") or False)
    if stream and best_of > n:
        raise InvalidValue("best_of cannot be used with stream", param="best_of")
    top = body.get("logprobs")
    params = GenerationParams(
        prompt=prompt,
        n=best_of,
        max_tokens=_int(body, "max_tokens", 16),
        logprobs=top is not None,
        top_logprobs=_int(body, "logprobs", 0),
        score=best_of > n,
        **_sampling(body),
    )
    return LegacyRequest(params, n, stream, _include_usage(body))


def include_usage(body: Mapping[str, Any]) -> bool:
    return _include_usage(body)


def _include_usage(body: Mapping[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, Mapping) and bool(opts.get("include_usage"))


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise InvalidType("seed must be an integer", param="seed")
    return {
        "temperature": _float(body, "temperature", 1.0),
        "top_p": _float(body, "top_p", 1.0),
        "seed": seed,
        "frequency_penalty": _float(body, "frequency_penalty", 0.0),
        "presence_penalty": _float(body, "presence_penalty", 0.0),
        "logit_bias": _logit_bias(body.get("logit_bias")),
        "stop": _stop(body.get("stop")),
    }


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    value = body.get(name)
    if value is None:
        return None
    value = _int(body, name, 0)
    if value < 1:
        raise InvalidValue(f"{name} must be at least 1", param=name)
    return value


def _int(body: Mapping[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidType(f"{name} must be an integer", param=name)
    return value


def _float(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidType(f"{name} must be a number", param=name)
    return float(value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidType("stop must be a string or a list of strings", param="stop")
    if len(stops) > 4:
        raise InvalidValue("stop takes at most 4 sequences", param="stop")
    return tuple(s for s in stops if s)


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidType("logit_bias must be an object", param="logit_bias")
    try:
        return {int(k): float(v) for k, v in value.items()}
    except (TypeError, ValueError) as exc:
        raise InvalidValue(
            "logit_bias maps token ids to numbers in [-100, 100]", param="logit_bias"
        ) from exc


def _response_format(value: Any) -> JsonGrammar | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonGrammar()
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if schema is not None and not isinstance(schema, Mapping):
            raise InvalidType("json_schema.schema must be an object", param="response_format")
        return JsonGrammar(schema)
    raise InvalidValue(
        "response_format.type must be text, json_object or json_schema", param="response_format"
    )
