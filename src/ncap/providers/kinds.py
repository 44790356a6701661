"""The provider kit's registry. What each kind of provider can do, declared once: the
endpoints it serves, the candidate modes it supports (``native`` n, ``emulate`` by
fan-out), whether its streams report usage, how it caches prompts, and whether it runs
in the gateway's process; and the translator of its schema pair (``translator_for``),
picked here and nowhere else.

Code outside ``providers/`` asks these questions of a route (``capabilities_of``) and
never compares a provider's name. A new provider is one entry in ``KINDS``, one in
``TRANSLATORS`` and one case in ``provider_for`` (see CONTRIBUTING.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ncap.providers.base import RequestKind

if TYPE_CHECKING:
    from ncap.providers.translate import Translator

__all__ = [
    "CHAT_ONLY",
    "KINDS",
    "TRANSLATORS",
    "CandidateMode",
    "Capabilities",
    "PromptCache",
    "capabilities_of",
    "translator_for",
]

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


# The translators, imported only when a route of the kind is built. The in-process
# engine has no wire between the gateway and it, so no schema pair: no translator.


def _openai() -> Translator[Any]:
    from ncap.providers.openai_passthrough import OpenAITranslator

    return OpenAITranslator()


def _azure() -> Translator[Any]:
    from ncap.providers.openai_passthrough import AzureTranslator

    return AzureTranslator()


def _anthropic() -> Translator[Any]:
    from ncap.providers.openai_anthropic import AnthropicTranslator

    return AnthropicTranslator()


def _gemini() -> Translator[Any]:
    from ncap.providers.openai_gemini import GeminiTranslator

    return GeminiTranslator()


TRANSLATORS: dict[str, Callable[[], Translator[Any]]] = {
    "openai": _openai,
    "azure": _azure,
    "anthropic": _anthropic,
    "gemini": _gemini,
}


def translator_for(provider: str) -> Translator[Any]:
    """The translator of a route's ``provider`` kind (a kind that is not in-process)."""
    return TRANSLATORS[provider]()
