"""A remote route's health, moved by its attempts where they are dispatched.

``Attempts`` tells a route's ``RouteHealth`` what each attempt's upstream did: it
answered (a whole answer, or a stream that opened), or it failed with an
``AttemptFailed`` (on the way in, or a stream that failed mid-way). The gauge
``ncap_route_up`` follows the last outcome; each failure counts by a reason from a
closed set. A 4xx other than 429 is an answer about the request, not about the
route: the route answered. In-process routes (the local engine) have no health of
this kind: their queue depth is their gauge.

The counting is done here rather than by a wrapper around the provider, which would
put a coroutine more on the stack of every request while it waits for the upstream.
The failure itself is logged once, by the settlement (``ncap.lifecycle.settle``),
which knows the request and workload; this only logs the route's recovery.
"""

from __future__ import annotations

import logging
import time

from ncap.metrics import Metrics
from ncap.providers.base import AttemptFailed

__all__ = ["RouteHealth", "failure_reason"]

log = logging.getLogger("ncap.health")


def failure_reason(failure: AttemptFailed) -> str | None:
    """The route-health reason of a failed attempt, or None when the route answered
    (a 4xx other than 429 is an answer about the request, not about the route)."""
    if failure.kind != "status":
        return failure.kind  # timeout | connection | protocol
    status = failure.status or 0
    if status == 429:
        return "status_429"
    if status >= 500:
        return "status_5xx"
    return None


class RouteHealth:
    """One remote route's health: ``up`` is None until its first attempt ended, then
    whether the last one answered. The common case, an answer while up, is read off
    ``up`` by the caller without a call (``Attempts``)."""

    __slots__ = ("_metrics", "route", "up")

    def __init__(self, metrics: Metrics, route: str) -> None:
        self._metrics = metrics
        self.route = route
        self.up: bool | None = None

    def answered(self) -> None:
        """The upstream answered (a 2xx, or a refusal that shows it is alive)."""
        if self.up is True:
            return  # the gauge already says 1
        if self.up is False:
            log.warning("route %s answers again", self.route)
        self.up = True
        self._metrics.route_answered(self.route)

    def failed(self, exc: BaseException) -> None:
        """An attempt ended in ``exc``: the upstream's failure (``AttemptFailed``) counts;
        anything else (the gateway's own error, a cancellation) says nothing of it."""
        if not isinstance(exc, AttemptFailed):
            return
        reason = failure_reason(exc)
        if reason is None:
            self.answered()
            return
        self.up = False
        self._metrics.route_failed(self.route, reason, time.time())
