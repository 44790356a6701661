"""Self-consistency voting and tool-call agreement over the n choices of one request.

The n completions are independent draws, so how many of them agree is a confidence
signal (seed ``000``): a majority answer with its agreement ratio, and the share of
choices that decided to call each tool. Choices may be SDK ``Choice`` objects,
``ChoiceBuffer`` from ``demux``, or dicts in the ``chat.completion`` shape.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from ncap.client._access import field_of
from ncap.client._demux import ChoiceBuffer

__all__ = ["Vote", "answer_text", "tool_call_agreement", "vote"]


@dataclass(frozen=True, slots=True)
class Vote:
    """The majority answer, its votes, the choices counted, and ``count / total``."""

    winner: Any
    count: int
    total: int
    agreement: float
    indices: tuple[int, ...] = ()  # the ``index`` of every choice that voted for it


def answer_text(choice: Any) -> str | None:
    """The default vote key: the message content, stripped; None when there is none."""
    if isinstance(choice, ChoiceBuffer):
        content = choice.content
    else:
        message = field_of(choice, "message")
        content = field_of(message, "content") if message is not None else field_of(choice, "text")
    if not isinstance(content, str):
        return None
    return content.strip() or None


def vote(choices: Iterable[Any], key: Callable[[Any], Hashable | None] = answer_text) -> Vote:
    """Majority over ``key(choice)``; a choice whose key is None abstains but still
    counts in ``total``. Ties go to the answer first given by the lowest ``index``."""
    ordered = _by_index(choices)
    ballots: dict[Hashable, list[int]] = {}
    for index, choice in ordered:
        answer = key(choice)
        if answer is not None:
            ballots.setdefault(answer, []).append(index)
    total = len(ordered)
    if not ballots:
        return Vote(None, 0, total, 0.0)
    winner, indices = max(ballots.items(), key=lambda item: (len(item[1]), -item[1][0]))
    return Vote(winner, len(indices), total, len(indices) / total, tuple(indices))


def tool_call_agreement(choices: Iterable[Any]) -> dict[str | None, float]:
    """The share of choices calling each tool name (a choice counts once per name),
    most called first, and under ``None`` the share that answered without a tool call."""
    calls = [_tool_names(choice) for choice in choices]
    if not calls:
        return {}
    counts: dict[str, int] = {}
    for names in calls:
        for name in set(filter(None, names)):
            counts[name] = counts.get(name, 0) + 1
    total = len(calls)
    shares: dict[str | None, float] = {
        name: counts[name] / total for name in sorted(counts, key=lambda n: (-counts[n], n))
    }
    shares[None] = sum(1 for names in calls if not names) / total
    return shares


def _by_index(choices: Iterable[Any]) -> list[tuple[int, Any]]:
    """(index, choice) sorted by the choice's own ``index``, else its position."""
    indexed = []
    for position, choice in enumerate(choices):
        index = field_of(choice, "index")
        indexed.append((index if isinstance(index, int) else position, choice))
    return sorted(indexed, key=lambda pair: pair[0])


def _tool_names(choice: Any) -> list[str | None]:
    """One entry per tool call the choice made (None for a call without a name)."""
    if isinstance(choice, ChoiceBuffer):
        calls = [call.name for call in choice.ordered_tool_calls()]
        return calls + ([choice.function_call.name] if choice.function_call else [])
    message = field_of(choice, "message")
    names = [_call_name(call) for call in field_of(message, "tool_calls") or ()]
    function_call = field_of(message, "function_call")
    return names + ([field_of(function_call, "name")] if function_call is not None else [])


def _call_name(call: Any) -> str | None:
    """Function tools name themselves under ``function``, custom tools under ``custom``."""
    spec = field_of(call, "function") or field_of(call, "custom")
    name = field_of(spec, "name")
    return name if isinstance(name, str) else None
