"""What the ledger, the budgets, the metrics and the log keep of upstream error answers,
cut streams and denials."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from ncap.errors import (
    BudgetExhausted,
    CandidateCountExceedsPolicy,
    UnknownParameter,
    UpstreamError,
)
from ncap.providers.base import AttemptFailed
from ncap.providers.openai_passthrough import openai_failure
from ncap.stores import MemoryBudgetStore
from ncap.testing.scripted import Fail, ScriptedProvider, Stream, chunk, sse
from tests.lifecycle.harness import EMULATE, NATIVE, Harness, drain, harness, route

ENVELOPE_500 = (
    b'{"error": {"message": "The server had an error while processing your request.",'
    b' "type": "server_error", "param": null, "code": null}}'
)
PROMPT = "hi"  # what harness.chat sends: must never reach the log


def error_500(request_id: str = "up-err") -> Fail:
    """A 500 with OpenAI's envelope, normalized by the real OpenAI provider code."""
    return Fail(openai_failure(500, {"x-request-id": request_id}, ENVELOPE_500))


def one_try(**contract: Any) -> dict[str, Any]:
    return route({**NATIVE, **contract}, retries=0)


def sample(h: Harness, name: str, **labels: str) -> float | None:
    return h.metrics.registry.get_sample_value(name, labels)


# -- contract.error_responses ----------------------------------------------------------


async def test_an_error_answer_on_an_unbilled_route_settles_at_zero(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (one_try(), ScriptedProvider([error_500()]))})
    with pytest.raises(UpstreamError) as info:
        await h.chat()
    assert info.value.code == "upstream_error"  # the client's error is unchanged
    (row,) = await h.rows()
    assert (row.state, row.reconciliation_reason) == ("settled", None)
    assert (row.input_tokens, row.output_tokens_total, row.total_tokens) == (0, 0, 0)
    assert (row.cost_micros, row.returned_candidate_count) == (0, 0)
    assert (row.usage_source, row.provider_request_id) == ("provider_response", "up-err")
    assert row.upstream_status == 500  # recorded as what it was: an upstream error answer
    assert row.reserved_output_tokens == 256  # it was reserved, then released
    assert await h.outstanding() == []
    outcome = {"route": "a", "outcome": "unbilled_error"}
    assert sample(h, "ncap_upstream_attempts_total", **outcome) == 1


async def test_the_default_is_unbilled(tmp_path: Path) -> None:
    assert h_contract(tmp_path).error_responses == "unbilled"


def h_contract(tmp_path: Path) -> Any:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))})
    return h.gateway.routes["a"].route.contract


async def test_an_error_answer_on_an_unknown_route_stays_held(tmp_path: Path) -> None:
    provider = ScriptedProvider([error_500()])
    h = harness(tmp_path, {"a": (one_try(error_responses="unknown"), provider)})
    with pytest.raises(UpstreamError):
        await h.chat()
    (row,) = await h.rows()
    assert (row.state, row.reconciliation_reason) == (
        "usage_reconciliation_required",
        "upstream_error_after_dispatch",
    )
    assert (row.input_tokens, row.total_tokens, row.cost_micros) == (None, None, None)
    (held,) = await h.outstanding()
    assert held.hold_id == "req-1#1"


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (openai_failure(502, {}, b"<html>502 Bad Gateway</html>"), "upstream_error_after_dispatch"),
        (AttemptFailed("timeout"), "timeout"),
        (AttemptFailed("connection"), "connection_error"),
        (AttemptFailed("protocol", 200, detail="not JSON"), "upstream_error_after_dispatch"),
    ],
    ids=["html-502", "timeout", "reset-after-dispatch", "unparseable-200"],
)
async def test_ambiguous_outcomes_stay_held_on_an_unbilled_route(
    tmp_path: Path, failure: AttemptFailed, reason: str
) -> None:
    h = harness(tmp_path, {"a": (one_try(), ScriptedProvider([Fail(failure)]))})
    with pytest.raises(UpstreamError):
        await h.chat()
    (row,) = await h.rows()
    assert (row.state, row.reconciliation_reason) == ("usage_reconciliation_required", reason)
    assert (row.total_tokens, row.cost_micros) == (None, None)
    assert row.upstream_status == failure.status  # 502, 200 or none
    assert len(await h.outstanding()) == 1


async def test_an_error_answer_to_a_stream_request_settles_at_zero(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (one_try(), ScriptedProvider([error_500()]))})
    with pytest.raises(UpstreamError):
        await h.chat(stream=True)
    (row,) = await h.rows()
    assert (row.state, row.cost_micros, row.stream_mode) == ("settled", 0, True)
    assert await h.outstanding() == []


