"""The OpenAI ↔ Anthropic Messages translator, mapping by mapping (pure: no I/O)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from ncap.errors import InvalidValue
from ncap.lifecycle.failures import client_error, retryable
from ncap.protocol import anthropic as a
from ncap.protocol.chat import ChatCompletionRequest
from ncap.providers.anthropic_errors import anthropic_failure
from ncap.providers.anthropic_request import Shape, to_anthropic_request
from ncap.providers.anthropic_response import finish_reason, to_chat_completion, usage_of
from ncap.providers.anthropic_stream import AnthropicStream
from ncap.providers.base import AttemptFailed
from ncap.streaming.sse import event_data, split_events

USER = {"role": "user", "content": "Hi"}


def _request(**fields: Any) -> dict[str, Any]:
    req = msgspec.convert(
        {"model": "m", "messages": [USER], "max_completion_tokens": 50, **fields},
        ChatCompletionRequest,
    )
    body, _ = to_anthropic_request(req, model="claude-x")
    return body


def test_minimal_request() -> None:
    assert _request() == {
        "model": "claude-x",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    }


def test_system_and_developer_go_to_system_in_order() -> None:
    body = _request(
        messages=[
            {"role": "system", "content": "A"},
            USER,
            {"role": "developer", "content": [{"type": "text", "text": "B"}]},
        ]
    )
    assert body["system"] == [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]
    assert [m["role"] for m in body["messages"]] == ["user"]


def test_sampling_stop_and_user() -> None:
    body = _request(temperature=0.2, top_p=0.9, stop="END", user="u-1", seed=5)
    assert body["temperature"] == 0.2 and body["top_p"] == 0.9
    assert body["stop_sequences"] == ["END"]
    assert body["metadata"] == {"user_id": "u-1"}
    assert "seed" not in body  # Anthropic has none
    assert _request(stop=["a", "b"])["stop_sequences"] == ["a", "b"]


def test_temperature_above_one_is_refused_naming_it() -> None:
    with pytest.raises(InvalidValue) as info:
        _request(temperature=1.2)
    assert info.value.param == "temperature"
    assert _request(temperature=1.0)["temperature"] == 1.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"1": 2}),
        ("logprobs", True),
        ("top_logprobs", 2),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 0.5),
        ("n", 2),
        ("reasoning_effort", "low"),
    ],
)
def test_fields_without_an_anthropic_meaning_are_refused(field: str, value: Any) -> None:
    with pytest.raises(InvalidValue) as info:
        _request(**{field: value})
    assert info.value.param == field


def test_output_ceiling_is_required() -> None:
    req = msgspec.convert({"model": "m", "messages": [USER]}, ChatCompletionRequest)
    with pytest.raises(InvalidValue):
        to_anthropic_request(req, model="x")
    assert _request(max_completion_tokens=None, max_tokens=9)["max_tokens"] == 9


def test_user_parts_become_blocks() -> None:
    parts = [
        {"type": "text", "text": "see"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}},
        {"type": "file", "file": {"file_data": "data:application/pdf;base64,QkJC"}},
    ]
    (turn,) = _request(messages=[{"role": "user", "content": parts}])["messages"]
    assert turn["content"] == [
        {"type": "text", "text": "see"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}},
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": "QkJC"},
        },
    ]


def test_tool_calls_and_results_round_trip_and_turns_merge() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    body = _request(
        messages=[
            USER,
            {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "one"},
            {"role": "user", "content": "and?"},
        ]
    )
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": "one"},
                {"type": "text", "text": "and?"},
            ],
        },
    ]


def test_bad_tool_arguments_are_a_400_at_their_place() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
    with pytest.raises(InvalidValue) as info:
        _request(messages=[USER, {"role": "assistant", "tool_calls": [call]}])
    assert info.value.param == "messages[1].tool_calls[0].function.arguments"


TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "description": "d",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}


@pytest.mark.parametrize(
    ("choice", "parallel", "sent"),
    [
        (None, None, None),
        ("auto", None, {"type": "auto"}),
        ("required", None, {"type": "any"}),
        ("none", None, {"type": "none"}),
        ({"type": "function", "function": {"name": "f"}}, None, {"type": "tool", "name": "f"}),
        (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("required", False, {"type": "any", "disable_parallel_tool_use": True}),
    ],
)
def test_tools_and_tool_choice(choice: Any, parallel: Any, sent: Any) -> None:
    fields: dict[str, Any] = {"tools": [TOOL]}
    if choice is not None:
        fields["tool_choice"] = choice
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    body = _request(**fields)
    assert body["tools"] == [
        {
            "name": "f",
            "description": "d",
            "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
        }
    ]
    assert body.get("tool_choice") == sent


def test_tool_choice_naming_an_unknown_tool_is_refused() -> None:
    with pytest.raises(InvalidValue) as info:
        _request(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}})
    assert info.value.param == "tool_choice"


def test_response_format_is_a_forced_tool() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    req = msgspec.convert(
        {
            "model": "m",
            "messages": [USER],
            "max_completion_tokens": 5,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "out", "schema": schema},
            },
        },
        ChatCompletionRequest,
    )
    body, shape = to_anthropic_request(req, model="x")
    assert shape == Shape(json_tool="out")
    assert body["tools"][0]["input_schema"] == schema
    assert body["tool_choice"] == {"type": "tool", "name": "out"}
    with pytest.raises(InvalidValue) as info:
        _request(tools=[TOOL], response_format={"type": "json_object"})
    assert info.value.param == "response_format"


def test_a_cache_breakpoint_marks_its_block_with_cache_control() -> None:
    mark = {"mode": "explicit"}
    body = _request(
        messages=[
            {
                "role": "system",
                "content": [{"type": "text", "text": "S", "prompt_cache_breakpoint": mark}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "A"},
                    {"type": "text", "text": "B", "prompt_cache_breakpoint": mark},
                ],
            },
        ]
    )
    assert body["system"] == [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}]
    assert body["messages"][0]["content"] == [
        {"type": "text", "text": "A"},
        {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}},
    ]
    assert "cache_control" not in json.dumps(_request())


# --- response ---


@pytest.mark.parametrize(
    ("stop", "json_tool", "reason"),
    [
        ("end_turn", None, "stop"),
        ("stop_sequence", None, "stop"),
        ("max_tokens", None, "length"),
        ("tool_use", None, "tool_calls"),
        ("tool_use", "out", "stop"),
        ("refusal", None, "content_filter"),
        ("pause_turn", None, "stop"),
    ],
)
def test_stop_reasons(stop: str, json_tool: str | None, reason: str) -> None:
    assert finish_reason(stop, Shape(json_tool)) == reason


def test_usage_counts_cache_reads_and_writes_as_prompt() -> None:
    usage = usage_of(
        a.AnthropicUsage(
            input_tokens=10,
            output_tokens=4,
            cache_read_input_tokens=100,
            cache_creation_input_tokens=20,
        )
    )
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (130, 4, 134)
    assert usage.prompt_tokens_details is not msgspec.UNSET
    assert usage.prompt_tokens_details.cached_tokens == 100
    assert usage.prompt_tokens_details.cache_write_tokens == 20
    assert usage_of(a.AnthropicUsage(output_tokens=3)) is None  # unknown, not zero


def test_message_to_chat_completion() -> None:
    msg = msgspec.convert(
        {
            "id": "msg_1",
            "model": "claude-x",
            "stop_reason": "tool_use",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "thinking", "thinking": "…"},
                {"type": "tool_use", "id": "tu_1", "name": "f", "input": {"a": 1}},
            ],
            "usage": {"input_tokens": 5, "output_tokens": 7},
        },
        a.Message,
    )
    out = msgspec.to_builtins(
        to_chat_completion(msg, completion_id="chatcmpl-1", created=1, model="x", shape=Shape())
    )
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    assert choice["message"]["tool_calls"] == [
        {"id": "tu_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    ]
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 7


# --- stream ---


def _sse(kind: str, **data: Any) -> bytes:
    return json.dumps({"type": kind, **data}).encode()


STREAM = [
    _sse(
        "message_start",
        message={
            "id": "msg_1",
            "model": "claude-x",
            "content": [],
            "usage": {"input_tokens": 9, "cache_read_input_tokens": 3, "output_tokens": 1},
        },
    ),
    _sse("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    _sse("ping"),
    _sse("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hel"}),
    _sse("content_block_delta", index=0, delta={"type": "text_delta", "text": "lo"}),
    _sse("content_block_stop", index=0),
    _sse(
        "content_block_start",
        index=1,
        content_block={"type": "tool_use", "id": "tu_1", "name": "f", "input": {}},
    ),
    _sse(
        "content_block_delta", index=1, delta={"type": "input_json_delta", "partial_json": '{"a"'}
    ),
    _sse("content_block_delta", index=1, delta={"type": "input_json_delta", "partial_json": ":1}"}),
    _sse("content_block_stop", index=1),
    _sse("message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 12}),
    _sse("message_stop"),
]


def _chunks(translator: AnthropicStream, events: list[bytes]) -> list[dict[str, Any]]:
    pieces = [translator.events(data) for data in events]
    pieces.append(translator.end())
    out = [event_data(e) for p in pieces if p is not None for e in split_events(p.raw)]
    return [json.loads(data) for data in out if data and data != b"[DONE]"]


def test_stream_translates_to_chunks_at_index_zero() -> None:
    translator = AnthropicStream(completion_id="chatcmpl-1", created=1, model="x")
    chunks = _chunks(translator, STREAM)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert {c["index"] for c in choices} == {0}
    assert choices[0]["delta"] == {"content": "", "role": "assistant"}
    text = "".join(c["delta"].get("content") or "" for c in choices)
    assert text == "Hello"
    calls = [tc for c in choices for tc in c["delta"].get("tool_calls") or []]
    assert calls[0] == {
        "index": 0,
        "id": "tu_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"a":1}'
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["tool_calls"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (12, 12)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 3
    last = translator.end()
    assert last is not None and last.done and last.raw.endswith(b"data: [DONE]\n\n")


def test_cut_stream_ends_without_usage_or_done() -> None:
    translator = AnthropicStream(completion_id="chatcmpl-1", created=1, model="x")
    for data in STREAM[:5]:
        translator.events(data)
    assert translator.end() is None


def test_stream_error_event_is_a_failure_with_its_status() -> None:
    translator = AnthropicStream(completion_id="chatcmpl-1", created=1, model="x")
    with pytest.raises(AttemptFailed) as info:
        translator.events(
            _sse("error", error={"type": "overloaded_error", "message": "Overloaded"})
        )
    assert info.value.status == 529 and retryable(info.value)


def test_unreadable_stream_event_is_a_protocol_failure() -> None:
    translator = AnthropicStream(completion_id="chatcmpl-1", created=1, model="x")
    with pytest.raises(AttemptFailed) as info:
        translator.events(b"{not json")
    assert info.value.kind == "protocol"


# --- errors ---


def _error(kind: str, message: str) -> bytes:
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


def test_error_answers_are_facts() -> None:
    f = anthropic_failure(
        429, {"retry-after": "7", "request-id": "r1"}, _error("rate_limit_error", "slow")
    )
    assert (f.status, f.retry_after, f.provider_request_id) == (429, 7.0, "r1")
    assert f.error is not None and f.error.code == "rate_limit_exceeded"
    f = anthropic_failure(
        400, {}, _error("invalid_request_error", "prompt is too long: 300000 tokens")
    )
    assert f.error is not None and f.error.code == "context_length_exceeded"
    f = anthropic_failure(502, {}, b"<html>bad gateway</html>")
    assert f.error is None and f.status == 502
    # facts only: the failure table decides (a 502 without an envelope: retried)
    assert retryable(f) and client_error(f).status == 502
