"""The OpenAI ↔ Gemini translator, table-driven: requests, responses, stream chunks,
errors. Inputs are inline JSON and SSE text as the wire carries them; outputs are
compared whole, so a field that moves or disappears fails a case."""

# Inline wire JSON keeps one Gemini object per line, which is clearer than wrapping it.
# ruff: noqa: E501

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from ncap.errors import (
    InvalidValue,
    Overloaded,
    RateLimitExceeded,
    RouteDoesNotSupportCandidates,
    UpstreamError,
    UpstreamTimeout,
)
from ncap.protocol.validate import parse_chat_request
from ncap.providers.gemini_errors import GeminiError, translate_error
from ncap.providers.gemini_request import to_gemini_request
from ncap.providers.gemini_response import decode_response, to_chat_completion
from ncap.providers.gemini_stream import GeminiStream, decode_stream_event
from ncap.providers.openai_side import summarize
from ncap.streaming.sse import StreamPiece, iter_pieces
from ncap.streaming.sse_data import iter_data

USER = {"role": "user", "content": "Hi"}
GEMINI_USER = {"role": "user", "parts": [{"text": "Hi"}]}


def _gemini_body(openai: dict[str, Any]) -> dict[str, Any]:
    _, req = parse_chat_request(json.dumps({"model": "gemini-x", **openai}).encode())
    out: dict[str, Any] = msgspec.to_builtins(to_gemini_request(req))
    return out


# --- requests ---

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
WEATHER_DECL = {
    "name": "weather",
    "description": "Weather for a city",
    "parametersJsonSchema": WEATHER["function"]["parameters"],  # type: ignore[index]
}
TIME = {"type": "function", "function": {"name": "time"}}

