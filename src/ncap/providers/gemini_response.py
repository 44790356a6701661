"""Response in: Gemini's ``GenerateContentResponse`` → OpenAI's ``chat.completion``.

- candidates are keyed by Gemini's own ``candidate.index``, never by list position; an
  absent index is proto3's 0, accepted only while no other candidate of the same
  response also claims 0 (two candidates without an index are ambiguous: a protocol
  error, not a guess);
- usage: ``thoughtsTokenCount`` is reasoning *and* output (Gemini's
  ``candidatesTokenCount`` excludes it), ``cachedContentTokenCount`` is cached input;
- a prompt blocked before any candidate is a ``blocked`` failure with its usage.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import msgspec
from msgspec import UNSET

from ncap.protocol import gemini as g
from ncap.protocol.responses import (
    ChatCompletion,
    Choice,
    CompletionTokensDetails,
    FinishReason,
    FunctionCall,
    Message,
    PromptTokensDetails,
    ToolCall,
    Usage,
)
from ncap.providers.gemini_errors import GeminiError, protocol_error
from ncap.providers.gemini_request import SIGNED

__all__ = [
    "Call",
    "args_json",
    "blocked",
    "by_index",
    "call_id",
    "decode_response",
    "finish_reason",
    "parts_of",
    "to_chat_completion",
    "usage_of",
]

_decode_response = msgspec.json.Decoder(g.GenerateContentResponse).decode

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
        message = "The upstream provider sent a malformed response."
        raise protocol_error(message, str(exc), provider_request_id) from exc


def by_index(candidates: Iterable[g.Candidate]) -> dict[int, g.Candidate]:
    """Candidates by their own index, in upstream order; a repeated index (two absent
    ones included) is a protocol error."""
    keyed: dict[int, g.Candidate] = {}
    for candidate in candidates:
        index = candidate.index if candidate.index is not None else 0
        if index in keyed:
            message = "The upstream provider sent two candidates with the same index."
            raise protocol_error(message, f"duplicate candidate index {index}")
        keyed[index] = candidate
    return keyed


Call = tuple[g.ResponseFunctionCall, str | None]  # a function call and its thought signature


def call_id(call: Call, prefix: str, index: int, k: int) -> str:
    """Gemini's id (or a stable one), with the call's thought signature appended after
    ``SIGNED``: the client sends the id back with the tool result, which is how the
    signature Gemini 3 requires on a replayed call survives an OpenAI round trip."""
    function, signature = call
    base = function.id or f"call_{prefix}_{index}_{k}"
    return f"{base}{SIGNED}{signature}" if signature else base


def parts_of(candidate: g.Candidate) -> tuple[str | None, list[Call]]:
    """Visible text (thought summaries left out) and function calls of a candidate."""
    texts: list[str] = []
    calls: list[Call] = []
    parts = candidate.content.parts if candidate.content is not None else []
    for part in parts:
        if part.thought:
            continue
        if part.text is not None:
            texts.append(part.text)
        if part.function_call is not None:
            calls.append((part.function_call, part.thought_signature))
    return ("".join(texts) if texts else None), calls


def args_json(call: Call) -> str:
    return json.dumps(call[0].args or {}, ensure_ascii=False, separators=(",", ":"))


def blocked(resp: g.GenerateContentResponse, provider_request_id: str | None) -> GeminiError:
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
        raise blocked(resp, provider_request_id)
    keyed = by_index(resp.candidates)
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
    text, calls = parts_of(candidate)
    tool_calls = [
        ToolCall(
            id=call_id(call, prefix, index, k),
            type="function",
            function=FunctionCall(name=call[0].name, arguments=args_json(call)),
        )
        for k, call in enumerate(calls)
    ]
    return Choice(
        finish_reason=finish_reason(candidate.finish_reason, tool_calls=bool(calls)),
        index=index,
        message=Message(content=text, refusal=None, tool_calls=tool_calls or UNSET),
        logprobs=None,
    )
