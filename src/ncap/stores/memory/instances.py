"""The instance registry of a ``memory://`` ledger: nobody else can share it."""

from __future__ import annotations

import time

from ncap.stores.ports import (
    Identity,
    InstanceInfo,
)


class MemoryInstanceRegistry:
    """In-process: nobody else can share a ``memory://`` ledger."""

    def __init__(self) -> None:
        self._beats: dict[str, tuple[Identity, float, float]] = {}

    async def beat(self, me: Identity, timeout_s: float) -> None:
        self._beats[me.instance] = (me, time.monotonic(), timeout_s)

    async def instances(self) -> list[InstanceInfo]:
        now = time.monotonic()
        return [InstanceInfo(i, now - at, t) for i, at, t in self._beats.values()]

    async def forget(self, instance: str) -> None:
        self._beats.pop(instance, None)
