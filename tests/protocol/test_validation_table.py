"""Table-driven checks of request validation: every rule, exact class/code/param."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from ncap.errors import (
    InvalidJSON,
    InvalidRequest,
    InvalidType,
    InvalidValue,
    MissingParameter,
    UnknownParameter,
)
from ncap.protocol.chat import ChatCompletionRequest
from ncap.protocol.completions import CompletionRequest
from ncap.protocol.validate import (
    CHAT_FIELDS,
    MAX_DEPTH,
    parse_chat_request,
    parse_completion_request,
)

CODES: dict[type[InvalidRequest], str] = {
    InvalidJSON: "invalid_json",
    InvalidType: "invalid_type",
    InvalidValue: "invalid_value",
    MissingParameter: "missing_required_parameter",
    UnknownParameter: "unknown_parameter",
}

USER = {"role": "user", "content": "Hello"}
DROP = object()  # a body() override that removes the field


def body(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A minimal valid body with ``fields`` set (or removed, with DROP)."""
    out: dict[str, Any] = {"model": "gpt-4o-mini", "messages": list(messages) or [USER]}
    for key, value in fields.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def raw(value: dict[str, Any] | bytes) -> bytes:
    return value if isinstance(value, bytes) else json.dumps(value).encode()


def nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {}
    for _ in range(depth - 1):
        node = {"a": node}
    return node


def tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "lookup", **function}}


ASSISTANT_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ],
}

# --- valid bodies (also checked against the reference schema in test_wire_schemas_static) ---

