"""Prometheus metrics, on a registry owned by the app (no module-level state).

Labels are bounded, operator-defined values only (policy result and reason, route id,
workload id): nothing a client sent ends up in a label.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["Metrics"]

_CANDIDATE_BUCKETS = (1, 2, 3, 4, 8, 16, 32, 64, 128)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.requests = Counter(
            "ncap_requests",
            "Requests by policy result and reason",
            ["workload", "policy_result", "reason"],
            registry=r,
        )
        self.candidates_requested = Histogram(
            "ncap_candidates_requested",
            "Requested candidate count (n; omitted counts as 1)",
            ["workload"],
            buckets=_CANDIDATE_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "ncap_tokens", "Provider-reported tokens", ["route", "direction"], registry=r
        )
        self.attempts = Counter(
            "ncap_upstream_attempts",
            "Upstream attempts by outcome",
            ["route", "outcome"],
            registry=r,
        )
        self.upstream_latency = Histogram(
            "ncap_upstream_latency_seconds", "Upstream attempt latency", ["route"], registry=r
        )
        self.reservations_outstanding = Gauge(
            "ncap_reservations_outstanding",
            "Reservations held (in flight or pending)",
            registry=r,
        )
        self.pending_reconciliation = Gauge(
            "ncap_pending_reconciliation", "Ledger events awaiting reconciliation", registry=r
        )
        self.bookkeeping_failures = Counter(
            "ncap_bookkeeping_failures",
            "Ledger/budget updates that failed after the answer was sent",
            registry=r,
        )
        self.engine_queue_depth = Gauge(
            "ncap_engine_queue_depth", "Requests waiting in the local engine's queue", registry=r
        )

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: label sets come from config, so few."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def watch_engine_queue(self, depth: Callable[[], float]) -> None:
        self.engine_queue_depth.set_function(depth)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
