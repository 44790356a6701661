"""Gateway-wide admission control, checked before a body is even read.

Two cheap gates:

- an in-flight ceiling: past ``max_in_flight``, 503 ``server_is_overloaded``;
- a ramp limiter: the number of requests admitted in one second may exceed the
  previous second's by at most ``ramp.requests_per_second``, with ``ramp.burst`` as
  the allowance from idle. Steady traffic of any size passes; traffic that *grows*
  faster than the ramp gets 429 ``slow_down``, as OpenAI's own API answers
  ("Your request rate increased too quickly"). It is a ramp, not a rate cap: capping
  the rate is the budget windows' job (``requests_per_minute``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from ncap.config import Ramp
from ncap.errors import Overloaded, SlowDown

__all__ = ["Admission"]


class Admission:
    def __init__(
        self,
        max_in_flight: int,
        ramp: Ramp,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self._growth = ramp.requests_per_second
        self._burst = ramp.burst
        self._clock = clock
        self._second = math.floor(clock())
        self._current = 0
        self._previous = 0

    def enter(self) -> None:
        """Admit one request or raise; every successful ``enter`` needs one ``leave``."""
        if self.in_flight >= self.max_in_flight:
            raise Overloaded(
                "The gateway is at capacity. Please retry your request after a brief delay.",
                retry_after=1,
            )
        now = self._clock()
        self._roll(math.floor(now))
        if self._current >= max(self._burst, self._previous + self._growth):
            raise SlowDown(
                "Your request rate increased too quickly. Please reduce the request rate "
                "and gradually increase it again.",
                retry_after=max(self._second + 1 - now, 0.001),
            )
        self._current += 1
        self.in_flight += 1

    def _roll(self, second: int) -> None:
        if second == self._second:
            return
        self._previous = self._current if second == self._second + 1 else 0
        self._current = 0
        self._second = second

    def leave(self) -> None:
        self.in_flight -= 1
