"""What each kind of provider can do, declared once: the endpoints it serves, the
candidate modes it supports (``native`` n, ``emulate`` by fan-out), whether its streams
report usage, how it caches prompts, and whether it runs in the gateway's process.

Code outside ``providers/`` asks these questions of a route (``capabilities_of``) and
never compares a provider's name. A new provider is one entry here and one case in
``provider_for`` (see CONTRIBUTING.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ncap.providers.base import RequestKind

__all__ = ["CHAT_ONLY", "KINDS", "CandidateMode", "Capabilities", "PromptCache", "capabilities_of"]

CandidateMode = Literal["native", "emulate"]
PromptCache = Literal["automatic", "explicit", "implicit", "none"]
"""How the upstream caches a long prompt prefix: by itself (``automatic``: OpenAI,
``implicit``: Gemini), only where the request marks it (``explicit``: Anthropic's
``cache_control``), or not at all."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    title: str  # the kind in a sentence: "a Gemini", "an Anthropic"
    endpoints: frozenset[RequestKind]
    candidates: frozenset[CandidateMode]
    stream_usage: bool = True
    prompt_cache: PromptCache = "none"
    in_process: bool = False

    def serves(self, kind: RequestKind) -> bool:
        return kind in self.endpoints


CHAT_ONLY: frozenset[RequestKind] = frozenset({"chat"})
_BOTH: frozenset[RequestKind] = frozenset({"chat", "completions"})
_ANY_N: frozenset[CandidateMode] = frozenset({"native", "emulate"})

KINDS: dict[str, Capabilities] = {
    "openai": Capabilities(
        "an OpenAI-compatible", _BOTH, _ANY_N, prompt_cache="automatic",
    ),
    "azure": Capabilities(
        "an Azure OpenAI", _BOTH, _ANY_N, prompt_cache="automatic",
    ),
    "anthropic": Capabilities(
        "an Anthropic", CHAT_ONLY, frozenset({"emulate"}), prompt_cache="explicit",
    ),
    "gemini": Capabilities(
        "a Gemini", CHAT_ONLY, _ANY_N, prompt_cache="implicit",
    ),
    "local": Capabilities(
        "a local engine", _BOTH, _ANY_N, in_process=True,
    ),
}  # fmt: skip


def capabilities_of(provider: str) -> Capabilities:
    """The capabilities of a route's ``provider`` (a name ``config.Route`` accepted)."""
    return KINDS[provider]
