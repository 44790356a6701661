"""Cross-request prefix cache: the KV cells of recent prompts, kept under a token budget.

Applications send the same long system prompt on every call, and fan-out emulation sends
one prompt k times. When a request's prompt has been evaluated, its cells are tagged with
one of the cache's own sequence ids (``llama_memory_seq_cp`` on the unified KV cache adds
the id to the cells; nothing is copied). A later request whose prompt starts with the same
tokens tags those cells with its own sequence ids and prefills only the rest.

The budget counts every entry's tokens (entries may share cells, so it overstates what is
held); the least recently used entry goes first, and the scheduler evicts before it
refuses a request for lack of KV cells. Owned by the scheduler thread, like the context.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CacheHit", "PrefixCache", "common_prefix"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True, slots=True)
class CacheHit:
    seq_id: int
    length: int


class PrefixCache:
    """Entries keyed by their cache sequence id, oldest first (LRU order)."""

    def __init__(self, lib: Any, mem: Any, seq_ids: Iterable[int], budget: int) -> None:
        self._lib = lib
        self._mem = mem
        self.budget = budget
        self._free: deque[int] = deque(seq_ids)
        self._entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.tokens = 0

    @property
    def enabled(self) -> bool:
        return self.budget > 0 and bool(self._free or self._entries)

    @property
    def entries(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: Sequence[int], limit: int) -> CacheHit | None:
        """The entry sharing the longest prefix with ``tokens`` (at most ``limit``)."""
        best: CacheHit | None = None
        for seq_id, cached in self._entries.items():
            length = min(common_prefix(cached, tokens), limit)
            if length > 0 and (best is None or length > best.length):
                best = CacheHit(seq_id, length)
        if best is not None:
            self._entries.move_to_end(best.seq_id)
        return best

    def copy_into(self, hit: CacheHit, seq_ids: Iterable[int]) -> None:
        """Tag the hit's first ``length`` cells with every one of ``seq_ids``."""
        for sid in seq_ids:
            self._lib.llama_memory_seq_cp(self._mem, hit.seq_id, sid, 0, hit.length)

    def store(self, src_seq: int, tokens: tuple[int, ...]) -> None:
        """Keep the cells of ``tokens`` (positions 0..len-1 of ``src_seq``) as an entry."""
        if not 0 < len(tokens) <= self.budget:
            return
        for seq_id, cached in list(self._entries.items()):
            if cached[: len(tokens)] == tokens:  # already held (as this or a longer prompt)
                self._entries.move_to_end(seq_id)
                return
            if tokens[: len(cached)] == cached:  # the new prompt extends an entry
                self._remove(seq_id)
        while self._entries and (self.tokens + len(tokens) > self.budget or not self._free):
            self._remove(next(iter(self._entries)))
        if not self._free:
            return
        seq_id = self._free.popleft()
        self._lib.llama_memory_seq_cp(self._mem, src_seq, seq_id, 0, len(tokens))
        self._entries[seq_id] = tokens
        self.tokens += len(tokens)

    def evict_oldest(self) -> bool:
        """Drop the least recently used entry; False when there was none."""
        if not self._entries:
            return False
        self._remove(next(iter(self._entries)))
        return True

    def forget(self) -> None:
        """Drop every entry without touching the KV memory (it was cleared)."""
        self._free.extend(self._entries)
        self._entries.clear()
        self.tokens = 0

    def _remove(self, seq_id: int) -> None:
        tokens = self._entries.pop(seq_id)
        self.tokens -= len(tokens)
        self._lib.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
        self._free.append(seq_id)
