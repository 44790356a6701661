"""Deterministic text for the fake upstream.

The same messages always produce the same choices, so tests can compare a streamed
answer (demultiplexed by ``index``) with the non-streamed one, and every choice
differs from the others. Tokens are words: ``content.split()`` counts them exactly.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec

__all__ = [
    "CandidatePattern",
    "ChoiceText",
    "ContentPart",
    "PromptMessage",
    "choice_text",
    "digest_messages",
    "digest_prompt",
    "labelled_choice",
    "parse_pattern",
    "prompt_strings",
]

_VOCAB = [
    "amber",
    "basil",
    "cedar",
    "delta",
    "ember",
    "fable",
    "garnet",
    "harbor",
    "iris",
    "juniper",
    "kestrel",
    "lantern",
    "meadow",
    "nectar",
    "orchid",
    "pebble",
    "quartz",
    "raven",
    "saffron",
    "thistle",
    "umber",
    "velvet",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
    "anchor",
    "breeze",
    "canyon",
    "dune",
    "estuary",
    "fjord",
    "glacier",
    "heather",
    "inlet",
    "jetty",
    "knoll",
    "lagoon",
    "marsh",
    "north",
    "ocean",
    "prairie",
    "quarry",
    "ridge",
    "summit",
    "tundra",
    "upland",
    "valley",
    "wharf",
    "yonder",
    "zenith",
    "acorn",
    "birch",
    "clover",
    "drift",
    "elm",
    "fern",
    "grove",
    "hazel",
    "ivy",
    "jasper",
    "kelp",
    "larch",
    "maple",
]
_PIECES = tuple(" " + word for word in _VOCAB)

FinishReason = Literal["stop", "length", "tool_calls"]


class ContentPart(msgspec.Struct):
    type: str = ""
    text: str | None = None


class PromptMessage(msgspec.Struct):
    """The part of a chat message the fake reads; other fields are ignored."""

    role: str = ""
    content: str | list[ContentPart] | None = None


class ChoiceText(msgspec.Struct, frozen=True):
    """One generated choice: its pieces (one token each) and why it stopped. A choice
    that calls ``tool`` has no text: its pieces are the call's JSON arguments."""

    pieces: list[str]
    finish_reason: FinishReason
    tool: str | None = None

    @property
    def content(self) -> str:
        return "".join(self.pieces)


def _text_of(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text or "" for part in content)


def digest_messages(messages: list[PromptMessage]) -> tuple[int, int]:
    """Return ``(seed, prompt_tokens)``: a stable hash of roles and texts, and
    total characters // 4 plus one token per message."""
    digest = hashlib.blake2b(digest_size=8)
    chars = 0
    for message in messages:
        text = _text_of(message.content)
        chars += len(text)
        digest.update(f"{message.role}\x00{text}\x01".encode())
    return int.from_bytes(digest.digest(), "little"), chars // 4 + len(messages)


def digest_prompt(prompt: str) -> tuple[int, int]:
    """Legacy completions: the same rule for one prompt string."""
    seed = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return int.from_bytes(seed, "little"), len(prompt) // 4 + 1


def _word_bytes(seed: int, index: int) -> bytes:
    return hashlib.blake2b(
        seed.to_bytes(8, "little") + index.to_bytes(4, "little"), digest_size=64
    ).digest()


def choice_text(seed: int, index: int, cap: int | None, forced: int | None = None) -> ChoiceText:
    """Choice ``index`` for ``seed``: "choice {index}: " then 6-16 words (or ``forced``
    tokens in all), cut to ``cap`` tokens with finish_reason "length"."""
    stream = _word_bytes(seed, index)
    total = forced if forced is not None else 8 + stream[0] % 11
    reason: FinishReason = "stop"
    if cap is not None and cap < total:
        total, reason = max(cap, 0), "length"
    while len(stream) < total:  # only for long forced lengths
        stream += _word_bytes(seed ^ len(stream), index)
    words = [_PIECES[byte & 63] for byte in stream[1 : max(total - 1, 1)]]
    return ChoiceText(["choice", f" {index}:", *words][:total], reason)


def prompt_strings(prompt: Any) -> list[str]:
    """Legacy ``prompt`` (a string, strings, token ids or lists of them) as strings."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [" ".join(map(str, prompt))]
    if isinstance(prompt, list) and prompt:
        return [p if isinstance(p, str) else " ".join(map(str, p)) for p in prompt]
    return [""]


def parse_pattern(spec: str | None) -> tuple[str, ...]:
    """``x-fake-candidates``: one label per candidate, comma-separated (``a,a,a,b,tool:f``).
    Candidates with the same label are identical; ``tool:NAME`` calls tool NAME with
    the same arguments each time; ValueError on an empty label."""
    if spec is None:
        return ()
    labels = tuple(label.strip() for label in spec.split(","))
    if not all(labels) or any(label == "tool:" for label in labels):
        raise ValueError(f"x-fake-candidates needs non-empty labels, got {spec!r}")
    return labels


def labelled_choice(label: str, cap: int | None, forced: int | None = None) -> ChoiceText:
    """The candidate a label stands for: the same label, the same candidate."""
    if label.startswith("tool:"):
        name = label[5:]
        arguments = ['{"query": ', f'"{name} now", ', '"limit": 3}']
        return ChoiceText(arguments, "tool_calls", tool=name)
    seed = int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "little")
    return choice_text(seed, 0, cap, forced)


class CandidatePattern:
    """Hands out a pattern's labels in turn, per pattern: a request for n candidates
    takes the next n, so the k single-candidate branches of an emulated fan-out get
    the pattern's k labels between them, as one native request of n = k does."""

    def __init__(self) -> None:
        self.next: dict[tuple[str, ...], int] = {}

    def take(self, labels: tuple[str, ...], count: int) -> tuple[str, ...]:
        start = self.next.get(labels, 0)
        self.next[labels] = start + count
        return tuple(labels[(start + i) % len(labels)] for i in range(count))
