"""Per-choice detokenization: UTF-8-safe, with stop strings never emitted.

A UTF-8 character can span two tokens, and a stop string can span several, so each
choice keeps its own incremental decoder and holds back the tail of its text that could
still turn out to be the start of a stop string.
"""

from __future__ import annotations

import codecs

__all__ = ["ChoiceText"]


class ChoiceText:
    """Turns one choice's token bytes into text that is safe to emit."""

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, data: bytes) -> tuple[str, bool]:
        """Add one token's bytes; returns (text now safe to emit, a stop string was hit).

        After a stop the choice is over: the stop string and anything after it are dropped.
        """
        self._held += self._decoder.decode(data)
        return self._release()

    def finish(self) -> str:
        """The rest of the text when the choice ends without a stop string."""
        self._held += self._decoder.decode(b"", final=True)
        text, stopped = self._release()
        if stopped:
            return text
        rest, self._held = self._held, ""
        return text + rest

    def _release(self) -> tuple[str, bool]:
        held = self._held
        hits = [i for i in (held.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return held[: min(hits)], True
        keep = self._prefix_tail(held)
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep], False

    def _prefix_tail(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        longest = max((len(s) for s in self._stops), default=1)
        for k in range(min(len(text), longest - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
