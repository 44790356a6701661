"""A request whose route failed (the client got a 502 ``upstream_error``) is an outage,
not a requested/returned mismatch: it is listed as ``upstream_failed`` and stays out of
the mismatch rate, whose documented meaning is a route or gateway defect."""

from __future__ import annotations

import asyncio
from datetime import date

from ncap.config import Thresholds
from ncap.reports import Report, build_report, day_window

from .conftest import Backend
from .test_report_fixed import ev, held, settled, t


async def test_upstream_outages_are_not_mismatches(backend: Backend) -> None:
    one = {"requested_candidate_count": 1}
    failed = {"state": "settled", "returned_candidate_count": 0, "cost_micros": 0, **one}
    await backend.write(
        [
            ev(t(10, 1), "OK", 1, "support", **settled(100, 50, 1000, 1, **one)),
            # three attempts answered 502 (unbilled): the client got 502 upstream_error
            *(ev(t(10, 2), "DOWN", a, "support", upstream_status=502, **failed) for a in (1, 2, 3)),
            # a timeout whose usage is unknown: no choice returned, nothing counted yet
            ev(
                t(10, 3),
                "SLOW",
                1,
                "support",
                **held("usage_reconciliation_required", "timeout", 9, **one),
            ),
            # a real defect: two choices asked, one returned
            ev(
                t(10, 4),
                "SHORT",
                1,
                "support",
                requested_candidate_count=2,
                effective_candidate_count=2,
                **settled(100, 50, 1000, 1),
            ),
        ]
    )
    report = await asyncio.to_thread(_build, backend)  # a PostgreSQL source runs its own loop
    kinds = {m.kind: m.requests for m in report.mismatches}
    assert kinds == {"upstream_failed": 2, "fewer_returned": 1}
    # 1 defect of 4 allowed requests (25 %) is under 30 %; counting the outages would be 75 %
    assert not [a for a in report.alerts if a.code == "mismatch_rate_above_threshold"]


def _build(backend: Backend) -> Report:
    source = backend.open_source()
    try:
        window = day_window(date(2026, 11, 10))
        return build_report(source, window, thresholds=Thresholds(mismatch_rate=0.3))
    finally:
        source.close()