REQUESTS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "minimal: no generationConfig fields set",
        {"messages": [USER]},
        {"contents": [GEMINI_USER], "generationConfig": {}},
    ),
    (
        "n, ceiling, sampling, stop, seed, penalties",
        {
            "messages": [USER],
            "n": 3,
            "max_completion_tokens": 64,
            "temperature": 0.7,
            "top_p": 0.9,
            "stop": "END",
            "seed": 42,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
        },
        {
            "contents": [GEMINI_USER],
            "generationConfig": {
                "stopSequences": ["END"],
                "candidateCount": 3,
                "maxOutputTokens": 64,
                "temperature": 0.7,
                "topP": 0.9,
                "seed": 42,
                "presencePenalty": 0.5,
                "frequencyPenalty": -0.5,
            },
        },
    ),
    (
        "max_tokens (legacy name) is the ceiling too; stop list kept",
        {"messages": [USER], "max_tokens": 10, "stop": ["a", "b"], "n": 1},
        {
            "contents": [GEMINI_USER],
            "generationConfig": {
                "stopSequences": ["a", "b"],
                "candidateCount": 1,
                "maxOutputTokens": 10,
            },
        },
    ),
    (
        "nulls mean unset",
        {"messages": [USER], "n": None, "temperature": None, "stop": None},
        {"contents": [GEMINI_USER], "generationConfig": {}},
    ),
    (
        "json_schema → responseMimeType + responseJsonSchema",
        {
            "messages": [USER],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
            },
        },
        {
            "contents": [GEMINI_USER],
            "generationConfig": {
                "responseMimeType": "application/json",
                "responseJsonSchema": {"type": "object"},
            },
        },
    ),
    (
        "json_object → responseMimeType only",
        {"messages": [USER], "response_format": {"type": "json_object"}},
        {"contents": [GEMINI_USER], "generationConfig": {"responseMimeType": "application/json"}},
    ),
    (
        "system and developer → systemInstruction, in order; user turns merged",
        {
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "developer", "content": [{"type": "text", "text": "No emoji."}]},
                {"role": "user", "content": "Hi"},
                {"role": "user", "content": [{"type": "text", "text": "there"}]},
                {"role": "assistant", "content": "Hello."},
            ]
        },
        {
            "contents": [
                {"role": "user", "parts": [{"text": "Hi"}, {"text": "there"}]},
                {"role": "model", "parts": [{"text": "Hello."}]},
            ],
            "systemInstruction": {"parts": [{"text": "Be terse."}, {"text": "No emoji."}]},
            "generationConfig": {},
        },
    ),
    (
        "image data URL → inlineData, remote URL → fileData, audio → inlineData",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                        {"type": "image_url", "image_url": {"url": "gs://b/cat.jpg"}},
                        {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}},
                    ],
                }
            ]
        },
        {
            "contents": [
                {
                    "role": "user",
                    "parts": [
                        {"inlineData": {"mimeType": "image/png", "data": "iVBO"}},
                        {"fileData": {"fileUri": "gs://b/cat.jpg"}},
                        {"inlineData": {"mimeType": "audio/wav", "data": "UklG"}},
                    ],
                }
            ],
            "generationConfig": {},
        },
    ),
    (
        "tools, tool_choice auto; assistant tool_calls → functionCall; tool results → "
        "functionResponse parts in one user turn",
        {
            "messages": [
                {"role": "user", "content": "Weather and time in Oslo?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                        },
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "time", "arguments": ""},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 3}'},
                {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
            ],
            "tools": [WEATHER, TIME],
            "tool_choice": "auto",
        },
        {
            "contents": [
                {"role": "user", "parts": [{"text": "Weather and time in Oslo?"}]},
                {
                    "role": "model",
                    "parts": [
                        {
                            "functionCall": {
                                "id": "call_1",
                                "name": "weather",
                                "args": {"city": "Oslo"},
                            }
                        },
                        {"functionCall": {"id": "call_2", "name": "time", "args": {}}},
                    ],
                },
                {
                    "role": "user",
                    "parts": [
                        {
                            "functionResponse": {
                                "id": "call_1",
                                "name": "weather",
                                "response": {"temp_c": 3},
                            }
                        },
                        {
                            "functionResponse": {
                                "id": "call_2",
                                "name": "time",
                                "response": {"result": "14:05"},
                            }
                        },
                    ],
                },
            ],
            "tools": [{"functionDeclarations": [WEATHER_DECL, {"name": "time"}]}],
            "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
            "generationConfig": {},
        },
    ),
    (
        "tool_choice required → ANY",
        {"messages": [USER], "tools": [TIME], "tool_choice": "required"},
        {
            "contents": [GEMINI_USER],
            "tools": [{"functionDeclarations": [{"name": "time"}]}],
            "toolConfig": {"functionCallingConfig": {"mode": "ANY"}},
            "generationConfig": {},
        },
    ),
    (
        "tool_choice none → NONE",
        {"messages": [USER], "tools": [TIME], "tool_choice": "none"},
        {
            "contents": [GEMINI_USER],
            "tools": [{"functionDeclarations": [{"name": "time"}]}],
            "toolConfig": {"functionCallingConfig": {"mode": "NONE"}},
            "generationConfig": {},
        },
    ),
    (
        "named tool_choice → ANY restricted to that function",
        {
            "messages": [USER],
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "time"}},
        },
        {
            "contents": [GEMINI_USER],
            "tools": [{"functionDeclarations": [WEATHER_DECL, {"name": "time"}]}],
            "toolConfig": {
                "functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["time"]}
            },
            "generationConfig": {},
        },
    ),
    (
        "allowed_tools auto → only those declared, AUTO",
        {
            "messages": [USER],
            "tools": [WEATHER, TIME],
            "tool_choice": {
                "type": "allowed_tools",
                "allowed_tools": {
                    "mode": "auto",
                    "tools": [{"type": "function", "function": {"name": "weather"}}],
                },
            },
        },
        {
            "contents": [GEMINI_USER],
            "tools": [{"functionDeclarations": [WEATHER_DECL]}],
            "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
            "generationConfig": {},
        },
    ),
    (
        "no tool_choice: no toolConfig (Gemini's default is AUTO)",
        {"messages": [USER], "tools": [TIME]},
        {
            "contents": [GEMINI_USER],
            "tools": [{"functionDeclarations": [{"name": "time"}]}],
            "generationConfig": {},
        },
    ),
]


@pytest.mark.parametrize(
    ("openai", "gemini"), [c[1:] for c in REQUESTS], ids=[c[0] for c in REQUESTS]
)
def test_request_translation(openai: dict[str, Any], gemini: dict[str, Any]) -> None:
    assert _gemini_body(openai) == gemini


