"""The dashboard's flag rule: a bucket is flagged when it moved by 40 % or more of the
earlier value, above a floor, and (for counts) by more than chance moves two counts."""

from __future__ import annotations

import pytest

from ncap.reports.timeline import moved


@pytest.mark.parametrize(
    ("metric", "value", "previous", "flagged"),
    [
        ("requests", 500, 1_000, True),  # a halved day
        ("requests", 1_600, 1_000, True),  # a day 60 % up
        ("requests", 25, 14, False),  # a night hour: +79 %, within 3 sigma of chance
        ("requests", 45, 14, True),  # the same hour tripled: beyond chance
        ("requests", 19, 0, False),  # below the floor
        ("requests", 30, 0, True),  # new traffic past the floor
        ("requests", 1_000, 900, False),  # +11 %: not a 40 % move
        ("denials", 12, 30, False),  # -60 %, but 18 <= 3 * sqrt(42)
        ("denials", 5, 60, True),
        # spend is not a count of arrivals: the 40 % rule alone
        ("spend", 25_000, 14_000, True),
        ("spend", 9_000, 5_000, False),  # below the $0.01 floor
    ],
)
def test_flag_rule(metric: str, value: float, previous: float, flagged: bool) -> None:
    assert moved(metric, value, previous) is flagged  # type: ignore[arg-type]
