"""An upstream outage does not drain budgets; denials, cut streams and refused
multi-candidate fields leave the rows an operator needs: through
the real gateway in front of the fake upstream, with the official SDK."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ncap.config import Config
from ncap.testing.fake_upstream import FakeState
from tests.http.test_accounting import holds, rows, settled_rows
from tests.http.test_operator_metrics import sample, scrape
from tests.support import UPSTREAM_KEY_ENV, gateway, gateway_config

HELLO: list[dict[str, Any]] = [{"role": "user", "content": "Say hello."}]


def _healthy(url: str) -> dict[str, Any]:
    return {
        "provider": "openai",
        "base_url": url,
        "upstream_model": "fake-model",
        "api_key_env": UPSTREAM_KEY_ENV,
        "timeout_s": 2,
        "retries": 0,
        "pricing": {"input_per_mtok": 0.15, "output_per_mtok": 0.6},
        "contract": {"candidates": "native", "max_candidates": 8},
    }


def _outage_config(fake: tuple[str, FakeState], tmp: Path, **route: Any) -> Config:
    """A 1,200-token day budget; alias ``fake-model`` on a route answering 500s with
    OpenAI's error envelope, ``healthy-model`` on one that answers."""
    return gateway_config(
        fake[0],
        tmp,
        workloads={"default": {"tokens_per_day": 1200}},
        models={"fake-model": ["fake"], "healthy-model": ["healthy"]},
        routes={
            "fake": {"headers": {"x-fake-fault": "error_500"}, **route},
            "healthy": _healthy(fake[0]),
        },
    )


