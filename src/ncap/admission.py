"""Gateway-wide admission control, checked before a body is even parsed.

Two cheap gates: an in-flight ceiling (past it, 503 ``server_is_overloaded``) and a
ramp limiter, a token bucket refilled at ``requests_per_second`` up to ``burst`` (a
request rate rising faster than that gets 429 ``slow_down``, as OpenAI's own API does).
"""

from __future__ import annotations

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
        self._rate = ramp.requests_per_second
        self._burst = float(ramp.burst)
        self._tokens = float(ramp.burst)
        self._clock = clock
        self._last = clock()

    def enter(self) -> None:
        """Admit one request or raise; every successful ``enter`` needs one ``leave``."""
        if self.in_flight >= self.max_in_flight:
            raise Overloaded(
                "The gateway is at capacity. Please retry your request after a brief delay.",
                retry_after=1,
            )
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens < 1.0:
            wait = (1.0 - self._tokens) / self._rate
            raise SlowDown(
                "Your request rate increased too quickly. Please reduce the request rate "
                "and gradually increase it again.",
                retry_after=max(wait, 0.001),
            )
        self._tokens -= 1.0
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
