"""How different the candidates of one request were, without keeping what they said.

``Candidates`` is fed each choice's content and tool-call deltas as they pass, per
choice ``index`` (a whole answer is one delta per choice). Each candidate's text is
normalized (runs of whitespace are one space, none at either end) and its tool calls
reduced to their names and their arguments without insignificant JSON whitespace,
both into hashes keyed with the caller's key (the gateway makes a random one when the
process starts, ``ncap.lifecycle.evidence``): nothing a reader of memory, logs or the
ledger could turn back into text, nor compare across processes. ``finish`` groups the
candidates' digests, drops them and returns only counts (``Evidence``).

Normalization is segment-safe: the same text cut into deltas anywhere hashes the same
as when it arrives whole, so a streamed and a non-streamed answer agree. That is why
JSON arguments are not re-ordered by key (a canonical sort needs each candidate's
arguments kept whole until they end) and why text is not Unicode-normalized (a
combining mark can arrive in the delta after its base character); a model writes a
tool's keys in its schema's order, and the same model writes the same code points.
Here, the only content-derived state held during the request is each hash's internal
block (at most 128 bytes of not yet compressed input, inside ``hashlib``); a stream's
feed (``ncap.lifecycle.evidence``) also keeps up to 64 KiB of the relayed events, in
memory only, until it reads them together.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass

__all__ = ["Candidates", "Evidence"]

_DIGEST = 16
_JSON_SPACE = frozenset(" \t\r\n")
_JSON_SPACES = re.compile(r"[ \t\r\n]+")


@dataclass(frozen=True, slots=True)
class Evidence:
    """What the candidates of one request showed: ``compared`` candidates, of which
    ``distinct`` differed, ``majority`` in the largest group of identical ones, and
    ``tool_calls`` that called a tool. Counts only."""

    compared: int
    distinct: int
    majority: int
    tool_calls: int

    @property
    def agreement(self) -> float:
        """The majority share: the largest group of identical candidates over all."""
        return self.majority / self.compared

    @property
    def distinct_share(self) -> float:
        return self.distinct / self.compared

    @property
    def tool_call_share(self) -> float:
        return self.tool_calls / self.compared


class _Arguments:
    """A tool call's arguments, hashed without the whitespace JSON ignores (outside
    strings), however the fragments were cut."""

    __slots__ = ("escaped", "hasher", "in_string")

    def __init__(self, key: bytes) -> None:
        self.hasher = hashlib.blake2b(key=key, digest_size=_DIGEST)
        self.in_string = False
        self.escaped = False

    def add(self, fragment: str) -> None:
        if '"' not in fragment and "\\" not in fragment:  # no string starts or ends here
            kept = fragment if self.in_string else _JSON_SPACES.sub("", fragment)
            self.hasher.update(kept.encode())
            self.escaped = self.escaped and not fragment  # an escape takes one character
            return
        out: list[str] = []
        for ch in fragment:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in _JSON_SPACE:
                continue
            out.append(ch)
        self.hasher.update("".join(out).encode())


class _Call:
    __slots__ = ("arguments", "name")

    def __init__(self, key: bytes) -> None:
        self.name = hashlib.blake2b(key=key, digest_size=_DIGEST)
        self.arguments = _Arguments(key)

    def digest(self) -> bytes:
        return self.name.digest() + self.arguments.hasher.digest()


class _Candidate:
    """One choice's running digest: its normalized text and its tool calls."""

    __slots__ = ("calls", "key", "pending_space", "started", "text")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.text = hashlib.blake2b(key=key, digest_size=_DIGEST)
        self.started = False  # any non-space written yet (leading space is dropped)
        self.pending_space = False  # whitespace seen after it (written only if more follows)
        self.calls: dict[int, _Call] = {}

    def add_text(self, delta: str) -> None:
        """``delta`` (not empty) with its whitespace runs as one space, one space kept
        between it and what came before when either side had some."""
        core = " ".join(delta.split())  # str.split's whitespace is re's \s: str.isspace
        if not core:  # all whitespace: a space, if more text follows
            self.pending_space = self.started
            return
        if self.started and (self.pending_space or delta[0].isspace()):
            self.text.update(b" ")
        self.text.update(core.encode())
        self.started = True
        self.pending_space = delta[-1].isspace()

    def call(self, call: int) -> _Call:
        found = self.calls.get(call)
        if found is None:
            found = self.calls[call] = _Call(self.key)
        return found

    def digest(self) -> bytes:
        whole = hashlib.blake2b(self.text.digest(), key=self.key, digest_size=_DIGEST)
        for call in sorted(self.calls):
            whole.update(self.calls[call].digest())
        return whole.digest()


class Candidates:
    """The running evidence of one request's candidates, keyed by choice ``index``.

    Feed ``seen`` for every choice that appears (a choice with no text is a candidate
    too), ``text`` for content deltas and ``tool_call`` for tool-call deltas; then
    ``finish`` once. Unknown fields are never stored: only hash states per candidate,
    and after ``finish`` nothing but the counts it returned."""

    __slots__ = ("_key", "_open")

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._open: dict[int, _Candidate] | None = {}

    def _candidate(self, index: int) -> _Candidate:
        if self._open is None:
            raise RuntimeError("the candidates were already compared")
        found = self._open.get(index)
        if found is None:
            found = self._open[index] = _Candidate(self._key)
        return found

    def seen(self, index: int) -> None:
        self._candidate(index)

    def text(self, index: int, delta: str) -> None:
        if delta:
            found = self._open.get(index) if self._open is not None else None
            (found or self._candidate(index)).add_text(delta)

    def tool_call(self, index: int, call: int, name: str | None, arguments: str | None) -> None:
        """A tool-call delta of choice ``index``: its position ``call`` in the choice's
        list, and the fragments of its name and arguments it carries (either may be
        None: names usually come whole in the first delta, arguments in pieces)."""
        found = self._candidate(index).call(call)
        if name:
            found.name.update(name.encode())
        if arguments:
            found.arguments.add(arguments)

    def finish(self) -> Evidence | None:
        """The counts, or None for fewer than two candidates (nothing to compare); the
        digests are dropped either way."""
        candidates, self._open = self._open, None
        if candidates is None:
            raise RuntimeError("the candidates were already compared")
        if len(candidates) < 2:
            return None
        groups = Counter(c.digest() for c in candidates.values())
        return Evidence(
            compared=len(candidates),
            distinct=len(groups),
            majority=max(groups.values()),
            tool_calls=sum(1 for c in candidates.values() if c.calls),
        )