VALID_BODIES: list[tuple[str, dict[str, Any]]] = [
    ("minimal", body()),
    (
        "system-developer-user",
        body(
            {"role": "developer", "content": "Be terse.", "name": "ops"},
            {"role": "system", "content": [{"type": "text", "text": "You are helpful."}]},
            {"role": "user", "content": "Hi", "name": "ann"},
        ),
    ),
    (
        "user-content-parts",
        body(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this image?"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "https://example.com/a.png", "detail": "low"},
                    },
                    {"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}},
                    {"type": "file", "file": {"file_id": "file-1", "filename": "a.pdf"}},
                ],
            }
        ),
    ),
    (
        "assistant-tool-calls-and-tool-results",
        body(
            USER,
            ASSISTANT_CALL,
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [{"type": "text", "text": "more"}],
            },
            tools=[tool(parameters={"type": "object", "properties": {}})],
        ),
    ),
    (
        "assistant-content-parts-and-custom-tool-call",
        body(
            USER,
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Sure."}], "name": "bot"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c2", "type": "custom", "custom": {"name": "sql", "input": "SELECT 1"}}
                ],
            },
            {"role": "assistant", "refusal": "No.", "content": None},
            {"role": "assistant", "audio": {"id": "audio_1"}},
            USER,
        ),
    ),
    (
        "deprecated-functions",
        body(
            USER,
            {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
            {"role": "function", "name": "f", "content": "result"},
            {"role": "function", "name": "f", "content": None},
            functions=[{"name": "f", "description": "d", "parameters": {"type": "object"}}],
            function_call={"name": "f"},
        ),
    ),
    (
        "function-and-custom-tools",
        body(
            tools=[
                tool(description="Look it up", parameters={"type": "object"}, strict=True),
                {"type": "custom", "custom": {"name": "free"}},
                {
                    "type": "custom",
                    "custom": {
                        "name": "sql",
                        "description": "SQL",
                        "format": {
                            "type": "grammar",
                            "grammar": {"definition": "start: /.+/", "syntax": "lark"},
                        },
                    },
                },
                {"type": "custom", "custom": {"name": "t", "format": {"type": "text"}}},
            ],
            tool_choice={"type": "function", "function": {"name": "lookup"}},
            parallel_tool_calls=False,
        ),
    ),
    (
        "tool-choice-variants",
        body(
            tools=[tool()],
            tool_choice={
                "type": "allowed_tools",
                "allowed_tools": {
                    "mode": "required",
                    "tools": [{"type": "function", "function": {"name": "lookup"}}],
                },
            },
        ),
    ),
    ("tool-choice-string", body(tools=[tool()], tool_choice="required")),
    ("tool-choice-custom", body(tool_choice={"type": "custom", "custom": {"name": "sql"}})),
    (
        "response-format-json-schema",
        body(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "answer",
                    "description": "An answer",
                    "schema": {"type": "object", "properties": {"a": {"type": "string"}}},
                    "strict": True,
                },
            }
        ),
    ),
    ("response-format-json-object", body(response_format={"type": "json_object"})),
    ("response-format-text", body(response_format={"type": "text"})),
    ("stop-string", body(stop="\n")),
    ("stop-list-of-4", body(stop=["a", "b", "c", "d"])),
    ("logit-bias", body(logit_bias={"50256": -100, "1": 100, "42": 0})),
    (
        "stream-with-options",
        body(stream=True, stream_options={"include_usage": True, "include_obfuscation": False}),
    ),
    (
        "sampling-at-bounds",
        body(
            temperature=0,
            top_p=1,
            frequency_penalty=-2,
            presence_penalty=2.0,
            n=128,
            seed=-(2**63),
            logprobs=True,
            top_logprobs=20,
            max_tokens=1,
            max_completion_tokens=4096,
        ),
    ),
    (
        "every-plain-option",
        body(
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "cache me",
                        "prompt_cache_breakpoint": {"mode": "explicit"},
                    }
                ],
            },
            metadata={"team": "search", "k" * 64: "v" * 512},
            user="user-1",
            safety_identifier="s" * 64,
            prompt_cache_key="pck",
            prompt_cache_retention="24h",
            prompt_cache_options={"ttl": "30m", "mode": "explicit"},
            service_tier="flex",
            verbosity="low",
            reasoning_effort="xhigh",
            store=True,
            n=1,
        ),
    ),
    (
        "audio-output",
        body(modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"}),
    ),
    (
        "audio-custom-voice",
        body(modalities=["audio"], audio={"voice": {"id": "voice_1"}, "format": "mp3"}),
    ),
    (
        "web-search-and-moderation",
        body(
            web_search_options={
                "search_context_size": "high",
                "user_location": {
                    "type": "approximate",
                    "approximate": {"country": "FR", "city": "Paris", "timezone": "Europe/Paris"},
                },
            },
            moderation={"model": "omni-moderation-latest", "policy": {"input": {"mode": "block"}}},
        ),
    ),
    ("prediction-string", body(prediction={"type": "content", "content": "old text"})),
    (
        "prediction-parts",
        body(prediction={"type": "content", "content": [{"type": "text", "text": "old"}]}),
    ),
    (
        "nullable-fields-null",
        body(
            metadata=None,
            temperature=None,
            top_p=None,
            safety_identifier=None,
            prompt_cache_key=None,
            prompt_cache_retention=None,
            service_tier=None,
            modalities=None,
            verbosity=None,
            reasoning_effort=None,
            max_completion_tokens=None,
            frequency_penalty=None,
            presence_penalty=None,
            audio=None,
            store=None,
            moderation=None,
            stream=None,
            stop=None,
            logit_bias=None,
            logprobs=None,
            max_tokens=None,
            n=None,
            prediction=None,
            seed=None,
            stream_options=None,
        ),
    ),
    ("integer-where-number", body(temperature=1, top_p=0, presence_penalty=-1)),
]

EXTRA = {"top_k": 40}


def allow_top_k(model: object) -> tuple[str, ...]:
    return ("top_k",) if model == "gpt-4o-mini" else ()


# --- invalid bodies: (id, body, error class, param) ---

