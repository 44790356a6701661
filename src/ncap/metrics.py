"""Prometheus metrics, on a registry owned by the app (no module-level state).

Labels are bounded, operator-defined values only (policy result and reason, route id,
workload id, exception id, window name, a fixed set of outcome and failure codes):
nothing a client sent ends up in a label. Every family is described for operators in
``docs/operations.md``.

Gauges that describe the stores (pending reconciliation, budgets, reservations) are
*set* from a store snapshot (``ncap.http.observe.StoreGauges``) on start-up and on
scrape, not counted in-process, so they stay true after a restart and after another
process (``ncap reconcile import``) changed the ledger.

The counters, histograms and the gauges the request path moves keep plain floats
(``PlainCounter``, ``PlainHistogram``, ``PlainGauge``), rendered at scrape time as
prometheus_client's own classes would render them.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import prometheus_client.metrics as prometheus_metrics
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import INF, floatToGoString

__all__ = ["BUDGET_WINDOWS", "ROUTE_FAILURE_REASONS", "Metrics", "RouteMeters"]

_CANDIDATE_BUCKETS = (1, 2, 3, 4, 8, 16, 32, 64, 128)
# shares of the returned candidates (distinct ones, the largest identical group): 1/2,
# 1/3, 2/3, 1/4, 3/4, 1/5 … 4/5 fall on or between these
_SHARE_BUCKETS = (0.2, 0.25, 0.34, 0.4, 0.5, 0.6, 0.67, 0.75, 0.8, 0.9, 1.0)

# the ``window`` label of the budget gauges: tokens, requests, or micro-USD per window
BUDGET_WINDOWS = (
    "tokens_minute",
    "requests_minute",
    "tokens_day",
    "usd_micros_day",
    "usd_micros_month",
    "concurrency",
)
# the ``reason`` label of ``ncap_route_last_failure``: a closed set, never upstream text
ROUTE_FAILURE_REASONS = ("timeout", "connection", "status_429", "status_5xx", "protocol")


# -- families whose values are plain numbers --------------------------------------------
#
# ``prometheus_client``'s Counter, Histogram and Gauge guard every value with a lock and
# pay a few Python calls per update (a Counter.inc ~4.6 k instructions, a
# Histogram.observe ~8.9 k, about ten updates per request). Every update here runs on
# the event loop's thread, so the families below keep plain floats, updated in one
# attribute add, and build the same families, samples, labels and ``_created``
# timestamps as prometheus_client's classes when ``/metrics`` is scraped (a test
# renders both, update for update, and compares the text).


def _use_created() -> bool:
    """Whether prometheus_client exports ``_created`` samples (its switch, read at scrape)."""
    return bool(getattr(prometheus_metrics, "_use_created", True))


class CounterValue:
    """One label set's count."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class HistogramValue:
    """One label set's bucket counts and sum."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        i = bisect_left(self.bounds, amount)  # the first bound >= amount (the last is +Inf)
        if amount <= self.bounds[i]:  # False only for NaN, which no bucket counts
            self.counts[i] += 1


class GaugeValue:
    """One label set's value."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value += -amount

    def set(self, value: float) -> None:
        self.value = float(value)


class _Family(ABC):
    """A collector of one family: its label sets' values, in first-use order; a
    subclass says what one label set's value is (``_new``) and how it is sampled
    (``_add``)."""

    kind = ""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._values: dict[tuple[str, ...], Any] = {}
        if not self.labelnames:
            self._values[()] = self._new()
        registry.register(self)

    @abstractmethod
    def _new(self) -> Any: ...

    def labels(self, *values: object) -> Any:
        if not self.labelnames:
            raise ValueError(f"No label names were set when constructing {self.name}")
        if len(values) != len(self.labelnames):
            raise ValueError("Incorrect label count")
        key = tuple(str(v) for v in values)
        found = self._values.get(key)
        if found is None:
            found = self._values[key] = self._new()
        return found

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]

    def collect(self) -> list[Metric]:
        metric = Metric(self.name, self.documentation, self.kind)
        created = _use_created()
        for key, value in list(self._values.items()):
            self._add(metric, dict(zip(self.labelnames, key, strict=True)), value, created)
        return [metric]

    @abstractmethod
    def _add(self, metric: Metric, labels: dict[str, str], value: Any, created: bool) -> None: ...


