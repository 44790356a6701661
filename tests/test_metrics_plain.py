"""The plain-number metric families render exactly what prometheus_client's Counter,
Histogram and Gauge render for the same updates: families in the same order, the same
HELP and TYPE lines, labels, bucket bounds, values and ``_created`` samples."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import prometheus_client.metrics as prometheus_metrics
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ncap.metrics import Metrics, PlainCounter, PlainGauge, PlainHistogram

NOW = 1_764_000_000.125


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Both sides stamp ``_created`` with ``time.time()``: one instant for both."""
    monkeypatch.setattr("time.time", lambda: NOW)
    yield
    prometheus_metrics.enable_created_metrics()


def twins(metrics: Metrics) -> tuple[CollectorRegistry, dict[int, Any]]:
    """A registry of prometheus_client's own classes in the same order, each plain
    family's twin declared alike; the other collectors are shared."""
    reference = CollectorRegistry()
    twin: dict[int, Any] = {}
    for collector in list(metrics.registry._collector_to_names):  # registration order
        args = (
            (collector.name, collector.documentation, collector.labelnames)
            if isinstance(collector, PlainCounter | PlainHistogram | PlainGauge)
            else ()
        )
        if isinstance(collector, PlainCounter):
            twin[id(collector)] = Counter(*args, registry=reference)
        elif isinstance(collector, PlainHistogram):
            twin[id(collector)] = Histogram(*args, registry=reference, buckets=collector.bounds)
        elif isinstance(collector, PlainGauge):
            twin[id(collector)] = Gauge(*args, registry=reference)
        else:
            reference.register(collector)
    return reference, twin


def plain_families(metrics: Metrics) -> list[Any]:
    return [
        c
        for c in metrics.registry._collector_to_names
        if isinstance(c, PlainCounter | PlainHistogram | PlainGauge)
    ]


def drive(metrics: Metrics, twin: dict[int, Any], seed: int) -> int:
    """Random updates, each applied to a plain family and to its twin; the count."""
    rng = random.Random(seed)
    families = plain_families(metrics)
    amounts = [0, 1, 2, 3, 0.2, 0.25, 0.34, 0.9999, 1.0, 4, 128, 129, 1e9, 0.0049, 7.5, 11]
    done = 0
    for _ in range(3000):
        family = rng.choice(families)
        pair = [family, twin[id(family)]]
        if family.labelnames:
            values = [rng.choice(["a", "b", "fake", "route-2"]) for _ in family.labelnames]
            pair = [p.labels(*values) for p in pair]
        amount = rng.choice(amounts)
        if isinstance(family, PlainCounter):
            for p in pair:
                p.inc(amount)
        elif isinstance(family, PlainHistogram):
            value = amount if rng.random() < 0.8 else rng.uniform(-1, 200)
            for p in pair:
                p.observe(value)
        else:
            op = rng.choice(["inc", "dec", "set"])
            for p in pair:
                getattr(p, op)(amount)
        done += 1
    return done


@pytest.mark.parametrize("created", [True, False])
def test_metrics_render_as_prometheus_client_would(created: bool) -> None:
    if not created:
        prometheus_metrics.disable_created_metrics()
    metrics = Metrics()
    reference, twin = twins(metrics)
    assert generate_latest(metrics.registry) == generate_latest(reference)  # before use
    assert drive(metrics, twin, seed=3) == 3000
    text = generate_latest(metrics.registry)
    assert text == generate_latest(reference)
    assert b"ncap_requests_total{" in text and (b"_created" in text) is created
    assert b'ncap_upstream_latency_seconds_bucket{le="+Inf",route=' in text


def test_a_plain_histogram_counts_each_value_in_its_first_bucket() -> None:
    registry = CollectorRegistry()
    h = PlainHistogram("h", "doc", ["w"], registry=registry, buckets=(1, 2, 4))
    for v in (0.5, 1, 1.5, 2, 3, 4, 5, float("nan")):
        h.labels("x").observe(v)
    sample = registry.get_sample_value
    counts = [sample("h_bucket", {"w": "x", "le": le}) for le in ("1.0", "2.0", "4.0", "+Inf")]
    assert counts == [2, 4, 6, 7]  # cumulative; NaN is in no bucket, as prometheus_client
    assert sample("h_count", {"w": "x"}) == 7


def test_plain_families_refuse_what_prometheus_client_refuses() -> None:
    registry = CollectorRegistry()
    c = PlainCounter("c", "doc", ["a"], registry=registry)
    with pytest.raises(ValueError, match="non-negative"):
        c.labels("x").inc(-1)
    with pytest.raises(ValueError, match="label count"):
        c.labels("x", "y")
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        PlainGauge("c_total", "doc", registry=registry)


def test_a_histogram_with_negative_bounds_has_no_sum_like_prometheus_client() -> None:
    plain, reference = CollectorRegistry(), CollectorRegistry()
    pair = [
        PlainHistogram("neg", "doc", registry=plain, buckets=(-1, 0, 1)),
        Histogram("neg", "doc", registry=reference, buckets=(-1, 0, 1)),
    ]
    for v in (-2, -1, 0.5, 3):
        for h in pair:
            h.observe(v)
    assert generate_latest(plain) == generate_latest(reference)
    assert b"neg_sum" not in generate_latest(plain) and b"neg_count 4.0" in generate_latest(plain)
