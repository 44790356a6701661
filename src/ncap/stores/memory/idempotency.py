"""One process's ``Idempotency-Key`` records, bounded (beside in-process budgets)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

DEFAULT_MAX_KEYS = 100_000


class MemoryIdempotency:
    """One process's records, at most ``max_keys`` (the oldest go first: with one TTL,
    insertion order is expiry order)."""

    def __init__(
        self, *, max_keys: int = DEFAULT_MAX_KEYS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._max_keys = max_keys
        self._clock = clock

    def _live(self, key: str) -> bytes | None:
        found = self._records.get(key)
        if found is None:
            return None
        if found[0] <= self._clock():
            del self._records[key]
            return None
        return found[1]

    def _put(self, key: str, record: bytes, ttl_s: float) -> None:
        self._records.pop(key, None)
        self._records[key] = (self._clock() + ttl_s, record)
        while len(self._records) > self._max_keys:
            self._records.popitem(last=False)

    async def claim(self, key: str, record: bytes, ttl_s: float) -> bytes | None:
        current = self._live(key)
        if current is None:
            self._put(key, record, ttl_s)
        return current

    async def get(self, key: str) -> bytes | None:
        return self._live(key)

    async def swap(self, key: str, expected: bytes, record: bytes | None, ttl_s: float) -> bool:
        if self._live(key) != expected:
            return False
        if record is None:
            del self._records[key]
        else:
            self._put(key, record, ttl_s)
        return True
