"""The report's candidate evidence against hand computations on a generated ledger
(both dialects): mean distinct share, agreement distribution, duplicate-output share,
the what-if of n, the emulated-vs-native what-if; and the "candidates mostly duplicate"
alert fires strictly below its threshold, from its minimum number of requests."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from ncap.cli.main import app
from ncap.config import Pricing, Thresholds, utcnow
from ncap.domain.events import LedgerEvent
from ncap.reports import Report, build_report, day_window, render_html
from ncap.stores import SQLiteLedgerStore

from .conftest import Backend

T = datetime(2026, 11, 10, 12, tzinfo=UTC)
PRICES = {
    "native": Pricing(input_per_mtok=0.5, output_per_mtok=2.0),
    "emul": Pricing(input_per_mtok=1.0, output_per_mtok=4.0),
}
# native requests of workload w1 under exception ex1:
# (compared, distinct, majority, tool calls, input tokens, output tokens)
NATIVE = [(4, 1, 4, 0, 100, 400), (4, 2, 3, 4, 100, 200), (2, 2, 1, 0, 50, 100)]
# emulated requests of workload w2: (distinct, majority, input per branch, outputs per branch)
EMULATED = [(2, 2, 40, (10, 10, 30)), (1, 2, 40, (20, 20))]


def _event(rid: str, attempt: int, workload: str, route: str, n: int, **f: Any) -> LedgerEvent:
    return LedgerEvent(
        timestamp=T,
        request_id=rid,
        attempt=attempt,
        workload_id=workload,
        environment="production",
        route_id=route,
        requested_candidate_count=n,
        effective_candidate_count=n,
        state="settled",
        usage_source="provider_response",
        **f,
    )


def _cost(route: str, inp: int, out: int) -> int:
    p = PRICES[route]
    return round(inp * p.input_per_mtok + out * p.output_per_mtok)


def generated() -> list[LedgerEvent]:
    events = []
    for i, (k, d, m, t, inp, out) in enumerate(NATIVE):
        events.append(
            _event(
                f"n{i}", 1, "w1", "native", k,
                exception_id="ex1", returned_candidate_count=k, input_tokens=inp,
                output_tokens_total=out, cost_micros=_cost("native", inp, out),
                candidates_compared=k, candidates_distinct=d, candidates_majority=m,
                candidates_tool_calls=t,
            )
        )  # fmt: skip
    for i, (d, m, inp, outs) in enumerate(EMULATED):
        k = len(outs)
        for b, out in enumerate(outs, 1):
            evidence = {}
            if b == 1:  # the first branch's row carries the request's evidence
                evidence = {"candidates_compared": k, "candidates_distinct": d,
                            "candidates_majority": m, "candidates_tool_calls": 0}  # fmt: skip
            events.append(
                _event(
                    f"e{i}", b, "w2", "emul", k,
                    returned_candidate_count=1, input_tokens=inp, output_tokens_total=out,
                    cost_micros=_cost("emul", inp, out), **evidence,
                )
            )  # fmt: skip
    # a single-candidate request and a denial: not in the section
    events.append(_event("one", 1, "w1", "native", 1, returned_candidate_count=1,
                         input_tokens=5, output_tokens_total=5, cost_micros=12))  # fmt: skip
    events.append(
        LedgerEvent(T, "deny", 0, "w1", "production", effective_candidate_count=9,
                    policy_result="deny", policy_reason="candidate_count_exceeds_policy",
                    state="denied")
    )  # fmt: skip
    return events


def _report(backend: Backend, thresholds: Thresholds | None = None) -> Report:
    def build() -> Report:
        source = backend.open_source()
        try:
            return build_report(
                source, day_window(date(2026, 11, 10)), pricing=PRICES, thresholds=thresholds
            )
        finally:
            source.close()

    return build()


async def test_evidence_and_what_if_match_hand_computation(backend: Backend) -> None:
    await backend.write(generated())
    report = await asyncio.to_thread(_report, backend)
    w1, w2 = report.candidates
    assert (w1.workload_id, w1.exception_id, w2.workload_id, w2.exception_id) == (
        "w1", "ex1", "w2", None
    )  # fmt: skip

    # w1, by hand: distinct/compared 1/4, 2/4, 2/2; majority 4/4, 3/4, 1/2; tools 0, 4/4, 0
    assert (w1.requests, w1.candidates) == (3, 10)
    assert w1.distinct_share_mean == round((0.25 + 0.5 + 1.0) / 3, 4) == 0.5833
    assert w1.agreement_mean == round((1.0 + 0.75 + 0.5) / 3, 4) == 0.75
    assert w1.agreement == {"1.0": 1, "0.75-1.0": 1, "0.5-0.75": 1, "<0.5": 0}
    assert w1.tool_call_share_mean == round(1 / 3, 4)
    # duplicates: 400·3/4 + 200·2/4 + 100·0/2 = 400 of 700 output tokens
    assert w1.duplicate_output_share == round(400 / 700, 4)
    # spent: (100·0.5 + 400·2) + (100·0.5 + 200·2) + (50·0.5 + 100·2) = 850 + 450 + 225
    assert w1.spent_micros == 1525
    # what-if, the workload's mean prompt P̄ = 250/3 and completion C̄ = (100 + 50 + 50)/3:
    # cost(n) = 3 · (P̄·0.5 + n·C̄·2) = 125 + 400·n
    p_mean, c_mean = 250 / 3, (100 + 50 + 50) / 3
    assert w1.what_if == {n: round(3 * (p_mean * 0.5 + n * c_mean * 2.0)) for n in (1, 2, 3, 4)}
    assert w1.what_if == {1: 525, 2: 925, 3: 1325, 4: 1725}
    assert w1.saving_at_one_micros == 1525 - 525
    assert (w1.emulated_requests, w1.native_equivalent_micros) == (0, None)

    # w2 (emulated), by hand: distinct 2/3, 1/2; majority 2/3, 2/2
    assert (w2.requests, w2.candidates) == (2, 5)
    assert w2.distinct_share_mean == round((2 / 3 + 1 / 2) / 2, 4)
    assert w2.agreement_mean == round((2 / 3 + 1.0) / 2, 4)
    assert w2.agreement == {"1.0": 1, "0.75-1.0": 0, "0.5-0.75": 1, "<0.5": 0}
    # duplicates: 50·1/3 + 40·1/2 of 90 output tokens
    assert w2.duplicate_output_share == round((50 / 3 + 20) / 90, 4)
    # spent: branches (40 + 40), (40 + 40), (40 + 120); (40 + 80) twice
    assert w2.spent_micros == 320 + 240 == w2.emulated_spent_micros
    # emulated what-if: each branch pays its prompt: n·P·1 + n·C·4 per request, with
    # P = 40 and C = 50/3, 20
    assert w2.what_if == {n: round(n * (40 + 40) + n * (50 / 3 + 20) * 4) for n in (1, 2, 3)}
    assert w2.saving_at_one_micros == 560 - w2.what_if[1]
    # the same traffic on a native route: one prompt each, P + k·C·4
    assert w2.native_equivalent_micros == round((40 + 3 * 50 / 3 * 4) + (40 + 2 * 20 * 4)) == 440

    # the page (the dashboard's too) shows the same numbers
    page = render_html(report)
    assert 'id="candidates"' in page
    for text in ("ex1", "0.58", "1: $0.000525, 2: $0.000925", "$0.001000", "$0.000440"):
        assert text in page


@pytest.mark.parametrize(
    ("share", "min_requests", "fired"),
    [
        (0.59, 2, {"w1", "w2"}),  # both means are 0.5833: below 0.59
        (0.58, 2, set()),  # above 0.58: nothing
        (0.5833, 2, set()),  # equal is not below
        (0.59, 3, {"w1"}),  # w2 has 2 requests: under the minimum
        (None, 1, set()),  # the check turned off
    ],
)
async def test_mostly_duplicate_alert_fires_below_its_threshold_only(
    backend: Backend, share: float | None, min_requests: int, fired: set[str]
) -> None:
    await backend.write(generated())
    limits = Thresholds(candidates_distinct_share=share, candidates_min_requests=min_requests)
    report = await asyncio.to_thread(_report, backend, limits)
    alerts = [a for a in report.alerts if a.code == "candidates_mostly_duplicate"]
    assert {a.message.split("workload ")[1].split(",")[0].split(" ")[0] for a in alerts} == fired
    for alert in alerts:
        assert alert.severity == "warning" and alert.threshold == share
        assert "lower n, raise the temperature" in alert.message
        if "w1" in alert.message:  # names the exception and what n=1 would have saved
            assert "exception ex1" in alert.message and "revoke the exception" in alert.message
            assert "$0.001000 less" in alert.message


def test_exception_review_cli(tmp_path: Path) -> None:
    """``ncap report candidates``: the evidence, the what-if and the exception review,
    as tables and as JSON, from the configured ledger and prices."""
    ledger = tmp_path / "ledger.db"

    async def write() -> None:
        store = SQLiteLedgerStore(ledger)
        for event in generated():
            await store.append(event)
        await store.close()

    asyncio.run(write())
    route = {"provider": "openai", "base_url": "http://127.0.0.1:9/v1"}
    config = {
        "stores": {"ledger": f"sqlite:///{ledger}", "budgets": "memory://"},
        "workloads": {"default": {}, "w1": {"max_candidates": 4}, "w2": {"max_candidates": 4}},
        "models": {"m": ["native"], "e": ["emul"]},
        "routes": {
            name: {
                **route,
                "pricing": {"input_per_mtok": p.input_per_mtok,
                            "output_per_mtok": p.output_per_mtok},
                "contract": {"candidates": kind, "max_candidates": 8},
            }
            for name, p, kind in (
                ("native", PRICES["native"], "native"), ("emul", PRICES["emul"], "emulate")
            )
        },
        "exceptions": [
            {"id": "ex1", "workload": "w1", "owner": "o", "max_candidates": 4,
             "expires": "2030-01-01T00:00:00Z"}
        ],
        "reports": {
            "thresholds": {"candidates_distinct_share": 0.59, "candidates_min_requests": 3}
        },
    }  # fmt: skip
    path = tmp_path / "ncap.yaml"
    path.write_text(yaml.safe_dump(config))
    since = f"{(utcnow() - T).days + 2}d"
    args = ["report", "candidates", "--since", since, "--config", str(path)]
    result = CliRunner().invoke(app, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    [review] = data["exceptions"]
    assert (review["id"], review["requests_window"], review["spent_micros"]) == ("ex1", 3, 1525)
    assert review["evidence"]["distinct_share_mean"] == 0.5833
    assert review["evidence"]["what_if"] == {"1": 525, "2": 925, "3": 1325, "4": 1725}
    [alert] = data["alerts"]
    assert "exception ex1" in alert["message"]
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0, table.output
    for text in ("exception review", "what-if of n", "ex1", "$0.001000", "candidates mostly"):
        assert text in table.stdout
