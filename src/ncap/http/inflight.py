"""The gateway-wide in-flight limit and ramp, checked before a body is even read
(per-request policy admission is another thing: ``ncap.lifecycle.admit``).

Two cheap gates:

- an in-flight ceiling: past ``max_in_flight``, 503 ``server_is_overloaded``;
- a ramp limiter: the number of requests admitted in one second may exceed the
  busiest of the previous ``PEAK_WINDOW_S`` seconds by at most
  ``ramp.requests_per_second``, with ``ramp.burst`` as the allowance from idle.
  Steady traffic of any size passes; traffic that *grows* faster than the ramp
  gets 429 ``slow_down``, as OpenAI's own API answers ("Your request rate
  increased too quickly"). It is a ramp, not a rate cap: capping the rate is the
  budget windows' job (``requests_per_minute``). The reference is the recent
  peak, not the last second alone: steady traffic whose rate wobbles from one
  second to the next (a GC pause, a slow upstream second) is not growth and must
  not be slowed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from ncap.config import Ramp
from ncap.errors import Overloaded, SlowDown

__all__ = ["PEAK_WINDOW_S", "InFlightLimit"]

PEAK_WINDOW_S = 10  # seconds of history the ramp compares a second against


class InFlightLimit:
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
        self._peak = 0  # the busiest second of the recent window
        self._recent: deque[tuple[int, int]] = deque()  # (second, admitted), closed ones

    def enter(self) -> None:
        """Admit one request or raise; every successful ``enter`` needs one ``leave``."""
        if self.in_flight >= self.max_in_flight:
            raise Overloaded(
                "The gateway is at capacity. Please retry your request after a brief delay.",
                retry_after=1,
            )
        now = self._clock()
        self._roll(math.floor(now))
        if self._current >= max(self._burst, self._peak + self._growth):
            raise SlowDown(
                "Your request rate increased too quickly. Please reduce the request rate "
                "and gradually increase it again.",
                retry_after=max(self._second + 1 - now, 0.001),
            )
        self._current += 1
        self.in_flight += 1

    def _roll(self, second: int) -> None:
        """Close the current second (once per second, so the peak is not recomputed
        per request) and forget the seconds older than the window."""
        if second == self._second:
            return
        if self._current:
            self._recent.append((self._second, self._current))
        while self._recent and self._recent[0][0] < second - PEAK_WINDOW_S:
            self._recent.popleft()
        self._peak = max((count for _, count in self._recent), default=0)
        self._current = 0
        self._second = second

    def leave(self) -> None:
        self.in_flight -= 1
