"""Response in: Anthropic's Messages answer → OpenAI's ``chat.completion``.

- stop reasons: end_turn / stop_sequence / pause_turn → stop, max_tokens /
  model_context_window_exceeded → length, tool_use → tool_calls, refusal → content_filter
  (the forced ``response_format`` tool's call is the answer: stop);
- usage: input + cache read + cache write tokens → ``prompt_tokens``, cache reads as
  ``prompt_tokens_details.cached_tokens``, cache writes as ``cache_write_tokens``.
"""

from __future__ import annotations

import json

import msgspec
from msgspec import UNSET

from ncap.protocol import anthropic as a
from ncap.protocol.responses import (
    ChatCompletion,
    Choice,
    FinishReason,
    FunctionCall,
    Message,
    PromptTokensDetails,
    ToolCall,
    Usage,
)
from ncap.providers.anthropic_request import Shape

__all__ = ["decode_message", "finish_reason", "to_chat_completion", "usage_of"]

_decode_message = msgspec.json.Decoder(a.Message).decode

_FINISH: dict[str, FinishReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


def decode_message(payload: bytes) -> a.Message:
    """The 200 answer (the translator turns a ``msgspec`` error into a protocol failure)."""
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
    """One ``chat.completion`` of one choice (Messages answers one candidate)."""
    content, calls = _message(msg, shape)
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


def _message(msg: a.Message, shape: Shape) -> tuple[str | None, list[ToolCall]]:
    """The text (the forced ``response_format`` tool's input among it, as JSON) and the
    client's tool calls; no text at all only when there are calls."""
    text: list[str] = []
    calls: list[ToolCall] = []
    for block in msg.content:
        if block.type == "text" and block.text is not None:
            text.append(block.text)
        elif block.type == "tool_use" and block.name == shape.json_tool:
            text.append(json.dumps(block.input, separators=(",", ":")))
        elif block.type == "tool_use":
            calls.append(_tool_call(block, len(calls)))
    return ("".join(text) if text or not calls else None), calls


def _tool_call(block: a.ContentBlock, k: int) -> ToolCall:
    arguments = json.dumps(block.input or {}, separators=(",", ":"))
    return ToolCall(
        id=block.id or f"call_{k}",
        type="function",
        function=FunctionCall(name=block.name or "", arguments=arguments),
    )