def test_request_keys_are_camel_case_in_reference_order() -> None:
    encoded = msgspec.json.encode(
        to_gemini_request(
            parse_chat_request(
                json.dumps(
                    {
                        "model": "m",
                        "messages": [{"role": "system", "content": "s"}, USER],
                        "tools": [TIME],
                        "tool_choice": "auto",
                        "n": 2,
                    }
                ).encode()
            )[1]
        )
    )
    assert list(json.loads(encoded)) == [
        "contents",
        "tools",
        "toolConfig",
        "systemInstruction",
        "generationConfig",
    ]


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("logit_bias", {"logit_bias": {"42": 5}}, "logit_bias"),
    ("logprobs", {"logprobs": True}, "logprobs"),
    (
        "audio output",
        {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
        "audio",
    ),
    ("reasoning_effort", {"reasoning_effort": "low"}, "reasoning_effort"),
    (
        "parallel_tool_calls false",
        {"tools": [TIME], "parallel_tool_calls": False},
        "parallel_tool_calls",
    ),
    ("legacy functions", {"functions": [{"name": "f"}]}, "functions"),
    (
        "custom tool",
        {"tools": [{"type": "custom", "custom": {"name": "c"}}]},
        "tools.[0]",
    ),
    (
        "named choice of an undeclared tool",
        {"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
    ),
    (
        "tool result without its call",
        {"messages": [USER, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
        "messages.[1].tool_call_id",
    ),
    (
        "tool call arguments not a JSON object",
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "[1]"},
                        }
                    ],
                },
            ]
        },
        "messages.[1].tool_calls.[0].function.arguments",
    ),
    (
        "image URL that is a malformed data URL",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:nope"}}],
                }
            ]
        },
        "messages.[0].content.[0].image_url.url",
    ),
    ("only a system message", {"messages": [{"role": "system", "content": "s"}]}, "messages"),
    ("a seed beyond 32 bits", {"seed": 2**31}, "seed"),
]