async def test_retried_error_answers_each_settle_at_zero(tmp_path: Path) -> None:
    provider = ScriptedProvider([error_500("e1"), error_500("e2"), error_500("e3")])
    h = harness(tmp_path, {"a": (route(), provider)})  # retries: 2
    with pytest.raises(UpstreamError):
        await h.chat()
    rows = await h.rows()
    assert [(r.attempt, r.state, r.cost_micros) for r in rows] == [
        (1, "settled", 0),
        (2, "settled", 0),
        (3, "settled", 0),
    ]
    assert await h.outstanding() == []


async def test_a_refusal_records_its_status_and_no_usage_source(tmp_path: Path) -> None:
    limited = Fail(AttemptFailed("status", 429, retry_after=0.0))
    h = harness(tmp_path, {"a": (one_try(), ScriptedProvider([limited]))})
    with pytest.raises(Exception, match="rate"):
        await h.chat()
    (row,) = await h.rows()
    assert (row.state, row.cost_micros, row.upstream_status) == ("settled", 0, 429)
    assert row.usage_source == "none"  # a refusal, not an error answer


# -- cut streams keep their usage unknown ------------------------------------------


@pytest.mark.parametrize(
    "then",
    [AttemptFailed("connection", detail="reset", partial=True), None],
    ids=["reset", "truncated"],
)
async def test_a_cut_stream_keeps_tokens_and_cost_empty(
    tmp_path: Path, then: AttemptFailed | None
) -> None:
    text = sse(chunk(0, "hel"), chunk(0, "lo"), done=False)
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Stream(text, then=then)]))})
    reply = await h.chat(stream=True)
    await drain(reply.stream)
    (row,) = await h.rows()
    assert (row.state, row.reconciliation_reason) == ("pending", "stream_cut")
    unknown = (row.input_tokens, row.cached_input_tokens, row.output_tokens_total)
    assert unknown == (None, None, None)
    assert (row.reasoning_tokens, row.total_tokens, row.cost_micros) == (None, None, None)
    assert row.usage_source == "none"
    assert len(await h.outstanding()) == 1


async def test_a_cut_fan_out_stream_keeps_every_branch_empty(tmp_path: Path) -> None:
    whole = Stream(sse(chunk(0, "x", finish="stop"), chunk(None, usage=(4, 1))))
    cut = Stream(sse(chunk(0, "y"), done=False), then=AttemptFailed("timeout", partial=True))
    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider([whole, cut]))})
    reply = await h.chat(n=2, temperature=1.0, stream=True)
    await drain(reply.stream)
    first, second = await h.rows()
    assert (first.state, first.total_tokens, first.cost_micros) == ("settled", 5, 6)
    assert (second.state, second.total_tokens, second.cost_micros) == ("pending", None, None)


# -- denial rows: what refused, and the real scope -------------------------------------


class GlobalBudgets(MemoryBudgetStore):
    """In-memory counters that claim a shared scope, so the scope a row records shows."""

    quota_scope = "global"


async def test_a_candidate_count_denial_records_the_approved_maximum(tmp_path: Path) -> None:
    budgets = GlobalBudgets()
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))}, budgets=budgets)
    with pytest.raises(CandidateCountExceedsPolicy):
        await h.chat(n=6, temperature=1.0)
    (row,) = await h.rows()
    assert (row.state, row.policy_result, row.policy_reason) == (
        "denied",
        "deny",
        "candidate_count_exceeds_policy",
    )
    assert (row.denied_by, row.denied_limit, row.denied_amount) == ("max_candidates", 4, 6)
    assert row.quota_scope == "global"  # the store's scope, not always "instance"


async def test_an_output_ceiling_denial_records_the_ceiling(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))})
    with pytest.raises(Exception, match="output ceiling"):
        await h.chat(max_completion_tokens=300)
    (row,) = await h.rows()
    assert (row.denied_by, row.denied_limit, row.denied_amount) == ("output_ceiling", 256, 300)


async def test_a_budget_denial_records_the_window_and_what_did_not_fit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    budgets = GlobalBudgets()
    day = {"workloads": {"default": {"tokens_per_day": 100}}}
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))}, budgets=budgets, **day)
    caplog.set_level(logging.INFO, logger="ncap")
    with pytest.raises(BudgetExhausted) as info:
        await h.chat(request_id="req-b")
    assert info.value.window == "tokens_day"
    (row,) = await h.rows("req-b")
    needed = row.reserved_input_tokens + row.reserved_output_tokens
    assert (row.policy_reason, row.quota_scope) == ("budget_exhausted", "global")
    assert (row.denied_by, row.denied_limit, row.denied_amount) == ("tokens_day", 100, needed)
    by_window = {"workload": "default", "window": "tokens_day"}
    assert sample(h, "ncap_budget_exhausted_total", **by_window) == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "ncap.lifecycle"]
    assert lines == [
        "budget exhausted: request=req-b workload=default route=a status=429 "
        f"reason=budget_exhausted window=tokens_day limit=100 needed={needed}"
    ]