INVALID: list[tuple[str, dict[str, Any] | bytes, type[InvalidRequest], str | None]] = [
    # body level
    ("empty-body", b"", InvalidJSON, None),
    ("not-json", b"model=gpt-4o", InvalidJSON, None),
    ("truncated-json", b'{"model": "m", ', InvalidJSON, None),
    ("json-array", b'[{"model": "m"}]', InvalidJSON, None),
    ("json-string", b'"hello"', InvalidJSON, None),
    ("json-null", b"null", InvalidJSON, None),
    ("invalid-utf8", b'{"model": "\xff"}', InvalidJSON, None),
    ("number-out-of-range", b'{"model": "m", "temperature": 1e999}', InvalidJSON, None),
    ("deep-nesting-raw", b"[" * 5000 + b"]" * 5000, InvalidJSON, None),
    ("deep-object-nesting-raw", b'{"a":' * 3000 + b"1" + b"}" * 3000, InvalidJSON, None),
    (
        "deep-tool-parameters",
        body(tools=[tool(parameters=nested(MAX_DEPTH + 1))]),
        InvalidJSON,
        None,
    ),
    (
        "deep-json-schema",
        body(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": nested(300)},
            }
        ),
        InvalidJSON,
        None,
    ),
    ("deep-allow-listed-extra", body(top_k=nested(200)), InvalidJSON, None),
    # required fields
    ("missing-model", body(model=DROP), MissingParameter, "model"),
    ("missing-messages", body(messages=DROP), MissingParameter, "messages"),
    ("empty-messages", body(messages=[]), InvalidValue, "messages"),
    ("messages-object", body(messages=USER), InvalidType, "messages"),
    ("model-integer", body(model=4), InvalidType, "model"),
    ("model-null", body(model=None), InvalidType, "model"),
    # messages
    ("message-string", body(messages=["hi"]), InvalidType, "messages.[0]"),
    ("message-missing-role", body({"content": "x"}), MissingParameter, "messages.[0].role"),
    (
        "message-unknown-role",
        body({"role": "bot", "content": "x"}),
        InvalidValue,
        "messages.[0].role",
    ),
    ("message-role-integer", body({"role": 1, "content": "x"}), InvalidType, "messages.[0].role"),
    ("user-missing-content", body({"role": "user"}), MissingParameter, "messages.[0].content"),
    (
        "user-content-null",
        body({"role": "user", "content": None}),
        InvalidType,
        "messages.[0].content",
    ),
    (
        "user-content-integer",
        body({"role": "user", "content": 5}),
        InvalidType,
        "messages.[0].content",
    ),
    (
        "user-content-empty-array",
        body({"role": "user", "content": []}),
        InvalidValue,
        "messages.[0].content",
    ),
    (
        "user-part-unknown-type",
        body({"role": "user", "content": [{"type": "video", "video": {}}]}),
        InvalidValue,
        "messages.[0].content.[0].type",
    ),
    (
        "user-part-missing-type",
        body({"role": "user", "content": [{"text": "x"}]}),
        MissingParameter,
        "messages.[0].content.[0].type",
    ),
    (
        "text-part-missing-text",
        body({"role": "user", "content": [{"type": "text"}]}),
        MissingParameter,
        "messages.[0].content.[0].text",
    ),
    (
        "image-detail-enum",
        body(
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "u", "detail": "max"}}],
            }
        ),
        InvalidValue,
        "messages.[0].content.[0].image_url.detail",
    ),
    (
        "image-missing-url",
        body({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}),
        MissingParameter,
        "messages.[0].content.[0].image_url.url",
    ),
    (
        "input-audio-format-enum",
        body(
            {
                "role": "user",
                "content": [{"type": "input_audio", "input_audio": {"data": "x", "format": "ogg"}}],
            }
        ),
        InvalidValue,
        "messages.[0].content.[0].input_audio.format",
    ),
    (
        "system-image-part",
        body(
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}, USER
        ),
        InvalidValue,
        "messages.[0].content.[0].type",
    ),
    (
        "system-part-missing-type",
        body({"role": "system", "content": [{"text": "x"}]}, USER),
        MissingParameter,
        "messages.[0].content.[0].type",
    ),
    (
        "tool-missing-tool-call-id",
        body(USER, {"role": "tool", "content": "42"}),
        MissingParameter,
        "messages.[1].tool_call_id",
    ),
    (
        "assistant-without-content-or-calls",
        body(USER, {"role": "assistant", "content": None}),
        MissingParameter,
        "messages.[1].content",
    ),
    (
        "assistant-empty-tool-calls-no-content",
        body(USER, {"role": "assistant", "tool_calls": []}),
        MissingParameter,
        "messages.[1].content",
    ),
    (
        "tool-call-missing-id",
        body(
            USER,
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": ""}}],
            },
        ),
        MissingParameter,
        "messages.[1].tool_calls.[0].id",
    ),
    (
        "tool-call-arguments-object",
        body(
            USER,
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
                ],
            },
        ),
        InvalidType,
        "messages.[1].tool_calls.[0].function.arguments",
    ),
    (
        "assistant-image-part",
        body(
            USER,
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
        ),
        InvalidValue,
        "messages.[1].content.[0].type",
    ),
    (
        "message-unknown-field",
        body({"role": "user", "content": "x", "foo": 1}),
        UnknownParameter,
        "messages.[0].foo",
    ),
    (
        "part-unknown-field",
        body({"role": "user", "content": [{"type": "text", "text": "x", "foo": 1}]}),
        UnknownParameter,
        "messages.[0].content.[0].foo",
    ),
    (
        "function-message-missing-name",
        body({"role": "function", "content": "x"}),
        MissingParameter,
        "messages.[0].name",
    ),
    (
        "developer-name-integer",
        body({"role": "developer", "content": "x", "name": 1}),
        InvalidType,
        "messages.[0].name",
    ),
    # unknown top-level fields, multi-candidate fields above all
    ("best-of", body(best_of=4), UnknownParameter, "best_of"),
    ("candidate-count", body(candidate_count=4), UnknownParameter, "candidate_count"),
    (
        "num-return-sequences",
        body(num_return_sequences=4),
        UnknownParameter,
        "num_return_sequences",
    ),
    ("unknown-field", body(foo="bar"), UnknownParameter, "foo"),
    ("unknown-field-null", body(foo=None), UnknownParameter, "foo"),
    # numbers
    ("temperature-above", body(temperature=2.5), InvalidValue, "temperature"),
    ("temperature-below", body(temperature=-0.1), InvalidValue, "temperature"),
    ("temperature-string", body(temperature="hot"), InvalidType, "temperature"),
    ("temperature-boolean", body(temperature=True), InvalidType, "temperature"),
    ("top-p-above", body(top_p=1.5), InvalidValue, "top_p"),
    ("top-p-below", body(top_p=-0.5), InvalidValue, "top_p"),
    ("frequency-penalty-above", body(frequency_penalty=2.1), InvalidValue, "frequency_penalty"),
    ("frequency-penalty-array", body(frequency_penalty=[1]), InvalidType, "frequency_penalty"),
    ("presence-penalty-below", body(presence_penalty=-2.5), InvalidValue, "presence_penalty"),
    ("presence-penalty-string", body(presence_penalty="0"), InvalidType, "presence_penalty"),
    ("n-zero", body(n=0), InvalidValue, "n"),
    ("n-above", body(n=129), InvalidValue, "n"),
    ("n-float", body(n=1.5), InvalidType, "n"),
    ("n-integral-float", body(n=2.0), InvalidType, "n"),
    ("n-boolean", body(n=True), InvalidType, "n"),
    ("n-string", body(n="2"), InvalidType, "n"),
    ("top-logprobs-above", body(logprobs=True, top_logprobs=21), InvalidValue, "top_logprobs"),
    ("top-logprobs-below", body(logprobs=True, top_logprobs=-1), InvalidValue, "top_logprobs"),
    ("top-logprobs-without-logprobs", body(top_logprobs=5), InvalidValue, "top_logprobs"),
    (
        "top-logprobs-logprobs-false",
        body(top_logprobs=5, logprobs=False),
        InvalidValue,
        "top_logprobs",
    ),
    ("logprobs-string", body(logprobs="yes"), InvalidType, "logprobs"),
    ("max-tokens-zero", body(max_tokens=0), InvalidValue, "max_tokens"),
    (
        "max-completion-tokens-zero",
        body(max_completion_tokens=0),
        InvalidValue,
        "max_completion_tokens",
    ),
    (
        "max-completion-tokens-float",
        body(max_completion_tokens=1.5),
        InvalidType,
        "max_completion_tokens",
    ),
    ("seed-float", body(seed=1.5), InvalidType, "seed"),
    ("seed-above-int64", body(seed=2**63), InvalidValue, "seed"),
    ("seed-string", body(seed="1"), InvalidType, "seed"),
    # stop
    ("stop-five", body(stop=["a", "b", "c", "d", "e"]), InvalidValue, "stop"),
    ("stop-empty-list", body(stop=[]), InvalidValue, "stop"),
    ("stop-integer", body(stop=5), InvalidType, "stop"),
    ("stop-item-integer", body(stop=["a", 1]), InvalidType, "stop.[1]"),
    # logit_bias
    ("logit-bias-above", body(logit_bias={"50256": 101}), InvalidValue, "logit_bias"),
    ("logit-bias-below", body(logit_bias={"50256": -101}), InvalidValue, "logit_bias"),
    ("logit-bias-float", body(logit_bias={"50256": 1.5}), InvalidType, "logit_bias"),
    ("logit-bias-key", body(logit_bias={"hello": 1}), InvalidValue, "logit_bias"),
    ("logit-bias-array", body(logit_bias=[1]), InvalidType, "logit_bias"),
    # metadata and strings
    ("metadata-value-integer", body(metadata={"k": 1}), InvalidType, "metadata"),
    (
        "metadata-too-many",
        body(metadata={str(i): "v" for i in range(17)}),
        InvalidValue,
        "metadata",
    ),
    ("metadata-long-value", body(metadata={"k": "v" * 513}), InvalidValue, "metadata"),
    ("metadata-long-key", body(metadata={"k" * 65: "v"}), InvalidValue, "metadata"),
    ("user-integer", body(user=123), InvalidType, "user"),
    ("user-null", body(user=None), InvalidType, "user"),
    ("safety-identifier-long", body(safety_identifier="s" * 65), InvalidValue, "safety_identifier"),
    ("prompt-cache-key-integer", body(prompt_cache_key=1), InvalidType, "prompt_cache_key"),
    # enums
    ("service-tier", body(service_tier="turbo"), InvalidValue, "service_tier"),
    ("verbosity", body(verbosity="loud"), InvalidValue, "verbosity"),
    ("reasoning-effort", body(reasoning_effort="extreme"), InvalidValue, "reasoning_effort"),
    (
        "prompt-cache-retention",
        body(prompt_cache_retention="1h"),
        InvalidValue,
        "prompt_cache_retention",
    ),
    (
        "prompt-cache-ttl",
        body(prompt_cache_options={"ttl": "1h"}),
        InvalidValue,
        "prompt_cache_options.ttl",
    ),
    (
        "prompt-cache-mode",
        body(prompt_cache_options={"mode": "always"}),
        InvalidValue,
        "prompt_cache_options.mode",
    ),
    (
        "prompt-cache-options-null",
        body(prompt_cache_options=None),
        InvalidType,
        "prompt_cache_options",
    ),
    ("modalities-item", body(modalities=["video"]), InvalidValue, "modalities.[0]"),
    ("modalities-string", body(modalities="text"), InvalidType, "modalities"),
    ("tool-choice-string", body(tool_choice="sometimes"), InvalidValue, "tool_choice"),
    ("function-call-string", body(function_call="required"), InvalidValue, "function_call"),
    ("audio-format", body(audio={"voice": "alloy", "format": "ogg"}), InvalidValue, "audio.format"),
    (
        "search-context-size",
        body(web_search_options={"search_context_size": "huge"}),
        InvalidValue,
        "web_search_options.search_context_size",
    ),
    (
        "moderation-mode",
        body(moderation={"model": "m", "policy": {"input": {"mode": "x"}}}),
        InvalidValue,
        "moderation.policy.input.mode",
    ),
    # stream
    ("stream-string", body(stream="yes"), InvalidType, "stream"),
    (
        "stream-options-without-stream",
        body(stream_options={"include_usage": True}),
        InvalidValue,
        "stream_options",
    ),
    (
        "stream-options-stream-false",
        body(stream=False, stream_options={}),
        InvalidValue,
        "stream_options",
    ),
    (
        "stream-options-include-usage-string",
        body(stream=True, stream_options={"include_usage": "yes"}),
        InvalidType,
        "stream_options.include_usage",
    ),
    (
        "stream-options-unknown",
        body(stream=True, stream_options={"foo": True}),
        UnknownParameter,
        "stream_options.foo",
    ),
    # booleans
    ("store-string", body(store="yes"), InvalidType, "store"),
    (
        "parallel-tool-calls-null",
        body(parallel_tool_calls=None),
        InvalidType,
        "parallel_tool_calls",
    ),
    # response_format
    (
        "json-schema-missing-name",
        body(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
        MissingParameter,
        "response_format.json_schema.name",
    ),
    (
        "json-schema-missing",
        body(response_format={"type": "json_schema"}),
        MissingParameter,
        "response_format.json_schema",
    ),
    (
        "response-format-type",
        body(response_format={"type": "yaml"}),
        InvalidValue,
        "response_format.type",
    ),
    ("response-format-no-type", body(response_format={}), MissingParameter, "response_format.type"),
    ("response-format-string", body(response_format="json"), InvalidType, "response_format"),
    (
        "json-schema-strict-string",
        body(
            response_format={"type": "json_schema", "json_schema": {"name": "n", "strict": "yes"}}
        ),
        InvalidType,
        "response_format.json_schema.strict",
    ),
    # tools
    ("tools-object", body(tools=tool()), InvalidType, "tools"),
    ("tool-type", body(tools=[{"type": "retrieval"}]), InvalidValue, "tools.[0].type"),
    (
        "tool-missing-name",
        body(tools=[{"type": "function", "function": {}}]),
        MissingParameter,
        "tools.[0].function.name",
    ),
    (
        "tool-parameters-string",
        body(tools=[tool(parameters="x")]),
        InvalidType,
        "tools.[0].function.parameters",
    ),
    (
        "tool-unknown-field",
        body(tools=[tool(bogus=1)]),
        UnknownParameter,
        "tools.[0].function.bogus",
    ),
    (
        "custom-tool-grammar-syntax",
        body(
            tools=[
                {
                    "type": "custom",
                    "custom": {
                        "name": "c",
                        "format": {
                            "type": "grammar",
                            "grammar": {"definition": "x", "syntax": "peg"},
                        },
                    },
                }
            ]
        ),
        InvalidValue,
        "tools.[0].custom.format.grammar.syntax",
    ),
    (
        "tool-choice-missing-function",
        body(tool_choice={"type": "function"}),
        MissingParameter,
        "tool_choice.function",
    ),
    (
        "tool-choice-missing-name",
        body(tool_choice={"type": "function", "function": {}}),
        MissingParameter,
        "tool_choice.function.name",
    ),
    ("tool-choice-type", body(tool_choice={"type": "tool"}), InvalidValue, "tool_choice.type"),
    (
        "allowed-tools-mode",
        body(tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "none", "tools": []}}),
        InvalidValue,
        "tool_choice.allowed_tools.mode",
    ),
    ("functions-empty", body(functions=[]), InvalidValue, "functions"),
    (
        "functions-too-many",
        body(functions=[{"name": f"f{i}"} for i in range(129)]),
        InvalidValue,
        "functions",
    ),
    (
        "function-call-object-missing-name",
        body(function_call={}),
        MissingParameter,
        "function_call.name",
    ),
    # audio, prediction, web search, moderation
    ("audio-modality-without-audio", body(modalities=["text", "audio"]), MissingParameter, "audio"),
    ("audio-missing-voice", body(audio={"format": "wav"}), MissingParameter, "audio.voice"),
    (
        "prediction-empty-parts",
        body(prediction={"type": "content", "content": []}),
        InvalidValue,
        "prediction.content",
    ),
    (
        "prediction-type",
        body(prediction={"type": "diff", "content": "x"}),
        InvalidValue,
        "prediction.type",
    ),
    (
        "web-search-location-missing-approximate",
        body(web_search_options={"user_location": {"type": "approximate"}}),
        MissingParameter,
        "web_search_options.user_location.approximate",
    ),
    ("web-search-options-null", body(web_search_options=None), InvalidType, "web_search_options"),
    ("moderation-missing-model", body(moderation={}), MissingParameter, "moderation.model"),
]