@pytest.mark.parametrize(("fields", "param"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_request_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidValue) as caught:
        _gemini_body({"messages": [USER], **fields})
    assert caught.value.param == param
    assert caught.value.status == 400


# --- responses ---


def _completion(gemini: str) -> dict[str, Any]:
    completion = to_chat_completion(
        decode_response(gemini.encode()), completion_id="chatcmpl-x", created=7, model="alias"
    )
    out: dict[str, Any] = msgspec.to_builtins(completion)
    return out


def _message(content: str | None, **extra: Any) -> dict[str, Any]:
    return {"content": content, "refusal": None, "role": "assistant", **extra}


def _usage(prompt: int, completion: int, cached: int = 0, reasoning: int = 0) -> dict[str, Any]:
    return {
        "completion_tokens": completion,
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens_details": {"reasoning_tokens": reasoning},
        "prompt_tokens_details": {"cached_tokens": cached},
    }


RESPONSES: list[tuple[str, str, list[dict[str, Any]], dict[str, Any] | None]] = [
    (
        "one candidate, index absent (proto3 zero), STOP",
        """{"candidates": [{"content": {"parts": [{"text": "Hello"}], "role": "model"},
            "finishReason": "STOP"}],
           "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 1,
            "totalTokenCount": 6}, "modelVersion": "gemini-2.5-flash", "responseId": "r1"}""",
        [{"finish_reason": "stop", "index": 0, "message": _message("Hello"), "logprobs": None}],
        _usage(5, 1),
    ),
    (
        "out-of-order candidate indices are keyed by index, not position",
        """{"candidates": [
            {"content": {"parts": [{"text": "two"}], "role": "model"}, "finishReason": "MAX_TOKENS", "index": 2},
            {"content": {"parts": [{"text": "zero"}], "role": "model"}, "finishReason": "STOP"},
            {"content": {"parts": [{"text": "one"}], "role": "model"}, "finishReason": "STOP", "index": 1}],
           "usageMetadata": {"promptTokenCount": 9, "candidatesTokenCount": 12}}""",
        [
            {"finish_reason": "stop", "index": 0, "message": _message("zero"), "logprobs": None},
            {"finish_reason": "stop", "index": 1, "message": _message("one"), "logprobs": None},
            {"finish_reason": "length", "index": 2, "message": _message("two"), "logprobs": None},
        ],
        _usage(9, 12),
    ),
    (
        "a candidate with no content (SAFETY) is content_filter with null content",
        """{"candidates": [
            {"content": {"parts": [{"text": "fine"}], "role": "model"}, "finishReason": "STOP", "index": 0},
            {"finishReason": "SAFETY", "index": 1, "safetyRatings": [
              {"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "probability": "HIGH", "blocked": true}]}],
           "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 1}}""",
        [
            {"finish_reason": "stop", "index": 0, "message": _message("fine"), "logprobs": None},
            {
                "finish_reason": "content_filter",
                "index": 1,
                "message": _message(None),
                "logprobs": None,
            },
        ],
        _usage(4, 1),
    ),
    (
        "the safety family maps to content_filter; OTHER to stop",
        """{"candidates": [
            {"finishReason": "RECITATION", "index": 0}, {"finishReason": "BLOCKLIST", "index": 1},
            {"finishReason": "PROHIBITED_CONTENT", "index": 2}, {"finishReason": "SPII", "index": 3},
            {"finishReason": "OTHER", "index": 4}],
           "usageMetadata": {"promptTokenCount": 4}}""",
        [
            {"finish_reason": r, "index": i, "message": _message(None), "logprobs": None}
            for i, r in enumerate(["content_filter"] * 4 + ["stop"])
        ],
        _usage(4, 0),
    ),
    (
        "usage with thoughts and cached tokens: thoughts are reasoning and output",
        """{"candidates": [{"content": {"parts": [
              {"text": "planning…", "thought": true}, {"text": "42"}], "role": "model"},
            "finishReason": "STOP", "index": 0}],
           "usageMetadata": {"promptTokenCount": 1000, "cachedContentTokenCount": 800,
            "candidatesTokenCount": 3, "thoughtsTokenCount": 120, "totalTokenCount": 1123}}""",
        [{"finish_reason": "stop", "index": 0, "message": _message("42"), "logprobs": None}],
        _usage(1000, 123, cached=800, reasoning=120),
    ),
    (
        "function calls → tool_calls (Gemini's id kept, else a stable one), finish tool_calls",
        """{"candidates": [{"content": {"parts": [
              {"text": "Checking."},
              {"functionCall": {"name": "weather", "args": {"city": "Oslo"}}},
              {"functionCall": {"id": "g-7", "name": "time", "args": {}}}], "role": "model"},
            "finishReason": "STOP", "index": 0}],
           "usageMetadata": {"promptTokenCount": 20, "candidatesTokenCount": 8}}""",
        [
            {
                "finish_reason": "tool_calls",
                "index": 0,
                "message": _message(
                    "Checking.",
                    tool_calls=[
                        {
                            "id": "call_chatcmpl-x_0_0",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                        },
                        {
                            "id": "g-7",
                            "type": "function",
                            "function": {"name": "time", "arguments": "{}"},
                        },
                    ],
                ),
                "logprobs": None,
            }
        ],
        _usage(20, 8),
    ),
    (
        "no usageMetadata: usage absent (unknown, not zero)",
        """{"candidates": [{"content": {"parts": [{"text": "x"}]}, "finishReason": "STOP"}]}""",
        [{"finish_reason": "stop", "index": 0, "message": _message("x"), "logprobs": None}],
        None,
    ),
    (
        "tool-use prompt tokens count as input",
        """{"candidates": [{"content": {"parts": [{"text": "x"}]}, "finishReason": "STOP"}],
           "usageMetadata": {"promptTokenCount": 10, "toolUsePromptTokenCount": 5, "candidatesTokenCount": 1}}""",
        [{"finish_reason": "stop", "index": 0, "message": _message("x"), "logprobs": None}],
        _usage(15, 1),
    ),
]


@pytest.mark.parametrize(
    ("gemini", "choices", "usage"), [c[1:] for c in RESPONSES], ids=[c[0] for c in RESPONSES]
)
def test_response_translation(
    gemini: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
) -> None:
    out = _completion(gemini)
    assert out["choices"] == choices
    assert out.get("usage") == usage
    assert (out["id"], out["object"], out["created"], out["model"]) == (
        "chatcmpl-x",
        "chat.completion",
        7,
        "alias",
    )


def test_summary_has_indexes_finish_reasons_and_usage() -> None:
    completion = to_chat_completion(
        decode_response(RESPONSES[4][1].encode()), completion_id="c", created=0, model="m"
    )
    summary = summarize(completion)
    assert [(c.index, c.finish_reason) for c in summary.choices] == [(0, "stop")]
    assert summary.usage is not None
    assert summary.usage.prompt_tokens_details is not None
    assert summary.usage.completion_tokens_details is not None
    assert (summary.usage.completion_tokens, summary.usage.prompt_tokens_details.cached_tokens) == (
        123,
        800,
    )
    assert summary.usage.completion_tokens_details.reasoning_tokens == 120


PROTOCOL_ERRORS = [
    (
        "two candidates without an index are ambiguous",
        """{"candidates": [{"content": {"parts": [{"text": "a"}]}}, {"content": {"parts": [{"text": "b"}]}}]}""",
    ),
    ("a repeated index", """{"candidates": [{"index": 1}, {"index": 1}]}"""),
    ("not JSON", """{"candidates": [{"index": 1"""),
]


@pytest.mark.parametrize(
    "gemini", [c[1] for c in PROTOCOL_ERRORS], ids=[c[0] for c in PROTOCOL_ERRORS]
)
def test_malformed_responses_are_protocol_failures(gemini: str) -> None:
    with pytest.raises(GeminiError) as caught:
        _completion(gemini)
    assert (caught.value.kind, caught.value.status, caught.value.retryable) == (
        "protocol",
        502,
        False,
    )


def test_blocked_prompt_is_a_content_filter_400_with_its_usage() -> None:
    body = b"""{"promptFeedback": {"blockReason": "SAFETY"},
                "usageMetadata": {"promptTokenCount": 7, "totalTokenCount": 7}}"""
    with pytest.raises(GeminiError) as caught:
        _completion(body.decode())
    error = caught.value
    assert (error.kind, error.status, error.code, error.param) == (
        "blocked",
        400,
        "content_filter",
        "messages",
    )
    assert error.usage is not None and error.usage.prompt_tokens == 7
    assert error.as_ncap_error().envelope()["error"]["code"] == "content_filter"


# --- stream chunks ---


def _sse_payloads(text: str) -> list[bytes]:
    """The ``data:`` payloads of an SSE text (events separated by a blank line)."""
    events = text.replace("\r\n", "\n").strip().split("\n\n")
    return [
        "\n".join(line[5:].lstrip() for line in e.splitlines() if line.startswith("data:")).encode()
        for e in events
        if e.strip()
    ]


def _chunks(sse: str) -> list[dict[str, Any]]:
    stream = GeminiStream(completion_id="chatcmpl-s", created=9, model="alias")
    out = []
    for payload in _sse_payloads(sse):
        out += stream.feed(decode_stream_event(payload))
    out += stream.close()
    return [msgspec.to_builtins(chunk) for chunk in out]


def _choice_of(chunk: dict[str, Any]) -> tuple[int, dict[str, Any], str | None]:
    (choice,) = chunk["choices"]
    return choice["index"], choice["delta"], choice["finish_reason"]


# n=2, interleaved, candidate 1 first, index 0 omitted (proto3), CRLF framing as
# Gemini sends it, usage growing on each event (the last wins)
STREAM_N2 = (
    'data: {"candidates": [{"content": {"parts": [{"text": "B1"}], "role": "model"}, "index": 1}],'
    ' "usageMetadata": {"promptTokenCount": 6, "totalTokenCount": 6}}\r\n\r\n'
    'data: {"candidates": [{"content": {"parts": [{"text": "A1"}], "role": "model"}}],'
    ' "usageMetadata": {"promptTokenCount": 6, "candidatesTokenCount": 2}}\r\n\r\n'
    'data: {"candidates": [{"content": {"parts": [{"text": " A2"}], "role": "model"},'
    ' "finishReason": "STOP"},'
    ' {"content": {"parts": [{"text": " B2"}], "role": "model"}, "finishReason": "MAX_TOKENS",'
    ' "index": 1}],'
    ' "usageMetadata": {"promptTokenCount": 6, "cachedContentTokenCount": 2,'
    ' "candidatesTokenCount": 4, "thoughtsTokenCount": 10, "totalTokenCount": 20},'
    ' "modelVersion": "gemini-2.5-flash"}\r\n\r\n'
)


def test_stream_chunks_per_candidate_index_then_one_usage_chunk() -> None:
    chunks = _chunks(STREAM_N2)
    *body, last = chunks
    assert [_choice_of(c) for c in body] == [
        (1, {"content": "B1", "role": "assistant"}, None),
        (0, {"content": "A1", "role": "assistant"}, None),
        (0, {"content": " A2"}, None),
        (0, {}, "stop"),
        (1, {"content": " B2"}, None),
        (1, {}, "length"),
    ]
    assert last["choices"] == []
    assert last["usage"] == _usage(6, 14, cached=2, reasoning=10)
    assert {c["id"] for c in chunks} == {"chatcmpl-s"}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_stream_demultiplexes_into_the_non_stream_answer() -> None:
    """The same generation, streamed and whole, gives the same choices."""
    contents: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in _chunks(STREAM_N2):
        for choice in chunk["choices"]:
            i = choice["index"]
            contents[i] = contents.get(i, "") + (choice["delta"].get("content") or "")
            finishes[i] = choice["finish_reason"] or finishes.get(i, "")
    whole = _completion(
        """{"candidates": [
             {"content": {"parts": [{"text": "B1 B2"}]}, "finishReason": "MAX_TOKENS", "index": 1},
             {"content": {"parts": [{"text": "A1 A2"}]}, "finishReason": "STOP"}]}"""
    )
    assert {c["index"]: c["message"]["content"] for c in whole["choices"]} == contents
    assert {c["index"]: c["finish_reason"] for c in whole["choices"]} == finishes


STREAMS: list[tuple[str, str, list[tuple[int, dict[str, Any], str | None]], bool]] = [
    (
        "a candidate blocked mid-stream: role and content_filter, no content",
        'data: {"candidates": [{"finishReason": "SAFETY", "index": 0}],'
        ' "usageMetadata": {"promptTokenCount": 3}}\n\n',
        [(0, {"role": "assistant"}, "content_filter")],
        True,
    ),
    (
        "function call streamed whole, finish tool_calls; thought parts dropped",
        'data: {"candidates": [{"content": {"parts": [{"text": "hmm", "thought": true}]}}]}\n\n'
        'data: {"candidates": [{"content": {"parts": [{"functionCall": {"name": "time", "args": {}}}]},'
        ' "finishReason": "STOP"}], "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 2}}\n\n',
        [
            (
                0,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_chatcmpl-s_0_0",
                            "type": "function",
                            "function": {"name": "time", "arguments": "{}"},
                        }
                    ],
                },
                None,
            ),
            (0, {}, "tool_calls"),
        ],
        True,
    ),
    (
        "no usageMetadata anywhere: no usage chunk",
        'data: {"candidates": [{"content": {"parts": [{"text": "x"}]}, "finishReason": "STOP"}]}\n\n',
        [(0, {"content": "x", "role": "assistant"}, None), (0, {}, "stop")],
        False,
    ),
]