async def test_a_fan_out_budget_denial_records_the_whole_requests_need(tmp_path: Path) -> None:
    usd = {"workloads": {"default": {"usd_per_day": 0.0006}}}  # 600 micro-USD
    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider([]))}, **usd)
    with pytest.raises(BudgetExhausted):
        await h.chat(n=3, temperature=1.0)
    (row,) = await h.rows()
    assert (row.denied_by, row.denied_limit) == ("usd_micros_day", 600)
    # the first branch fit (1 and 2 micro-USD per input and output token); the second
    # did not: the row records all three branches' cost, not the one that was refused
    branch = row.reserved_input_tokens + 2 * row.reserved_output_tokens
    assert branch < 600 < 2 * branch
    assert row.denied_amount is not None and row.denied_amount >= 3 * branch
    assert await h.outstanding() == []  # the branches that fit were given back


# -- an unknown multi-candidate field ---------------------------------------------------


@pytest.mark.parametrize("field", ["best_of", "candidate_count", "num_return_sequences"])
async def test_a_multi_candidate_field_refusal_is_a_denial_row(tmp_path: Path, field: str) -> None:
    budgets = GlobalBudgets()
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))}, budgets=budgets)
    with pytest.raises(UnknownParameter) as info:
        await h.chat(n=2, **{field: 4})
    assert (info.value.code, info.value.param) == ("unknown_parameter", field)
    (row,) = await h.rows()
    assert (row.attempt, row.state, row.policy_result) == (0, "denied", "deny")
    assert (row.policy_reason, row.denied_by) == ("unknown_multi_candidate_field", field)
    assert (row.model_alias, row.route_id, row.quota_scope) == ("m", "a", "global")
    assert (row.requested_candidate_count, row.effective_candidate_count) == (2, 2)
    assert (row.denied_limit, row.denied_amount, row.cost_micros) == (None, None, None)
    labels = {"workload": "default", "policy_result": "deny"}
    assert sample(h, "ncap_requests_total", reason="unknown_multi_candidate_field", **labels) == 1


async def test_other_unknown_fields_and_unknown_aliases_leave_no_row(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))})
    with pytest.raises(UnknownParameter):
        await h.chat(frobnicate=1)
    assert await h.rows() == []
    with pytest.raises(UnknownParameter):
        await h.chat(request_id="req-2", model="no-such-alias", best_of=2)
    (row,) = await h.rows("req-2")  # recorded, but the alias the client made up is not
    assert (row.model_alias, row.route_id, row.denied_by) == (None, None, "best_of")


# -- one sanitized log line per upstream failure ----------------------------------------


async def test_each_upstream_failure_is_one_sanitized_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    provider = ScriptedProvider([error_500(), Fail(AttemptFailed("timeout"))])
    h = harness(tmp_path, {"a": (route(retries=1), provider)})
    caplog.set_level(logging.INFO, logger="ncap")
    with pytest.raises(UpstreamError):
        await h.chat(request_id="req-log")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "upstream failure: request=req-log workload=default route=a attempt=1 status=500 "
        "reason=error_answer outcome=unbilled_error",
        "upstream failure: request=req-log workload=default route=a attempt=2 status=- "
        "reason=timeout outcome=timeout",
    ]
    assert all(PROMPT not in line and "server had an error" not in line for line in lines)


async def test_a_stream_cut_by_the_upstream_is_logged_a_client_leaving_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cut = Stream(sse(chunk(0, "a"), done=False), then=AttemptFailed("connection", partial=True))
    whole = Stream(sse(chunk(0, "b"), chunk(0, finish="stop"), chunk(None, usage=(1, 1))))
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([cut, whole]))})
    caplog.set_level(logging.INFO, logger="ncap")
    await drain((await h.chat(request_id="r1", stream=True)).stream)
    left = (await h.chat(request_id="r2", stream=True)).stream
    assert left is not None
    await anext(left)
    await left.aclose()  # type: ignore[attr-defined]  # the client went away
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "upstream failure: request=r1 workload=default route=a attempt=1 status=- "
        "reason=upstream_reset outcome=stream_cut"
    ]