def _expect(exc: InvalidRequest, cls: type[InvalidRequest], param: str | None) -> None:
    assert type(exc) is cls, f"{type(exc).__name__}: {exc.message}"
    assert exc.status == 400
    assert exc.code == CODES[cls]
    assert exc.param == param, exc.message
    envelope = exc.envelope()["error"]
    assert envelope["type"] == "invalid_request_error"
    assert envelope["param"] == param
    assert isinstance(envelope["message"], str) and envelope["message"]


@pytest.mark.parametrize(("case", "value", "cls", "param"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_body_is_rejected(
    case: str,
    value: dict[str, Any] | bytes,
    cls: type[InvalidRequest],
    param: str | None,
) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(raw(value), extra_fields=allow_top_k)
    _expect(info.value, cls, param)


def test_invalid_table_is_large_unique_and_covers_every_field() -> None:
    assert len(INVALID) >= 60
    assert len({case[0] for case in INVALID}) == len(INVALID)
    roots = {param.split(".")[0] for *_, param in INVALID if param}
    assert roots >= CHAT_FIELDS, CHAT_FIELDS - roots


@pytest.mark.parametrize(("case", "value"), VALID_BODIES, ids=[c[0] for c in VALID_BODIES])
def test_valid_body_parses_and_round_trips(case: str, value: dict[str, Any]) -> None:
    decoded, request = parse_chat_request(raw(value))
    assert decoded == value
    assert msgspec.json.decode(msgspec.json.encode(decoded)) == value
    assert isinstance(request, ChatCompletionRequest)
    assert request.model == value["model"]
    assert len(request.messages) == len(value["messages"])


def test_valid_table_covers_every_role_and_many_fields() -> None:
    roles = {m["role"] for _, v in VALID_BODIES for m in v["messages"]}
    assert roles == {"developer", "system", "user", "assistant", "tool", "function"}
    used = {key for _, v in VALID_BODIES for key in v}
    assert used == CHAT_FIELDS, CHAT_FIELDS - used


# --- the field list, the allow-list, messages ---

SPEC_FIELDS = [
    "metadata",
    "top_logprobs",
    "temperature",
    "top_p",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "messages",
    "model",
    "service_tier",
    "modalities",
    "verbosity",
    "reasoning_effort",
    "max_completion_tokens",
    "frequency_penalty",
    "presence_penalty",
    "web_search_options",
    "response_format",
    "audio",
    "store",
    "moderation",
    "stream",
    "stop",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "prediction",
    "seed",
    "stream_options",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "function_call",
    "functions",
]


def test_the_37_fields_in_reference_order() -> None:
    assert ChatCompletionRequest.__struct_fields__ == tuple(SPEC_FIELDS)
    assert len(CHAT_FIELDS) == 37
    assert not {"best_of", "candidate_count", "num_return_sequences"} & CHAT_FIELDS


def test_allow_listed_extra_is_kept_in_the_body_only() -> None:
    value = body(**EXTRA)
    decoded, request = parse_chat_request(raw(value), extra_fields=allow_top_k)
    assert decoded == value
    assert "top_k" not in request.__struct_fields__


def test_allow_list_depends_on_the_model() -> None:
    with pytest.raises(UnknownParameter) as info:
        parse_chat_request(raw(body(model="other", **EXTRA)), extra_fields=allow_top_k)
    assert info.value.param == "top_k"


def test_allow_list_never_lets_other_candidate_fields_through() -> None:
    with pytest.raises(UnknownParameter) as info:
        parse_chat_request(raw(body(top_k=1, best_of=2)), extra_fields=allow_top_k)
    assert info.value.param == "best_of"


def test_allow_listed_candidate_field_is_accepted() -> None:
    value = body(candidate_count=2)
    decoded, _ = parse_chat_request(raw(value), extra_fields=lambda model: {"candidate_count"})
    assert decoded["candidate_count"] == 2


@pytest.mark.parametrize(("depth", "ok"), [(MAX_DEPTH, True), (MAX_DEPTH + 1, False)])
def test_nesting_limit_in_free_form_json(depth: int, ok: bool) -> None:
    value = raw(body(tools=[tool(parameters=nested(depth))]))
    if ok:
        parse_chat_request(value)
    else:
        with pytest.raises(InvalidJSON):
            parse_chat_request(value)


def test_extra_fields_is_not_called_for_known_fields() -> None:
    def fail(model: object) -> tuple[str, ...]:
        raise AssertionError("called")

    parse_chat_request(raw(body(n=2)), extra_fields=fail)


@pytest.mark.parametrize(
    ("value", "fragments"),
    [
        (body(temperature=3), ["temperature", "between 0 and 2", "3"]),
        (body(n=0), ["'n'", "between 1 and 128", "0"]),
        (body(top_p=2), ["between 0 and 1"]),
        (body(presence_penalty=9), ["between -2 and 2"]),
        (body(logprobs=True, top_logprobs=50), ["between 0 and 20"]),
        (body(logit_bias={"1": 500}), ["between -100 and 100"]),
        (body(stop=list("abcde")), ["1 to 4 items", "5 items"]),
        (body(service_tier="x"), ["'auto'", "'flex'", "'priority'"]),
        (body({"role": "robot", "content": "x"}), ["'developer'", "'tool'", "'function'"]),
        (body(n="2"), ["expected an integer or null", "got a string"]),
        (body(messages=[]), ["at least 1 item"]),
        (body(top_logprobs=2), ["logprobs"]),
    ],
)
def test_messages_say_what_is_allowed(value: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(raw(value))
    for fragment in fragments:
        assert fragment in info.value.message


# --- legacy /v1/completions ---

PROMPT = {"model": "gpt-3.5-turbo-instruct", "prompt": "Say hi"}

VALID_COMPLETIONS: list[dict[str, Any]] = [
    PROMPT,
    {**PROMPT, "prompt": ["a", "b"]},
    {**PROMPT, "prompt": []},
    {**PROMPT, "prompt": [1212, 318]},
    {**PROMPT, "prompt": [[1212], [318, 257]]},
    {**PROMPT, "prompt": None},
    {**PROMPT, "best_of": 4, "n": 2, "echo": True, "logprobs": 5, "suffix": "!", "seed": 1},
    {**PROMPT, "stream": True, "stream_options": {"include_usage": True}, "stop": ["x"]},
    {**PROMPT, "max_tokens": 0, "temperature": 0, "top_p": 1, "user": "u", "logit_bias": {"1": 1}},
    {**PROMPT, "frequency_penalty": 1, "presence_penalty": -1, "best_of": 1, "stream": True},
    {**PROMPT, "best_of": 3, "n": 3, "stream": True},  # best_of == n: nothing to choose
]


@pytest.mark.parametrize("value", VALID_COMPLETIONS)
def test_valid_completion_body(value: dict[str, Any]) -> None:
    decoded, request = parse_completion_request(raw(value))
    assert decoded == value
    assert isinstance(request, CompletionRequest)


INVALID_COMPLETIONS: list[tuple[dict[str, Any] | bytes, type[InvalidRequest], str | None]] = [
    (b"[]", InvalidJSON, None),
    ({"model": "m"}, MissingParameter, "prompt"),
    ({"prompt": "x"}, MissingParameter, "model"),
    ({**PROMPT, "prompt": ["a", 1]}, InvalidValue, "prompt"),
    ({**PROMPT, "prompt": [[1], 2]}, InvalidValue, "prompt"),
    ({**PROMPT, "prompt": [[]]}, InvalidValue, "prompt.[0]"),
    ({**PROMPT, "prompt": [1.5]}, InvalidType, "prompt.[0]"),
    ({**PROMPT, "prompt": 3}, InvalidType, "prompt"),
    ({**PROMPT, "logprobs": 6}, InvalidValue, "logprobs"),
    ({**PROMPT, "logprobs": True}, InvalidType, "logprobs"),
    ({**PROMPT, "best_of": 21}, InvalidValue, "best_of"),
    ({**PROMPT, "best_of": 2, "n": 3}, InvalidValue, "best_of"),
    ({**PROMPT, "best_of": 2, "stream": True}, InvalidValue, "best_of"),
    ({**PROMPT, "best_of": 3, "n": 2, "stream": True}, InvalidValue, "best_of"),
    ({**PROMPT, "max_tokens": -1}, InvalidValue, "max_tokens"),
    ({**PROMPT, "n": 0}, InvalidValue, "n"),
    ({**PROMPT, "stream_options": {"include_usage": True}}, InvalidValue, "stream_options"),
    ({**PROMPT, "candidate_count": 2}, UnknownParameter, "candidate_count"),
    ({**PROMPT, "messages": []}, UnknownParameter, "messages"),
    ({**PROMPT, "stop": ["a"] * 5}, InvalidValue, "stop"),
    ({**PROMPT, "logit_bias": {"1": 200}}, InvalidValue, "logit_bias"),
]


@pytest.mark.parametrize(("value", "cls", "param"), INVALID_COMPLETIONS)
def test_invalid_completion_body(
    value: dict[str, Any] | bytes, cls: type[InvalidRequest], param: str | None
) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion_request(raw(value))
    _expect(info.value, cls, param)