@pytest.mark.parametrize(
    ("sse", "expected", "usage"), [c[1:] for c in STREAMS], ids=[c[0] for c in STREAMS]
)
def test_stream_translation(
    sse: str, expected: list[tuple[int, dict[str, Any], str | None]], usage: bool
) -> None:
    chunks = _chunks(sse)
    if usage:
        assert chunks[-1]["choices"] == [] and "usage" in chunks[-1]
        chunks = chunks[:-1]
    else:
        assert all("usage" not in c for c in chunks)
    assert [_choice_of(c) for c in chunks] == expected


def test_stream_content_after_finish_is_a_protocol_failure() -> None:
    stream = GeminiStream(completion_id="c", created=0, model="m")
    stream.feed(decode_stream_event(b'{"candidates": [{"finishReason": "STOP", "index": 1}]}'))
    with pytest.raises(GeminiError) as caught:
        stream.feed(
            decode_stream_event(
                b'{"candidates": [{"content": {"parts": [{"text": "x"}]}, "index": 1}]}'
            )
        )
    assert caught.value.kind == "protocol"


def test_stream_malformed_event_is_a_protocol_failure() -> None:
    with pytest.raises(GeminiError) as caught:
        decode_stream_event(b'{"candidates": [')
    assert caught.value.kind == "protocol"


