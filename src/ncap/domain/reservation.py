"""What a request may spend at most, reserved before dispatch.

reserved input  = estimated input tokens × prefills (1 native, k = n emulated)
reserved output = n × per-candidate ceiling    (``per_candidate`` routes, emulation)
                = the ceiling                  (``shared`` routes: one budget for all)
reserved cost   = route prices of the above, no cache discount assumed, rounded up

The reservation is sized from the real ceiling (the request's, or the one the
gateway sends upstream), never from a guessed default and never shrunk to fit what
is left of a budget: a budget that cannot cover it refuses the request instead.

Input estimate without a tokenizer: the UTF-8 byte length of every message and of
the tool/function/response-format JSON, plus a per-message and a per-request
overhead. It is conservative because byte-level BPE tokenizers (tiktoken, GPT-2,
Llama 3, SmolLM2) and SentencePiece with byte fallback split text into tokens that
each cover at least one byte, so ``tokens <= bytes``; the compact-JSON keys and
quotes counted on top more than cover the template's role markers. Images cost
tokens their URL does not show, so each image part counts at least
``IMAGE_PART_TOKENS``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import msgspec

from ncap.config import Pricing
from ncap.domain.money import cost_micros

__all__ = [
    "IMAGE_PART_TOKENS",
    "MESSAGE_OVERHEAD_TOKENS",
    "REQUEST_OVERHEAD_TOKENS",
    "Reservation",
    "estimate_input_tokens",
    "reservation_for",
]

OutputCap = Literal["per_candidate", "shared"]
Mode = Literal["native", "emulate"]

MESSAGE_OVERHEAD_TOKENS = 8
REQUEST_OVERHEAD_TOKENS = 16
# high-detail images cost at most ~2,500 tokens on current OpenAI vision models
IMAGE_PART_TOKENS = 3_000


class Reservation(msgspec.Struct, frozen=True, gc=False):
    """Tokens and micro-USD held against the workload's windows until settlement."""

    input_tokens: int
    output_tokens: int
    cost_micros: int

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


def reservation_for(
    *,
    estimated_input_tokens: int,
    effective_n: int,
    per_candidate_ceiling: int,
    output_cap: OutputCap,
    candidates_mode: Mode,
    pricing: Pricing,
) -> Reservation:
    """The worst case this attempt can cost; see the module docstring for the formula."""
    if estimated_input_tokens < 0 or effective_n < 1 or per_candidate_ceiling < 1:
        raise ValueError("a reservation needs input >= 0, n >= 1 and a ceiling >= 1")
    if candidates_mode == "emulate":
        prefills, output = effective_n, effective_n * per_candidate_ceiling
    elif output_cap == "shared":
        prefills, output = 1, per_candidate_ceiling
    else:
        prefills, output = 1, effective_n * per_candidate_ceiling
    input_tokens = prefills * estimated_input_tokens
    return Reservation(
        input_tokens=input_tokens,
        output_tokens=output,
        cost_micros=cost_micros(input_tokens, 0, output, pricing),
    )


def estimate_input_tokens(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Any] | None = None,
    functions: Sequence[Any] | None = None,
    response_format: Mapping[str, Any] | None = None,
) -> int:
    """An upper bound on the prompt tokens of a chat request (see the module docstring)."""
    total = REQUEST_OVERHEAD_TOKENS + _messages_bytes(messages)
    for message in messages:
        total += MESSAGE_OVERHEAD_TOKENS
        if isinstance(message.get("content"), list):
            total += _image_top_up(message)
    for extra in (tools, functions, response_format):
        if extra:
            total += _json_bytes(extra)
    return total


def _messages_bytes(messages: Sequence[Mapping[str, Any]]) -> int:
    """The sum of each message's compact JSON length, from one encode of the list: its
    brackets and the commas between messages are all it adds."""
    if not messages:
        return 0
    try:
        return len(msgspec.json.encode(messages)) - len(messages) - 1
    except (TypeError, msgspec.EncodeError):
        return sum(_json_bytes(message) for message in messages)


def _image_top_up(message: Mapping[str, Any]) -> int:
    """What the message's image parts count beyond their bytes: each at least the
    image allowance."""
    return sum(
        max(0, IMAGE_PART_TOKENS - _json_bytes(p)) for p in _image_parts(message.get("content"))
    )


def _image_parts(content: Any) -> Iterable[Any]:
    if isinstance(content, list):
        yield from (p for p in content if isinstance(p, Mapping) and p.get("type") == "image_url")


def _json_bytes(value: Any) -> int:
    """Length of the compact UTF-8 JSON (msgspec: same bytes as json.dumps, faster)."""
    try:
        return len(msgspec.json.encode(value))
    except (TypeError, msgspec.EncodeError):
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
        return len(text.encode("utf-8"))
