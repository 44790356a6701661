"""What the scheduler thread reports for a request, and the aggregated result.

Events are plain frozen dataclasses: the scheduler sends lists of them to the caller's
event loop, which turns them into wire chunks (``ncap.engine.wire``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ncap.engine.tools import ParsedCall
from ncap.errors import NcapError

__all__ = [
    "ChoiceDelta",
    "ChoiceResult",
    "Completion",
    "Event",
    "RequestCancelled",
    "RequestDone",
    "RequestFailed",
    "RequestStarted",
    "TokenInfo",
    "TopToken",
]


@dataclass(frozen=True, slots=True)
class TopToken:
    token: str
    logprob: float
    bytes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """One sampled token with its log-probability and the most likely alternatives."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[TopToken, ...] = ()


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """New text for choice ``index`` (may be empty), its tokens' logprobs when asked for,
    and its finish reason on its last delta."""

    index: int
    text: str
    logprobs: tuple[TokenInfo, ...] | None = None
    finish_reason: str | None = None
    tool_calls: tuple[ParsedCall, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestDone:
    """Last event of a request: prompt counted once, tokens and mean logprob per choice."""

    prompt_tokens: int
    choice_tokens: tuple[int, ...]
    mean_logprobs: tuple[float, ...]
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache, not evaluated

    @property
    def completion_tokens(self) -> int:
        return sum(self.choice_tokens)


@dataclass(frozen=True, slots=True)
class RequestFailed:
    error: NcapError


@dataclass(frozen=True, slots=True)
class RequestStarted:
    """First event of an admitted request: it left the queue and holds its sequences
    (from here on its time is the engine's work, not waiting)."""


@dataclass(frozen=True, slots=True)
class RequestCancelled:
    """Last event of a request cancelled while it ran: its sequences are freed. What it
    had used by then: prompt tokens in the cache (``cached_tokens`` of them reused, not
    evaluated) and each choice's generated tokens."""

    prompt_tokens: int
    choice_tokens: tuple[int, ...]
    cached_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        return sum(self.choice_tokens)


Event = ChoiceDelta | RequestDone | RequestFailed | RequestStarted | RequestCancelled


@dataclass(slots=True)
class ChoiceResult:
    index: int
    text: str = ""
    finish_reason: str = "stop"
    logprobs: list[TokenInfo] | None = None
    tokens: int = 0
    mean_logprob: float = float("-inf")
    tool_calls: list[ParsedCall] = field(default_factory=list)


@dataclass(slots=True)
class Completion:
    """A finished request: every choice, and usage (prompt once, completions summed)."""

    choices: list[ChoiceResult]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