# --- errors ---

ERRORS: list[tuple[str, int, str, dict[str, Any]]] = [
    (
        "n > 1 refused (Gemini 3): route_does_not_support_candidates, max 1",
        400,
        '{"error": {"code": 400, "message": "Multiple candidates is not enabled for this model",'
        ' "status": "INVALID_ARGUMENT"}}',
        {
            "kind": "candidates",
            "status": 400,
            "code": "route_does_not_support_candidates",
            "param": "n",
            "retryable": False,
            "max_candidates": 1,
            "cls": RouteDoesNotSupportCandidates,
        },
    ),
    (
        "n above the supported range: the range's maximum",
        400,
        '{"error": {"code": 400, "message": "Unable to submit request because it has a candidateCount'
        " value of 12 but the supported range is from 1 (inclusive) to 9 (exclusive). Update the"
        ' value and try again.", "status": "INVALID_ARGUMENT"}}',
        {
            "kind": "candidates",
            "status": 400,
            "code": "route_does_not_support_candidates",
            "param": "n",
            "retryable": False,
            "max_candidates": 8,
            "cls": RouteDoesNotSupportCandidates,
        },
    ),
    (
        "candidateCount must be 1 (Vertex wording)",
        400,
        '{"error": {"code": 400, "message": "Unable to submit request because candidateCount must be 1'
        ' but the entered value was 3.", "status": "INVALID_ARGUMENT"}}',
        {
            "kind": "candidates",
            "status": 400,
            "max_candidates": 1,
            "param": "n",
            "retryable": False,
            "code": "route_does_not_support_candidates",
            "cls": RouteDoesNotSupportCandidates,
        },
    ),
    (
        "other 400 INVALID_ARGUMENT: relayed as invalid_value",
        400,
        '{"error": {"code": 400, "message": "Invalid value at \'generation_config.temperature\'",'
        ' "status": "INVALID_ARGUMENT"}}',
        {
            "kind": "invalid",
            "status": 400,
            "code": "invalid_value",
            "param": None,
            "retryable": False,
            "max_candidates": None,
            "cls": InvalidValue,
            "message": "Upstream: Invalid value at 'generation_config.temperature'",
        },
    ),
    (
        "prompt too long: context_length_exceeded",
        400,
        '{"error": {"code": 400, "message": "The input token count (1200000) exceeds the maximum'
        ' number of tokens allowed (1048576).", "status": "INVALID_ARGUMENT"}}',
        {
            "kind": "context",
            "status": 400,
            "code": "context_length_exceeded",
            "param": "messages",
            "retryable": False,
        },
    ),
    (
        "invalid API key (a 400 on Gemini): upstream auth failure, 502",
        400,
        '{"error": {"code": 400, "message": "API key not valid. Please pass a valid API key.",'
        ' "status": "INVALID_ARGUMENT", "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",'
        ' "reason": "API_KEY_INVALID", "domain": "googleapis.com"}]}}',
        {
            "kind": "auth",
            "status": 502,
            "code": "upstream_error",
            "retryable": False,
            "cls": UpstreamError,
        },
    ),
    (
        "403 PERMISSION_DENIED: upstream auth failure, 502",
        403,
        '{"error": {"code": 403, "message": "Method doesn\'t allow unregistered callers",'
        ' "status": "PERMISSION_DENIED"}}',
        {"kind": "auth", "status": 502, "retryable": False},
    ),
    (
        "429 RESOURCE_EXHAUSTED: rate limit, RetryInfo's delay",
        429,
        '{"error": {"code": 429, "message": "You exceeded your current quota.",'
        ' "status": "RESOURCE_EXHAUSTED", "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo",'
        ' "retryDelay": "17s"}]}}',
        {
            "kind": "rate_limit",
            "status": 429,
            "code": "rate_limit_exceeded",
            "retryable": True,
            "retry_after": 17.0,
            "cls": RateLimitExceeded,
        },
    ),
    (
        "503 UNAVAILABLE: overloaded",
        503,
        '{"error": {"code": 503, "message": "The model is overloaded. Please try again later.",'
        ' "status": "UNAVAILABLE"}}',
        {
            "kind": "overloaded",
            "status": 503,
            "code": "server_is_overloaded",
            "retryable": True,
            "cls": Overloaded,
        },
    ),
    (
        "500 INTERNAL: upstream_error, retryable",
        500,
        '{"error": {"code": 500, "message": "An internal error has occurred.", "status": "INTERNAL"}}',
        {"kind": "upstream", "status": 502, "code": "upstream_error", "retryable": True},
    ),
    (
        "504 DEADLINE_EXCEEDED: upstream_timeout",
        504,
        '{"error": {"code": 504, "message": "Deadline exceeded", "status": "DEADLINE_EXCEEDED"}}',
        {
            "kind": "timeout",
            "status": 504,
            "code": "upstream_timeout",
            "retryable": True,
            "cls": UpstreamTimeout,
        },
    ),
    (
        "404 unknown model: the route's configuration, 502 not retryable",
        404,
        '{"error": {"code": 404, "message": "models/gemini-9 is not found for API version v1beta",'
        ' "status": "NOT_FOUND"}}',
        {"kind": "route", "status": 502, "retryable": False},
    ),
    (
        "an HTML 502 page: upstream_error, retryable",
        502,
        "<html><body>502 Bad Gateway</body></html>",
        {"kind": "upstream", "status": 502, "retryable": True, "param": None},
    ),
]


