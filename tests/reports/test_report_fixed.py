"""Every section of the report against numbers worked out by hand on a small ledger.

The ledger below is written through the real store (``append``). The window is the
UTC day 2026-11-10; the previous window is 2026-11-09. Expected values are literals,
derived in the comments from the rows, not from the code under test.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, date, datetime
from typing import Any

import pytest

from ncap.config import ExceptionGrant, Thresholds
from ncap.domain.events import LedgerEvent
from ncap.reports import Report, build_report, day_window, nearest_rank, population_stability_index

from .conftest import Backend


def t(day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 11, day, hour, minute, tzinfo=UTC)


def ev(ts: datetime, rid: str, attempt: int, workload: str, **kw: Any) -> LedgerEvent:
    route = kw.pop("route", "route-a")
    base: dict[str, Any] = {
        "route_id": route,
        "model_alias": "alias",
        "upstream_model": {"route-a": "m-a", "route-b": "m-b", "route-e": "m-e"}[route],
        "gateway_instance": "gw",
    }
    base.update(kw)
    return LedgerEvent(
        timestamp=ts,
        request_id=rid,
        attempt=attempt,
        workload_id=workload,
        environment="production",
        **base,
    )


def settled(out: int, inp: int, cost: int, returned: int, **kw: Any) -> dict[str, Any]:
    return {
        "state": "settled",
        "output_tokens_total": out,
        "input_tokens": inp,
        "total_tokens": inp + out,
        "cost_micros": cost,
        "returned_candidate_count": returned,
        "usage_source": "provider_response",
        **kw,
    }


def denied(reason: str, **kw: Any) -> dict[str, Any]:
    return {"state": "denied", "policy_result": "deny", "policy_reason": reason, **kw}


def held(state: str, reason: str, reserved: int, **kw: Any) -> dict[str, Any]:
    return {"state": state, "reconciliation_reason": reason, "reserved_cost_micros": reserved, **kw}


EVENTS = [
    # --- the window: 2026-11-10 ------------------------------------------------------
    ev(t(10, 1), "R1", 1, "support", **settled(100, 50, 1000, 1)),
    ev(
        t(10, 2),
        "R2",
        1,
        "support",
        requested_candidate_count=1,
        **held("usage_reconciliation_required", "timeout", 500),
    ),
    ev(t(10, 2), "R2", 2, "support", requested_candidate_count=1, **settled(300, 60, 2000, 1)),
    ev(
        t(10, 3),
        "R3",
        1,
        "eval",
        requested_candidate_count=4,
        effective_candidate_count=4,
        exception_id="eval-x",
        **settled(800, 70, 5000, 4),
    ),
    ev(
        t(10, 4),
        "R4",
        1,
        "eval",
        requested_candidate_count=4,
        effective_candidate_count=4,
        exception_id="eval-x",
        returned_candidate_count=3,
        **held("usage_reconciliation_required", "returned_mismatch", 4000),
    ),
    ev(
        t(10, 15),
        "R5",
        1,
        "brain",
        route="route-e",
        requested_candidate_count=2,
        effective_candidate_count=2,
        exception_id="brain-old",
        **settled(50, 10, 300, 1),
    ),
    ev(
        t(10, 15),
        "R5",
        2,
        "brain",
        route="route-e",
        requested_candidate_count=2,
        effective_candidate_count=2,
        exception_id="brain-old",
        **settled(70, 10, 400, 1),
    ),
    ev(
        t(10, 5),
        "R6",
        0,
        "support",
        requested_candidate_count=3,
        effective_candidate_count=3,
        **denied("candidate_count_exceeds_policy"),
    ),
    ev(
        t(10, 6),
        "R7",
        0,
        "eval",
        requested_candidate_count=8,
        effective_candidate_count=8,
        **denied("candidate_count_exceeds_policy"),
    ),
    ev(t(10, 7), "R8", 0, "support", **denied("output_ceiling_exceeds_policy")),
    ev(
        t(10, 20),
        "R9",
        1,
        "support",
        stream_mode=True,
        returned_candidate_count=1,
        **held("pending", "stream_cut", 700),
    ),
    ev(
        t(10, 21),
        "R10",
        1,
        "support",
        **held("usage_reconciliation_required", "upstream_error_after_dispatch", 600),
    ),
    ev(t(10, 21), "R10", 2, "support", route="route-b", **settled(200, 40, 1500, 1)),
    # --- the previous window: 2026-11-09 ---------------------------------------------
    ev(t(9, 1), "P1", 1, "support", **settled(10, 5, 10, 1)),
    ev(t(9, 2), "P2", 1, "support", **settled(10, 5, 10, 1)),
    ev(t(9, 3), "P3", 1, "support", **settled(10, 5, 10, 1)),
    ev(t(9, 4), "P4", 1, "support", requested_candidate_count=1, **settled(10, 5, 10, 1)),
    ev(
        t(9, 5),
        "P5",
        1,
        "eval",
        requested_candidate_count=4,
        effective_candidate_count=4,
        exception_id="eval-x",
        **settled(400, 20, 2500, 4),
    ),
    ev(
        t(9, 6),
        "P6",
        1,
        "eval",
        requested_candidate_count=2,
        effective_candidate_count=2,
        exception_id="ghost-1",
        **settled(40, 5, 123, 2),
    ),
    # --- before both windows, and after the window ------------------------------------
    ev(t(5, 9), "OLD", 1, "support", **held("usage_reconciliation_required", "gateway_lost", 900)),
    ev(
        t(12, 9),
        "LATER1",
        1,
        "eval",
        requested_candidate_count=4,
        effective_candidate_count=4,
        exception_id="eval-x",
        **settled(999, 9, 9999, 4),
    ),
    ev(t(12, 10), "LATER2", 1, "support", **held("pending", "stream_cut", 777)),
]

GRANTS = [
    ExceptionGrant(
        id="eval-x",
        workload="eval",
        owner="a@example.com",
        max_candidates=4,
        budget_usd=0.01,
        expires=datetime(2026, 12, 31, tzinfo=UTC),
    ),
    ExceptionGrant(
        id="brain-old",
        workload="brain",
        owner="b@example.com",
        max_candidates=2,
        budget_usd=1.0,
        expires=t(10, 12),
    ),
    ExceptionGrant(
        id="unused-z",
        workload="eval",
        owner="c@example.com",
        max_candidates=3,
        budget_usd=5.0,
        expires=datetime(2027, 1, 1, tzinfo=UTC),
    ),
]
THRESHOLDS = Thresholds(
    output_tokens_per_request_p95=700,
    output_tokens_per_request_mean=400,
    denial_rate=0.05,
    mismatch_rate=0.0,
    pending_count=4,
    pending_age="24h",
    exception_budget_warn=0.8,
    distribution_shift_psi=0.1,
    shift_min_requests=5,
)
NOW = t(11, 6)


@pytest.fixture
async def report(backend: Backend) -> Report:
    await backend.write(EVENTS)
    # the report is synchronous (a PostgreSQL source runs its own loop): build it in a
    # thread, as the dashboard does
    return await asyncio.to_thread(_build, backend)


def _build(backend: Backend) -> Report:
    source = backend.open_source()
    try:
        return build_report(
            source,
            day_window(date(2026, 11, 10)),
            kind="daily",
            exceptions=GRANTS,
            thresholds=THRESHOLDS,
            now=NOW,
        )
    finally:
        source.close()


def test_totals(report: Report) -> None:
    t_ = report.totals
    # requests: R1..R10; attempts: R1, R2x2, R3, R4, R5x2, R9, R10x2; denied R6 R7 R8
    assert (t_.requests, t_.attempts, t_.denied_requests) == (10, 10, 3)
    assert t_.cost_micros == 1000 + 2000 + 5000 + 300 + 400 + 1500
    assert t_.output_tokens == 1520
    assert t_.input_tokens == 50 + 60 + 70 + 10 + 10 + 40


def test_requested_candidate_distribution(report: Report) -> None:
    got = {(d.workload_id, d.route_id, d.requested): d.requests for d in report.distribution}
    assert got == {
        ("support", "route-a", None): 4,  # R1 R8 R9 R10 (first attempt on route-a)
        ("support", "route-a", 1): 1,  # R2, once although it has two attempts
        ("support", "route-a", 3): 1,  # R6
        ("eval", "route-a", 4): 2,  # R3 R4
        ("eval", "route-a", 8): 1,  # R7
        ("brain", "route-e", 2): 1,  # R5, once although it has two branches
    }


def test_requested_effective_returned_mismatches(report: Report) -> None:
    got = {(m.workload_id, m.kind): m.requests for m in report.mismatches}
    # omitted n: R1 R9 R10 (R8 was denied); R4 returned 3 of 4; R5's branches add up to 2
    assert got == {("support", "omitted_normalized"): 3, ("eval", "fewer_returned"): 1}
    routes = {m.route_id: (m.attempts, m.returned_mismatch) for m in report.route_mismatches}
    assert routes == {"route-a": (7, 1), "route-b": (1, 0), "route-e": (2, 0)}


def test_output_tokens_per_request_and_per_choice(report: Report) -> None:
    by = {o.workload_id: o for o in report.output}
    everyone = by["*"]
    # per request: R1 100, R2 300, R3 800, R5 50+70, R10 200 (R4, R9: no usage)
    assert everyone.requests == 5
    assert everyone.mean == 304.0
    assert (everyone.p50, everyone.p95) == (200, 800)  # nearest rank 3 and 5 of 5
    assert (everyone.output_tokens, everyone.returned_choices) == (1520, 9)
    assert everyone.per_choice == 168.889
    assert (by["support"].mean, by["support"].p50, by["support"].p95) == (200.0, 200, 300)
    assert by["support"].per_choice == 200.0
    assert (by["eval"].requests, by["eval"].p95, by["eval"].per_choice) == (1, 800, 200.0)
    assert (by["brain"].mean, by["brain"].per_choice) == (120.0, 60.0)


def test_exception_usage(report: Report) -> None:
    by = {e.id: e for e in report.exceptions}
    ev_x = by["eval-x"]
    # lifetime to the window's end: R3 5000 + P5 2500 settled; R4 holds 4000; LATER1 is after
    assert (ev_x.requests_total, ev_x.requests_window) == (3, 2)
    assert (ev_x.spent_micros, ev_x.held_micros, ev_x.budget_micros) == (7500, 4000, 10000)
    assert ev_x.used_fraction == 1.15
    assert (ev_x.status, ev_x.owner, ev_x.requests_after_expiry) == ("active", "a@example.com", 0)
    old = by["brain-old"]
    assert (old.status, old.requests_total, old.spent_micros) == ("expired", 1, 700)
    assert old.requests_after_expiry == 1  # R5 at 15:00, the grant ended at 12:00
    assert old.used_fraction == 0.0007
    assert old.last_used == t(10, 15)
    unused = by["unused-z"]
    assert (unused.requests_total, unused.spent_micros, unused.used_fraction) == (0, 0, 0.0)
    ghost = by["ghost-1"]
    assert (ghost.status, ghost.requests_total, ghost.requests_window) == ("not_in_config", 1, 0)
    assert ghost.spent_micros == 123


def test_denials_by_reason(report: Report) -> None:
    got = {(d.reason, d.workload_id): d.requests for d in report.denials}
    assert got == {
        ("candidate_count_exceeds_policy", "support"): 1,
        ("candidate_count_exceeds_policy", "eval"): 1,
        ("output_ceiling_exceeds_policy", "support"): 1,
    }


def test_pending_reconciliation(report: Report) -> None:
    got = {(p.state, p.reason): (p.count, p.reserved_cost_micros) for p in report.pending}
    assert got == {
        ("usage_reconciliation_required", "timeout"): (1, 500),
        ("usage_reconciliation_required", "returned_mismatch"): (1, 4000),
        ("usage_reconciliation_required", "upstream_error_after_dispatch"): (1, 600),
        ("usage_reconciliation_required", "gateway_lost"): (1, 900),
        ("pending", "stream_cut"): (1, 700),  # LATER2 is after the window's end
    }
    total = report.pending_total
    assert (total.count, total.reserved_cost_micros, total.oldest) == (5, 6700, t(5, 9))


def test_spend_by_workload_route_model(report: Report) -> None:
    def rows(section: Any) -> dict[Any, tuple[int, ...]]:
        return {
            s.key: (s.requests, s.attempts, s.cost_micros, s.held_micros, s.output_tokens)
            for s in section
        }

    assert rows(report.spend_by_workload) == {
        "support": (6, 6, 4500, 1800, 600),
        "eval": (3, 2, 5000, 4000, 800),
        "brain": (1, 2, 700, 0, 120),
    }
    assert rows(report.spend_by_route) == {
        "route-a": (9, 7, 8000, 5800, 1200),
        "route-b": (0, 1, 1500, 0, 200),
        "route-e": (1, 2, 700, 0, 120),
    }
    assert rows(report.spend_by_model) == {
        "m-a": (9, 7, 8000, 5800, 1200),
        "m-b": (0, 1, 1500, 0, 200),
        "m-e": (1, 2, 700, 0, 120),
    }


def test_distribution_shift(report: Report) -> None:
    by = {s.workload_id: s for s in report.shift}
    overall = by["*"]
    assert overall.current == {"omitted": 4, "1": 1, "2": 1, "3": 1, "4": 2, "8": 1}
    assert overall.previous == {"omitted": 3, "1": 1, "4": 1, "2": 1}
    # PSI with half a request added per bucket, worked by hand: 0.133816
    assert overall.psi == pytest.approx(0.133816, abs=1e-6)
    assert overall.status == "shift"  # above the test's 0.1
    assert by["support"].status == "insufficient_data"  # 4 previous requests < 5


def test_thresholds_and_alerts(report: Report) -> None:
    codes = {a.code: a for a in report.alerts}
    assert set(codes) == {
        "output_p95_above_threshold",  # 800 > 700
        "denial_rate_above_threshold",  # 3/10 > 0.05
        "mismatch_rate_above_threshold",  # 1/7 > 0
        "pending_count_above_threshold",  # 5 > 4
        "pending_older_than_threshold",  # OLD is 5 days old at NOW
        "exception_budget_exhausted",  # eval-x at 115 %
        "expired_exception_in_use",  # brain-old after 12:00
        "requested_candidates_shift",  # PSI 0.134 > 0.1
    }  # the mean (304) is under 400: no alert
    assert codes["denial_rate_above_threshold"].value == 0.3
    assert codes["mismatch_rate_above_threshold"].value == pytest.approx(1 / 7, abs=1e-6)
    assert codes["exception_budget_exhausted"].severity == "critical"
    assert report.thresholds["distribution_shift_psi"] == 0.1


def test_nearest_rank_and_psi_by_hand() -> None:
    assert nearest_rank({10: 1, 20: 1, 30: 1, 40: 1}, 0.5) == 20
    assert nearest_rank({10: 1, 20: 1, 30: 1, 40: 1}, 0.95) == 40
    assert nearest_rank({5: 19, 100: 1}, 0.95) == 5
    assert nearest_rank({}, 0.5) is None
    assert population_stability_index({"1": 10}, {"1": 10}) == 0.0
    # smoothed shares a: 5.5/6 vs 0.5/6, b: the reverse; PSI = 2 * (10/12) * ln(11)
    assert population_stability_index({"a": 5, "b": 0}, {"a": 0, "b": 5}) == pytest.approx(
        2 * (5.5 / 6 - 0.5 / 6) * 2.3978952728, abs=1e-6
    )


async def test_every_sqlite_query_path_gives_the_same_report(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scan or index for the window, scan or partial index for exceptions: same numbers."""
    from ncap.reports import SQLiteSource, ensure_report_indexes, report_dict
    from ncap.stores import SQLiteLedgerStore
    from ncap.stores.sqlite import report_source as source_module

    path = tmp_path / "paths.db"
    store = SQLiteLedgerStore(path)
    for event in EVENTS:
        await store.append(event)
    await store.close()

    def run() -> dict[str, Any]:
        src = SQLiteSource(path)
        try:
            r = build_report(
                src,
                day_window(date(2026, 11, 10)),
                kind="daily",
                exceptions=GRANTS,
                thresholds=THRESHOLDS,
                now=NOW,
            )
        finally:
            src.close()
        data = report_dict(r)
        data.pop("elapsed_ms")
        return data

    scanned = run()  # this window holds most rows: table scan; no report index yet
    monkeypatch.setattr(source_module, "WIDE_WINDOW", 1.0)  # always the timestamp index
    assert run() == scanned
    ensure_report_indexes(path)
    ensure_report_indexes(path)  # idempotent
    src = SQLiteSource(path)
    assert "INDEXED BY" in src.exception_scan()
    src.close()
    assert run() == scanned
