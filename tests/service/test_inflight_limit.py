from __future__ import annotations

import pytest

from ncap.config import Ramp
from ncap.errors import Overloaded, SlowDown
from ncap.http.inflight import PEAK_WINDOW_S, InFlightLimit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def admit(gate: InFlightLimit, count: int) -> int:
    admitted = 0
    for _ in range(count):
        try:
            gate.enter()
        except SlowDown:
            continue
        gate.leave()
        admitted += 1
    return admitted


def test_ramp_allows_burst_from_idle_then_growth_per_second() -> None:
    clock = Clock()
    gate = InFlightLimit(1000, Ramp(requests_per_second=50, burst=100), clock)
    assert admit(gate, 500) == 100  # from idle: the burst
    clock.now += 1
    assert admit(gate, 500) == 150  # previous second + 50
    clock.now += 1
    assert admit(gate, 500) == 200
    clock.now += PEAK_WINDOW_S + 1  # idle past the window: back to the burst allowance
    assert admit(gate, 500) == 100


def test_a_dip_is_not_growth_the_recent_peak_is_the_reference() -> None:
    """Steady traffic that wobbles (a slow second, then the usual rate) is never
    slowed: the allowance is the busiest recent second's count plus the growth."""
    clock = Clock()
    gate = InFlightLimit(10_000, Ramp(requests_per_second=10, burst=100), clock)
    for want in (100, 110, 120):  # ramped up to 120 a second
        assert admit(gate, want) == want
        clock.now += 1
    assert admit(gate, 60) == 60  # a slow second
    clock.now += 1
    assert admit(gate, 500) == 130  # back to the usual rate at once (peak 120 + 10)
    clock.now += PEAK_WINDOW_S - 1  # 120 and 130 are still within the window
    assert admit(gate, 500) == 140


def test_steady_traffic_above_the_growth_step_is_never_slowed() -> None:
    clock = Clock()
    gate = InFlightLimit(1000, Ramp(requests_per_second=10, burst=300), clock)
    for _ in range(10):
        assert admit(gate, 300) == 300
        clock.now += 1


def test_slow_down_says_when_to_retry() -> None:
    clock = Clock()
    gate = InFlightLimit(10, Ramp(requests_per_second=1, burst=1), clock)
    gate.enter()
    clock.now += 0.25
    with pytest.raises(SlowDown) as info:
        gate.enter()
    assert info.value.retry_after == pytest.approx(0.75)
    assert info.value.status == 429 and info.value.code == "slow_down"


def test_in_flight_ceiling() -> None:
    gate = InFlightLimit(2, Ramp(requests_per_second=100, burst=100), Clock())
    gate.enter()
    gate.enter()
    with pytest.raises(Overloaded) as info:
        gate.enter()
    assert info.value.status == 503 and info.value.code == "server_is_overloaded"
    gate.leave()
    gate.enter()