@pytest.mark.parametrize(
    ("status", "body", "expected"), [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS]
)
def test_error_translation(status: int, body: str, expected: dict[str, Any]) -> None:
    error = translate_error(status, body.encode(), provider_request_id="req-1")
    expected = dict(expected)
    cls = expected.pop("cls", None)
    for name, value in expected.items():
        assert getattr(error, name) == value, name
    assert error.provider_request_id == "req-1"
    ncap_error = error.as_ncap_error()
    assert ncap_error.status == error.status
    assert ncap_error.envelope()["error"]["param"] == error.param
    if cls is not None:
        assert type(ncap_error) is cls


def test_retry_after_header_is_the_fallback_delay() -> None:
    body = b'{"error": {"code": 429, "message": "quota", "status": "RESOURCE_EXHAUSTED"}}'
    assert translate_error(429, body, retry_after="3").retry_after == 3.0
    assert translate_error(429, body).retry_after is None


# --- thought signatures (Gemini 3 refuses a replayed function call without one) ---


def test_thought_signature_survives_the_openai_round_trip() -> None:
    """Gemini's signature rides in the tool call id; sent back, it returns to its part."""
    answer = _completion(
        """{"candidates": [{"content": {"parts": [
              {"functionCall": {"name": "time", "args": {}}, "thoughtSignature": "c2ln"}]},
            "finishReason": "STOP"}]}"""
    )
    (call,) = answer["choices"][0]["message"]["tool_calls"]
    assert call["id"] == "call_chatcmpl-x_0_0__thought__c2ln"
    history = [
        USER,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "14:05"},
    ]
    contents = _gemini_body({"messages": history, "tools": [TIME]})["contents"]
    assert contents[1]["parts"] == [
        {
            "thoughtSignature": "c2ln",
            "functionCall": {"id": "call_chatcmpl-x_0_0", "name": "time", "args": {}},
        }
    ]
    assert contents[2]["parts"][0]["functionResponse"]["id"] == "call_chatcmpl-x_0_0"


