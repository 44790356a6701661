"""The cached ISO text of instants is exactly what ``isoformat`` gives, whatever order
the instants come in (same second, next second, another day, back in time)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta, timezone

from ncap.domain.budget import Buckets
from ncap.domain.instants import bucket_keys, iso_second
from ncap.stores.sqlite.budgets import _created
from ncap.stores.sqlite.ledger import _ts

T0 = datetime(2026, 12, 31, 23, 59, 58, 999_999, tzinfo=UTC)


def instants() -> list[datetime]:
    """Runs within one second and one minute, across a year's end, back in time, a
    whole second (microsecond 0) and random instants far apart, interleaved."""
    rng = random.Random(7)
    out = [T0 + timedelta(microseconds=i * 250_001) for i in range(12)]
    out += [T0.replace(microsecond=0), T0, T0 - timedelta(days=400), T0]
    # one field apart from the instant before: every field is part of the key
    mid = datetime(2026, 5, 20, 13, 45, 30, 123_456, tzinfo=UTC)
    for field in ("year", "month", "day", "hour", "minute", "second"):
        out += [mid, mid.replace(**{field: getattr(mid, field) - 1})]
    out += [
        datetime(1999, 1, 1, tzinfo=UTC) + timedelta(seconds=rng.uniform(0, 1e9))
        for _ in range(300)
    ]
    out += [datetime(2026, 3, 1, 8, 0, 0, us, tzinfo=UTC) for us in (0, 1, 0, 999_999)]
    return out


def test_iso_second_and_bucket_keys_match_isoformat() -> None:
    for moment in instants():
        iso = moment.isoformat()
        assert iso_second(moment) == iso[:19]
        assert bucket_keys(moment) == (iso[:16], iso[:10], iso[:7])


def test_buckets_keep_the_isoformat_prefixes_of_the_utc_instant() -> None:
    east = timezone(timedelta(hours=5, minutes=30))
    for moment in instants():
        local = moment.astimezone(east)  # another zone's wall clock: keyed in UTC
        buckets = Buckets.at(local)
        iso = moment.isoformat()
        assert (buckets.minute, buckets.day, buckets.month) == (iso[:16], iso[:10], iso[:7])
        assert buckets.now == moment and buckets.now.tzinfo is UTC


def test_stored_timestamps_are_the_same_text_as_before() -> None:
    east = timezone(timedelta(hours=-7))
    for moment in instants():
        for value in (moment, moment.astimezone(east)):
            utc = value.astimezone(UTC)
            assert _ts(value) == utc.isoformat(timespec="microseconds")[:-6] + "Z"
            assert _created(value) == utc.isoformat()
            assert datetime.fromisoformat(_created(value)) == value
