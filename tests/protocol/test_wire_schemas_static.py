"""Cross-check the wire structs against OpenAI's reference schemas (tests/schemas).

Requests: every body the validator accepts in the table is valid for the reference,
and every body it rejects for a reason the reference states is invalid for it too.
Responses: bodies encoded from ``ncap.protocol.responses`` match the reference.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest

from ncap.errors import InvalidJSON, UnknownParameter
from ncap.protocol.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionTokensDetails,
    Delta,
    FunctionCall,
    Message,
    PromptTokensDetails,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from tests.protocol.test_validation_table import INVALID, VALID_BODIES, VALID_COMPLETIONS
from tests.wire import (
    BUNDLE,
    validate_chunk,
    validate_completion_request,
    validate_completion_response,
    validate_request,
    validate_response,
)

# Rejections where the gateway is stricter than the reference's schema, each on purpose:
# cross-field rules and limits the reference states only in prose, the integer-typed
# 2.0, nesting limits, and nested unknown fields (the schema allows additional properties).
STRICTER_THAN_SCHEMA = {
    "n-integral-float": "integers must be JSON integers (2.0 is an integer for JSON Schema)",
    "assistant-without-content-or-calls": "content 'required unless tool_calls' (prose)",
    "assistant-empty-tool-calls-no-content": "content 'required unless tool_calls' (prose)",
    "top-logprobs-without-logprobs": "'logprobs must be true' (prose)",
    "top-logprobs-logprobs-false": "'logprobs must be true' (prose)",
    "stream-options-without-stream": "'only set this when you set stream: true' (prose)",
    "stream-options-stream-false": "'only set this when you set stream: true' (prose)",
    "audio-modality-without-audio": "'required when audio output is requested' (prose)",
    "max-tokens-zero": "an output ceiling is >= 1 (ours)",
    "max-completion-tokens-zero": "an output ceiling is >= 1 (ours)",
    "logit-bias-above": "'bias value from -100 to 100' (prose)",
    "logit-bias-below": "'bias value from -100 to 100' (prose)",
    "logit-bias-key": "'maps tokens (specified by their token ID)' (prose)",
    "metadata-too-many": "'16 key-value pairs' (Metadata prose)",
    "metadata-long-value": "'values ... maximum length of 512' (Metadata prose)",
    "metadata-long-key": "'keys ... maximum length of 64' (Metadata prose)",
    "seed-above-int64": "the schema's bound is int64 rounded through a float (…776000)",
}


def test_bundle_is_a_valid_draft_2020_12_schema() -> None:
    bundle = json.loads(BUNDLE.read_text())
    jsonschema.Draft202012Validator.check_schema(bundle)
    assert "nullable" not in BUNDLE.read_text()


@pytest.mark.parametrize(("case", "value"), VALID_BODIES, ids=[c[0] for c in VALID_BODIES])
def test_accepted_request_matches_reference(case: str, value: dict[str, Any]) -> None:
    validate_request(value)


@pytest.mark.parametrize("value", VALID_COMPLETIONS)
def test_accepted_completion_request_matches_reference(value: dict[str, Any]) -> None:
    validate_completion_request(value)


SCHEMA_CHECKABLE = [
    case
    for case in INVALID
    if isinstance(case[1], dict)
    and case[2] not in (InvalidJSON, UnknownParameter)
    and case[0] not in STRICTER_THAN_SCHEMA
]


@pytest.mark.parametrize(
    ("case", "value"), [c[:2] for c in SCHEMA_CHECKABLE], ids=[c[0] for c in SCHEMA_CHECKABLE]
)
def test_rejected_request_is_invalid_for_reference(case: str, value: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validate_request(value)


@pytest.mark.parametrize("case", sorted(STRICTER_THAN_SCHEMA))
def test_stricter_cases_are_valid_for_reference(case: str) -> None:
    """Keeps the list exact: each entry is a body the schema accepts and the gateway rejects."""
    (value,) = [c[1] for c in INVALID if c[0] == case]
    validate_request(value)


# --- responses.py against the response and chunk schemas ---


def wire(struct: msgspec.Struct) -> Any:
    return msgspec.json.decode(msgspec.json.encode(struct))


LOGPROBS = ChoiceLogprobs(
    content=[
        TokenLogprob(
            token="Hi",
            logprob=-0.1,
            bytes=[72, 105],
            top_logprobs=[TopLogprob(token="Hi", logprob=-0.1, bytes=[72, 105])],
        )
    ]
)
USAGE = Usage(
    completion_tokens=5,
    prompt_tokens=10,
    total_tokens=15,
    completion_tokens_details=CompletionTokensDetails(),
    prompt_tokens_details=PromptTokensDetails(cached_tokens=2),
)
TOOL_CALL = ToolCall(id="call_1", type="function", function=FunctionCall(name="f", arguments="{}"))

RESPONSES: list[tuple[str, ChatCompletion]] = [
    (
        "text",
        ChatCompletion(
            id="chatcmpl-1",
            choices=[
                Choice(
                    finish_reason="stop",
                    index=0,
                    message=Message(content="Hi", refusal=None),
                    logprobs=None,
                )
            ],
            created=1700000000,
            model="gpt-4o-mini",
            usage=USAGE,
        ),
    ),
    (
        "two-choices-logprobs-tools",
        ChatCompletion(
            id="chatcmpl-2",
            choices=[
                Choice(
                    finish_reason="length",
                    index=0,
                    message=Message(content="Hi", refusal=None),
                    logprobs=LOGPROBS,
                ),
                Choice(
                    finish_reason="tool_calls",
                    index=1,
                    message=Message(content=None, refusal=None, tool_calls=[TOOL_CALL]),
                    logprobs=None,
                ),
            ],
            created=1700000000,
            model="gpt-4o-mini",
            service_tier="default",
            system_fingerprint="fp_1",
            usage=USAGE,
        ),
    ),
]


def _chunk(*choices: ChunkChoice, usage: Usage | None = None) -> ChatCompletionChunk:
    chunk = ChatCompletionChunk(
        id="chatcmpl-1", choices=list(choices), created=1700000000, model="gpt-4o-mini"
    )
    if usage is not None or not choices:
        chunk.usage = usage
    return chunk


CHUNKS: list[tuple[str, ChatCompletionChunk]] = [
    (
        "role",
        _chunk(ChunkChoice(delta=Delta(role="assistant", content=""), finish_reason=None, index=0)),
    ),
    ("content", _chunk(ChunkChoice(delta=Delta(content="Hi"), finish_reason=None, index=1))),
    (
        "tool-call-delta",
        _chunk(
            ChunkChoice(
                delta=Delta(
                    tool_calls=[
                        ToolCallDelta(
                            index=0,
                            id="c",
                            type="function",
                            function={"name": "f", "arguments": ""},
                        )
                    ]
                ),
                finish_reason=None,
                index=0,
            )
        ),
    ),
    ("finish", _chunk(ChunkChoice(delta=Delta(), finish_reason="stop", index=0))),
    (
        "logprobs",
        _chunk(
            ChunkChoice(delta=Delta(content="Hi"), finish_reason=None, index=0, logprobs=LOGPROBS)
        ),
    ),
    ("usage", _chunk(usage=USAGE)),
    (
        "usage-null",
        _chunk(ChunkChoice(delta=Delta(content="x"), finish_reason=None, index=0), usage=None),
    ),
]


@pytest.mark.parametrize(("case", "response"), RESPONSES, ids=[c[0] for c in RESPONSES])
def test_response_struct_matches_reference(case: str, response: ChatCompletion) -> None:
    body = wire(response)
    validate_response(body)
    assert body["object"] == "chat.completion"
    assert all(choice["message"]["role"] == "assistant" for choice in body["choices"])


@pytest.mark.parametrize(("case", "chunk"), CHUNKS, ids=[c[0] for c in CHUNKS])
def test_chunk_struct_matches_reference(case: str, chunk: ChatCompletionChunk) -> None:
    body = wire(chunk)
    validate_chunk(body)
    assert body["object"] == "chat.completion.chunk"


def test_schema_catches_a_broken_response() -> None:
    body = wire(RESPONSES[0][1])
    del body["choices"][0]["message"]["role"]
    with pytest.raises(jsonschema.ValidationError):
        validate_response(body)


def test_completion_response_validator() -> None:
    body = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "gpt-3.5-turbo-instruct",
        "choices": [{"text": "Hi", "index": 0, "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    validate_completion_response(body)
    with pytest.raises(jsonschema.ValidationError):
        validate_completion_response({**body, "object": "chat.completion"})