def test_replay_signature_fills_calls_without_one() -> None:
    history = [
        USER,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "time", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "14:05"},
    ]
    _, req = parse_chat_request(
        json.dumps({"model": "m", "messages": history, "tools": [TIME]}).encode()
    )
    plain = msgspec.to_builtins(to_gemini_request(req))
    assert "thoughtSignature" not in plain["contents"][1]["parts"][0]
    replayed = msgspec.to_builtins(
        to_gemini_request(req, replay_signature="skip_thought_signature_validator")
    )
    assert (
        replayed["contents"][1]["parts"][0]["thoughtSignature"]
        == "skip_thought_signature_validator"
    )


def test_streamed_function_call_carries_its_signature_in_the_id() -> None:
    chunks = _chunks(
        'data: {"candidates": [{"content": {"parts": [{"functionCall": {"id": "g1", "name": "time"},'
        ' "thoughtSignature": "c2ln"}]}, "finishReason": "STOP"}]}\n\n'
    )
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["id"] == "g1__thought__c2ln"


# --- what the adapter relays: OpenAI SSE events with their settlement summaries ---


async def test_events_and_end_are_relayable_openai_sse() -> None:
    async def lines() -> AsyncIterator[bytes]:
        for line in STREAM_N2.encode().splitlines(keepends=True):
            yield line

    stream = GeminiStream(completion_id="chatcmpl-s", created=9, model="alias")
    pieces: list[StreamPiece | None] = [stream.events(data) async for data in iter_data(lines())]
    pieces.append(stream.end())
    relayable = [p for p in pieces if p is not None]
    last = relayable[-1]
    assert last.done and last.raw.endswith(b"data: [DONE]\n\n")

    async def relayed() -> AsyncIterator[bytes]:
        for piece in relayable:
            for line in piece.raw.splitlines(keepends=True):
                yield line

    reparsed = [p async for p in iter_pieces(relayed())]  # the gateway's own SSE reader
    summaries = [s for p in relayable for s in p.summaries]
    assert [s for p in reparsed for s in p.summaries] == summaries
    assert b"".join(p.raw for p in reparsed) == b"".join(p.raw for p in relayable)
    usage = summaries[-1]
    assert usage.usage is not None and usage.usage.completion_tokens == 14
    finishes = [(c.index, c.finish_reason) for s in summaries for c in s.choices]
    assert (0, "stop") in finishes and (1, "length") in finishes


def test_an_error_event_mid_stream_keeps_its_meaning() -> None:
    data = (
        b'{"error": {"code": 503, "message": "The model is overloaded.", "status": "UNAVAILABLE"}}'
    )
    with pytest.raises(GeminiError) as caught:
        decode_stream_event(data)
    assert (caught.value.kind, caught.value.status) == ("overloaded", 503)


def test_a_cut_stream_reports_no_usage_and_no_done() -> None:
    """Gemini puts running usage on every event and has no end marker: a stream cut
    before every candidate finished must not settle from its partial usage."""
    stream = GeminiStream(completion_id="c", created=0, model="m")
    first = _sse_payloads(STREAM_N2)[:2]  # both candidates started, none finished
    for data in first:
        stream.events(data)
    assert stream.usage is not None  # Gemini did report running usage
    assert (stream.complete, stream.close(), stream.end()) == (False, [], None)