class PlainCounter(_Family):
    """``prometheus_client.Counter``'s family and samples, from plain floats."""

    kind = "counter"

    def _new(self) -> CounterValue:
        return CounterValue()

    def inc(self, amount: float = 1) -> None:
        self._values[()].inc(amount)

    def _add(self, metric: Metric, labels: dict[str, str], value: Any, created: bool) -> None:
        metric.add_sample(self.name + "_total", labels, value.value)
        if created:
            metric.add_sample(self.name + "_created", labels, value.created)


class PlainHistogram(_Family):
    """``prometheus_client.Histogram``'s family and samples, from plain floats."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        registry: CollectorRegistry,
        buckets: Iterable[float] = Histogram.DEFAULT_BUCKETS,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if bounds and bounds[-1] != INF:
            bounds.append(INF)
        if len(bounds) < 2:
            raise ValueError("Must have at least two buckets")
        self.bounds = bounds
        self._le: list[str] = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry=registry)

    def _new(self) -> HistogramValue:
        return HistogramValue(self.bounds)

    def observe(self, amount: float) -> None:
        self._values[()].observe(amount)

    def _add(self, metric: Metric, labels: dict[str, str], value: Any, created: bool) -> None:
        acc = 0.0
        for le, count in zip(self._le, value.counts, strict=True):
            acc += count
            metric.add_sample(self.name + "_bucket", {**labels, "le": le}, acc)
        metric.add_sample(self.name + "_count", labels, acc)
        if self.bounds[0] >= 0:
            metric.add_sample(self.name + "_sum", labels, value.sum)
        if created:
            metric.add_sample(self.name + "_created", labels, value.created)


class PlainGauge(_Family):
    """``prometheus_client.Gauge``'s family and samples (``inc``, ``dec``, ``set``),
    from plain floats."""

    kind = "gauge"

    def _new(self) -> GaugeValue:
        return GaugeValue()

    def inc(self, amount: float = 1) -> None:
        self._values[()].inc(amount)

    def dec(self, amount: float = 1) -> None:
        self._values[()].dec(amount)

    def set(self, value: float) -> None:
        self._values[()].set(value)

    def _add(self, metric: Metric, labels: dict[str, str], value: Any, created: bool) -> None:
        metric.add_sample(self.name, labels, value.value)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._routes: dict[str, RouteMeters] = {}
        r = self.registry
        self.requests = PlainCounter(
            "ncap_requests",
            "Requests by policy result and reason",
            ["workload", "policy_result", "reason"],
            registry=r,
        )
        self.candidates_requested = PlainHistogram(
            "ncap_candidates_requested",
            "Requested candidate count (n; omitted counts as 1)",
            ["workload"],
            buckets=_CANDIDATE_BUCKETS,
            registry=r,
        )
        self._candidate_families(r)
        self.tokens = PlainCounter(
            "ncap_tokens", "Provider-reported tokens", ["route", "direction"], registry=r
        )
        self.attempts = PlainCounter(
            "ncap_upstream_attempts",
            "Upstream attempts by outcome",
            ["route", "outcome"],
            registry=r,
        )
        self.upstream_latency = PlainHistogram(
            "ncap_upstream_latency_seconds", "Upstream attempt latency", ["route"], registry=r
        )
        self.reservations_outstanding = PlainGauge(
            "ncap_reservations_outstanding",
            "Reservations held (in flight or pending)",
            registry=r,
        )
        self._reconciliation_families(r)
        self.alert_webhook_failures = PlainCounter(
            "ncap_budget_alert_webhook_failures",
            "Budget alerts whose webhook delivery was given up (after every retry)",
            ["window"],
            registry=r,
        )
        self.bookkeeping_failures = PlainCounter(
            "ncap_bookkeeping_failures",
            "Ledger/budget updates that failed after the answer was sent",
            registry=r,
        )
        self.engine_queue_depth = Gauge(
            "ncap_engine_queue_depth", "Requests waiting in the local engine's queue", registry=r
        )
        self._budget_families(r)
        self._route_families(r)
        self.validation_refusals = PlainCounter(
            "ncap_validation_refusals",
            "Requests refused by body validation, by error code (multi_candidate: a field "
            "that could request several choices, e.g. best_of)",
            ["code", "multi_candidate"],
            registry=r,
        )
        self.cost_micros = PlainCounter(
            "ncap_cost_micros",
            "Settled cost in micro-USD, as recorded in the ledger by this process",
            ["workload", "route"],
            registry=r,
        )

    def _candidate_families(self, r: CollectorRegistry) -> None:
        """How the candidates of one request relate (counts only, per workload)."""
        self.candidates_distinct_share = PlainHistogram(
            "ncap_candidates_distinct_share",
            "Distinct candidates over those returned, per request returning two or more",
            ["workload"],
            buckets=_SHARE_BUCKETS,
            registry=r,
        )
        self.candidates_agreement = PlainHistogram(
            "ncap_candidates_agreement",
            "The largest group of identical candidates over those returned (majority share)",
            ["workload"],
            buckets=_SHARE_BUCKETS,
            registry=r,
        )
        self.candidates_tool_call_share = PlainHistogram(
            "ncap_candidates_tool_call_share",
            "Candidates that called a tool over those returned",
            ["workload"],
            buckets=(0.0, *_SHARE_BUCKETS),
            registry=r,
        )

    def _reconciliation_families(self, r: CollectorRegistry) -> None:
        """Ledger rows awaiting reconciliation: how many, where, how old."""
        self.pending_reconciliation = PlainGauge(
            "ncap_pending_reconciliation", "Ledger events awaiting reconciliation", registry=r
        )
        self.pending_by_route = Gauge(
            "ncap_pending_reconciliation_by_route",
            "Ledger events awaiting reconciliation, by workload and route",
            ["workload", "route"],
            registry=r,
        )
        self.pending_oldest_age = Gauge(
            "ncap_pending_reconciliation_oldest_age_seconds",
            "Age of the oldest ledger event awaiting reconciliation (0: none)",
            ["workload", "route"],
            registry=r,
        )

    def _budget_families(self, r: CollectorRegistry) -> None:
        labels = ["workload", "window"]
        self.budget_spent = Gauge(
            "ncap_budget_spent", "Settled usage in the current window", labels, registry=r
        )
        self.budget_reserved = Gauge(
            "ncap_budget_reserved",
            "Held by unsettled reservations in the window",
            labels,
            registry=r,
        )
        self.budget_limit = Gauge(
            "ncap_budget_limit", "The configured limit (absent: unlimited)", labels, registry=r
        )
        ex = ["exception", "workload"]
        self.exception_spent = Gauge(
            "ncap_exception_budget_spent_micros",
            "Settled spend through an exception",
            ex,
            registry=r,
        )
        self.exception_reserved = Gauge(
            "ncap_exception_budget_reserved_micros", "Held through an exception", ex, registry=r
        )
        self.exception_limit = Gauge(
            "ncap_exception_budget_limit_micros", "An exception's budget_usd", ex, registry=r
        )
        self.exception_active = Gauge(
            "ncap_exception_active", "1 while an exception has not expired", ex, registry=r
        )
        self.denials_by_window = PlainCounter(
            "ncap_budget_exhausted",
            "budget_exhausted refusals by the window that refused",
            ["workload", "window"],
            registry=r,
        )

    def _route_families(self, r: CollectorRegistry) -> None:
        self.route_up = PlainGauge(
            "ncap_route_up",
            "1 when the route's last attempt got an answer (any status below 500 except "
            "429), 0 when it failed; absent until the route is used",
            ["route"],
            registry=r,
        )
        self.route_last_failure = Gauge(
            "ncap_route_last_failure_timestamp_seconds",
            "When the route last failed, by the reason of that failure",
            ["route", "reason"],
            registry=r,
        )
        self.route_failures = PlainCounter(
            "ncap_route_failures",
            "Failed upstream attempts by reason",
            ["route", "reason"],
            registry=r,
        )

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: label sets come from config, so few."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def route_meters(self, route: str) -> RouteMeters:
        """The metrics every closed attempt of ``route`` updates, looked up once."""
        meters = self._routes.get(route)
        if meters is None:
            meters = self._routes[route] = RouteMeters(self, route)
        return meters

    def route_answered(self, route: str) -> None:
        """The route answered (a 2xx, or a refusal that shows it is alive)."""
        self.child(self.route_up, route).set(1)

    def route_failed(self, route: str, reason: str, at: float) -> None:
        """One failed attempt of the route, by a reason from a closed set."""
        if reason not in ROUTE_FAILURE_REASONS:
            reason = "protocol"
        self.child(self.route_up, route).set(0)
        self.child(self.route_failures, route, reason).inc()
        self.child(self.route_last_failure, route, reason).set(at)

    def validation_refused(self, code: str, multi_candidate: bool) -> None:
        """A body validation refusal (400 before policy), by its OpenAI error code."""
        self.child(self.validation_refusals, code, "true" if multi_candidate else "false").inc()

    def budget_exhausted(self, workload: str, window: str) -> None:
        """A ``budget_exhausted`` refusal, by the window that refused (``BUDGET_WINDOWS``
        or ``exception``; ``unknown`` when the budget store did not say)."""
        self.child(self.denials_by_window, workload, window).inc()

    def candidates(
        self, workload: str, compared: int, distinct: int, majority: int, tools: int
    ) -> None:
        """One request's candidate evidence (counts only)."""
        self.child(self.candidates_distinct_share, workload).observe(distinct / compared)
        self.child(self.candidates_agreement, workload).observe(majority / compared)
        self.child(self.candidates_tool_call_share, workload).observe(tools / compared)

    def watch_engine_queue(self, depth: Callable[[], float]) -> None:
        self.engine_queue_depth.set_function(depth)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RouteMeters:
    """One route's attempt metrics: attempts by outcome, upstream latency, tokens in and
    out, settled cost by workload. Each child is looked up once (through
    ``Metrics.child``, on first use, so a label set appears on ``/metrics`` exactly when
    it would otherwise) and then kept."""

    __slots__ = (
        "_attempts",
        "_cost",
        "_latency",
        "_metrics",
        "_route",
        "_tokens_in",
        "_tokens_out",
    )

    def __init__(self, metrics: Metrics, route: str) -> None:
        self._metrics = metrics
        self._route = route
        self._attempts: dict[str, Any] = {}
        self._cost: dict[str, Any] = {}  # workload -> its cost child on this route
        self._latency: Any = None
        self._tokens_in: Any = None
        self._tokens_out: Any = None

    def closed(
        self, outcome: str, seconds: float, input_tokens: int | None, output_tokens: int | None
    ) -> None:
        """One attempt closed with ``outcome`` after ``seconds`` (tokens when known)."""
        m = self._metrics
        attempts = self._attempts.get(outcome)
        if attempts is None:
            attempts = self._attempts[outcome] = m.child(m.attempts, self._route, outcome)
        attempts.inc()
        if self._latency is None:
            self._latency = m.child(m.upstream_latency, self._route)
        self._latency.observe(seconds)
        if input_tokens:
            if self._tokens_in is None:
                self._tokens_in = m.child(m.tokens, self._route, "in")
            self._tokens_in.inc(input_tokens)
        if output_tokens:
            if self._tokens_out is None:
                self._tokens_out = m.child(m.tokens, self._route, "out")
            self._tokens_out.inc(output_tokens)

    def spent(self, workload: str, cost_micros: int) -> None:
        """A closed attempt's settled cost (micro-USD, more than 0) for ``workload``."""
        cost = self._cost.get(workload)
        if cost is None:
            m = self._metrics
            cost = self._cost[workload] = m.child(m.cost_micros, workload, self._route)
        cost.inc(cost_micros)
