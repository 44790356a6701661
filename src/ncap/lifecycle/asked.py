"""What a validated request asks for, whichever endpoint it came to: the one place that
knows how chat and the legacy ``/v1/completions`` differ for admission.

- the candidate count: ``n``, or a legacy request's ``best_of`` (the upstream generates
  and bills every one of them) — and how many come back when that is fewer (``n``);
- the output ceiling: a legacy request without ``max_tokens`` gets OpenAI's legacy
  default of 16, which the gateway then sends and reserves for;
- the prompt's size estimate: messages (and tools) for chat, ``prompt`` and ``suffix``
  for the legacy endpoint.
"""

from __future__ import annotations

from typing import Any

from msgspec import UNSET

from ncap.domain.reservation import estimate_input_tokens
from ncap.lifecycle.plan import Sampling
from ncap.protocol.chat import ChatCompletionRequest
from ncap.protocol.completions import CompletionRequest
from ncap.providers.base import RequestKind

__all__ = [
    "LEGACY_DEFAULT_MAX_TOKENS",
    "Request",
    "candidate_param",
    "candidates",
    "default_ceiling",
    "given",
    "input_estimate",
    "kind_of",
    "max_completion_tokens",
    "returned",
    "sampling",
]

Request = ChatCompletionRequest | CompletionRequest
LEGACY_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` of the legacy completions endpoint."""


def given(value: Any) -> Any:
    """A struct field as the policy reads it: UNSET (absent) and null are both None."""
    return None if value is UNSET else value


def kind_of(request: Request) -> RequestKind:
    return "chat" if isinstance(request, ChatCompletionRequest) else "completions"


def candidates(request: Request) -> int | None:
    """The candidate count policy judges (None when the request names none); validation
    has already checked ``best_of`` >= ``n``."""
    n: int | None = given(request.n)
    if isinstance(request, CompletionRequest):
        best_of: int | None = given(request.best_of)
        return best_of if best_of is not None and best_of > 0 else n
    return n


def candidate_param(request: Request) -> str:
    """The field ``candidates`` read the count from, which a refusal of it names."""
    if isinstance(request, CompletionRequest):
        best_of: int | None = given(request.best_of)
        if best_of is not None and best_of > 0:
            return "best_of"
    return "n"


def returned(request: Request) -> int | None:
    """How many candidates come back when fewer are returned than generated (a legacy
    ``best_of`` > ``n``); None when all of them come back."""
    if not isinstance(request, CompletionRequest):
        return None
    n: int = given(request.n) or 1
    best_of: int | None = given(request.best_of)
    return n if best_of is not None and best_of > n else None


def max_completion_tokens(request: Request) -> int | None:
    if isinstance(request, CompletionRequest):
        return None  # the legacy endpoint has only max_tokens
    value: int | None = given(request.max_completion_tokens)
    return value


def sampling(request: Request) -> Sampling:
    """The numeric sampling parameters the request sent (traces report them)."""
    limit: int | None = max_completion_tokens(request)
    if limit is None:
        limit = given(request.max_tokens)
    temperature = given(request.temperature)
    return Sampling(
        max_tokens=limit,
        temperature=float(temperature) if temperature is not None else None,
        seed=given(request.seed),
    )


def default_ceiling(request: Request, policy_ceiling: int) -> int:
    """The per-candidate ceiling sent when the request set none: the policy's for chat;
    for the legacy endpoint its own default, within the policy's (what the client would
    get upstream without the gateway)."""
    if isinstance(request, CompletionRequest):
        return min(LEGACY_DEFAULT_MAX_TOKENS, policy_ceiling)
    return policy_ceiling


def input_estimate(body: dict[str, Any], kind: RequestKind) -> int:
    """An upper bound on the prompt tokens, from the body as the client sent it."""
    if kind == "completions":  # the prompt (and suffix), measured like one message
        return estimate_input_tokens([{"prompt": body.get("prompt"), "suffix": body.get("suffix")}])
    return estimate_input_tokens(
        body["messages"],
        tools=body.get("tools"),
        functions=body.get("functions"),
        response_format=body.get("response_format"),
    )