async def test_an_outage_of_500s_leaves_the_budget_free(
    fake: tuple[str, FakeState], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ncap")
    with gateway(_outage_config(fake, tmp_path)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        for _ in range(5):
            with pytest.raises(openai.InternalServerError) as info:
                client.chat.completions.create(model="fake-model", messages=HELLO)
            assert info.value.status_code == 502  # the upstream error, not budget_exhausted
            assert info.value.code == "upstream_error"
        text = scrape(gw.url)
        # the whole day budget is still there: n=4 × 256 reserves over 1,024 tokens
        r = client.chat.completions.create(
            model="healthy-model", messages=HELLO, n=4, temperature=0.8
        )
        assert len(r.choices) == 4
    failed = [e for e in await rows(tmp_path) if e.route_id == "fake"]
    assert len(failed) == 15  # five requests, three attempts each (retries: 2)
    outcomes = {(e.state, e.upstream_status, e.total_tokens, e.cost_micros) for e in failed}
    assert outcomes == {("settled", 500, 0, 0)}
    assert {(e.reconciliation_reason, e.usage_source) for e in failed} == {
        (None, "provider_response")
    }
    assert all(e.reserved_output_tokens == 256 for e in failed)  # reserved, then released
    assert sample(text, "ncap_budget_reserved", workload="default", window="tokens_day") == 0
    assert sample(text, "ncap_budget_spent", workload="default", window="tokens_day") == 0
    assert sample(text, "ncap_reservations_outstanding") == 0
    outcome = {"route": "fake", "outcome": "unbilled_error"}
    assert sample(text, "ncap_upstream_attempts_total", **outcome) == 15
    assert await holds(tmp_path) == []
    lines = [r.getMessage() for r in caplog.records if "upstream failure" in r.getMessage()]
    assert len(lines) == 15  # one line per failed attempt, and no second one per attempt
    assert all("route=fake" in line and "status=500" in line for line in lines)
    assert not [r for r in caplog.records if r.name == "ncap.health"]
    assert all("Say hello" not in r.getMessage() for r in caplog.records)


async def test_with_error_responses_unknown_the_outage_holds_and_exhausts(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    config = _outage_config(fake, tmp_path, retries=0, contract={"error_responses": "unknown"})
    with gateway(config) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        codes = []
        for _ in range(5):
            with pytest.raises(openai.APIStatusError) as info:
                client.chat.completions.create(model="fake-model", messages=HELLO)
            codes.append(info.value.code)
    # the scenario, kept for those who ask for it: the held 500s exhaust the day
    answered = codes.index("budget_exhausted")
    assert codes == ["upstream_error"] * answered + ["budget_exhausted"] * (5 - answered)
    held = [e for e in await rows(tmp_path) if e.state == "usage_reconciliation_required"]
    assert len(held) == answered and len(await holds(tmp_path)) == answered
    each = held[0].reserved_input_tokens + held[0].reserved_output_tokens
    assert answered * each <= 1200 < (answered + 1) * each


async def test_denied_rows_say_what_refused_and_record_the_stores_scope(
    fake: tuple[str, FakeState], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = gateway_config(fake[0], tmp_path, workloads={"default": {"tokens_per_day": 500}})
    caplog.set_level(logging.WARNING, logger="ncap.lifecycle")
    with gateway(config) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as many:
            client.chat.completions.create(model="fake-model", messages=HELLO, n=5)
        with pytest.raises(openai.RateLimitError) as budget:
            client.chat.completions.create(model="fake-model", messages=HELLO, n=2, temperature=1.0)
        text = scrape(gw.url)
    assert many.value.code == "candidate_count_exceeds_policy"
    assert budget.value.code == "budget_exhausted"
    assert budget.value.response.headers["x-should-retry"] == "false"
    (count,) = await rows(tmp_path, many.value.response.headers["x-request-id"])
    (spent,) = await rows(tmp_path, budget.value.response.headers["x-request-id"])
    assert (count.denied_by, count.denied_limit, count.denied_amount) == ("max_candidates", 4, 5)
    needed = spent.reserved_input_tokens + spent.reserved_output_tokens
    assert (spent.denied_by, spent.denied_limit, spent.denied_amount) == ("tokens_day", 500, needed)
    assert count.quota_scope == spent.quota_scope == "host"  # SQLite budgets, not "instance"
    assert sample(text, "ncap_budget_exhausted_total", workload="default", window="tokens_day") == 1
    request_id = budget.value.response.headers["x-request-id"]
    assert [r.getMessage() for r in caplog.records] == [
        f"budget exhausted: request={request_id} workload=default route=fake status=429 "
        f"reason=budget_exhausted window=tokens_day limit=500 needed={needed}"
    ]


async def test_a_truncated_stream_leaves_tokens_and_cost_empty(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    headers = {"x-fake-fault": "truncated_stream=2"}
    config = gateway_config(fake[0], tmp_path, routes={"fake": {"headers": headers}})
    with gateway(config) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(model="fake-model", messages=HELLO, stream=True)
        request_id = stream.response.headers["x-request-id"]
        with pytest.raises(openai.APIError):  # the gateway's error event ends the stream
            for _ in stream:
                pass
    (row,) = await settled_rows(tmp_path, request_id)
    assert (row.state, row.reconciliation_reason) == ("pending", "stream_cut")
    assert (row.input_tokens, row.output_tokens_total, row.total_tokens) == (None, None, None)
    assert (row.cached_input_tokens, row.cost_micros, row.usage_source) == (None, None, "none")
    assert len(await holds(tmp_path)) == 1


async def test_a_refused_multi_candidate_field_is_a_denied_row_and_counted(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    with gateway(gateway_config(fake[0], tmp_path)) as gw:
        body = {"model": "fake-model", "messages": HELLO, "best_of": 3}
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
        other = {"model": "fake-model", "messages": HELLO, "frobnicate": 1}
        plain = httpx.post(gw.url + "/v1/chat/completions", json=other, timeout=10)
        text = scrape(gw.url)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    assert plain.status_code == 400
    (row,) = await rows(tmp_path, r.headers["x-request-id"])
    assert (row.state, row.policy_reason, row.denied_by) == (
        "denied",
        "unknown_multi_candidate_field",
        "best_of",
    )
    assert (row.model_alias, row.route_id, row.quota_scope) == ("fake-model", "fake", "host")
    assert await rows(tmp_path, plain.headers["x-request-id"]) == []
    refusals = "ncap_validation_refusals_total"
    assert sample(text, refusals, code="unknown_parameter", multi_candidate="true") == 1
    assert sample(text, refusals, code="unknown_parameter", multi_candidate="false") == 1
    deny = {"workload": "default", "policy_result": "deny"}
    assert sample(text, "ncap_requests_total", reason="unknown_multi_candidate_field", **deny) == 1
