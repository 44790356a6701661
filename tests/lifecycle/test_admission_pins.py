"""Pins found by mutation testing (docs/mutation.md) for admission and dispatch: the
denial row of a refused multi-candidate field and of a request denied before it was
sized (every column, and the plan the observers see), the reservation's sizing per
route, the contract's fingerprint, the legacy endpoint's rules, the body and timeout
each route gets; over the scripted provider, socket-free."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ncap import __version__
from ncap.domain.reservation import Reservation
from ncap.errors import (
    IdempotencyKeyReused,
    InvalidValue,
    ModelNotFound,
    Overloaded,
    PolicyDenied,
    RateLimited,
    RouteContractStale,
    RouteDoesNotSupportCandidates,
    UnknownParameter,
    UpstreamError,
)
from ncap.lifecycle import Accounting, Caller, Gateway
from ncap.lifecycle.asked import input_estimate
from ncap.lifecycle.plan import Attempt, Plan
from ncap.providers.base import AttemptFailed, RequestKind, UpstreamResult
from ncap.testing.scripted import Answer, Fail, ScriptedProvider, Stream, chat_body, chunk, sse
from tests.lifecycle.harness import (
    CALLER,
    EMULATE,
    NATIVE,
    Harness,
    drain,
    events,
    harness,
    route,
    settled,
)

RETRIED = Caller("default", "test", client_retry_count=3)
OVERLOADED = Fail(AttemptFailed("status", 503))
# {"role":"user","content":"hi"} is 30 bytes: 16 + 8 + 30 tokens estimated
HI_ESTIMATE = 54


def _raw(**body: Any) -> bytes:
    return msgspec.json.encode(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    )


class Observer:
    def __init__(self) -> None:
        self.plans: list[Plan] = []

    def attempt_closed(
        self, plan: Plan, attempt: Attempt | None, final: Mapping[str, Any], outcome: str
    ) -> None:
        self.plans.append(plan)


def _observed(h: Harness, observer: Observer, clock: datetime) -> Gateway:
    accounting = Accounting(
        h.gateway.config,
        h.ledger,
        h.budgets,
        instance="test",
        metrics=h.metrics,
        observers=[observer],
        clock=lambda: clock,
    )
    return Gateway(h.gateway.config, h.gateway.routes, accounting)


# -- a refused multi-candidate field: its denial row -----------------------------------------


@pytest.mark.parametrize(
    ("n", "recorded", "effective"),
    [
        (None, None, 1),
        (1, 1, 1),
        (3, 3, 3),
        (128, 128, 128),
        (129, None, 1),
        (0, None, 1),
        (True, None, 1),
    ],
)
async def test_a_refused_field_writes_its_denial_row(
    tmp_path: Path, n: Any, recorded: int | None, effective: int
) -> None:
    h = harness(tmp_path, {"a": (route(upstream_model="up"), ScriptedProvider([]))})
    body = {"best_of": 2, "stream": True} | ({} if n is None else {"n": n})
    before = datetime.now(UTC)
    with pytest.raises(UnknownParameter):
        await h.gateway.chat(_raw(**body), RETRIED, "req-1")
    (row,) = await h.rows()
    assert before <= row.timestamp <= datetime.now(UTC)
    assert (row.attempt, row.workload_id, row.environment) == (0, "default", "test")
    assert (row.route_id, row.model_alias, row.upstream_model) == ("a", "m", "up")
    assert (row.requested_candidate_count, row.effective_candidate_count) == (recorded, effective)
    assert (row.stream_mode, row.quota_scope, row.gateway_instance) == (True, "instance", "test")
    assert (row.policy_result, row.policy_reason, row.state) == (
        "deny",
        "unknown_multi_candidate_field",
        "denied",
    )
    assert (row.denied_by, row.client_retry_count) == ("best_of", 3)


async def test_a_refused_field_without_stream_and_upstream_model(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))})
    with pytest.raises(UnknownParameter):
        await h.chat(candidate_count=2, stream=False)
    (row,) = await h.rows()
    assert (row.upstream_model, row.stream_mode, row.client_retry_count) == ("m", False, None)


async def test_a_refused_field_on_the_legacy_endpoint_is_recorded_too(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))})
    raw = msgspec.json.encode({"model": "m", "prompt": "hi", "candidate_count": 2})
    with pytest.raises(UnknownParameter):
        await h.gateway.completions(raw, RETRIED, "req-9")
    (row,) = await h.rows("req-9")
    assert (row.request_id, row.workload_id, row.client_retry_count) == ("req-9", "default", 3)
    assert row.denied_by == "candidate_count"


# -- a request denied before it was sized: the plan the observers see -------------------------


async def test_a_policy_denial_records_an_unsized_plan(tmp_path: Path) -> None:
    clock = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
    routes = {"a": (route(), ScriptedProvider([])), "b": (route(), ScriptedProvider([]))}
    h = harness(tmp_path, routes)
    observer = Observer()
    gw = _observed(h, observer, clock)
    with pytest.raises(PolicyDenied):
        await gw.chat(
            _raw(n=9, temperature=1.0, stream=True, stream_options={"include_usage": True}),
            CALLER,
            "req-1",
        )
    (plan,) = observer.plans
    assert (plan.request_id, plan.caller, plan.alias) == ("req-1", CALLER, "m")
    assert plan.reservation == plan.attempt_reservation == Reservation(0, 0, 0)
    assert [rt.id for rt in plan.usable_routes] == ["a"]
    assert (plan.emulated, plan.stream, plan.client_wants_usage) == (False, True, True)
    assert (plan.quota_scope, plan.timestamp, plan.kind) == ("instance", clock, "chat")
    assert plan.started > 0
    (row,) = await h.rows()
    assert (row.attempt, row.reserved_cost_micros, row.stream_mode) == (0, 0, True)


async def test_a_legacy_policy_denial_is_a_completions_plan(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))})
    observer = Observer()
    gw = _observed(h, observer, datetime(2026, 11, 29, tzinfo=UTC))
    raw = msgspec.json.encode({"model": "m", "prompt": "hi", "best_of": 9, "temperature": 1})
    with pytest.raises(PolicyDenied):
        await gw.completions(raw, CALLER, "req-1")
    (plan,) = observer.plans
    assert (plan.kind, plan.stream, plan.client_wants_usage) == ("completions", False, False)


# -- sizing, contracts, fingerprints ------------------------------------------------------


async def _reserved(h: Harness, **body: Any) -> tuple[int, int]:
    reply = await h.chat(**body)
    if reply.settling:
        await settled(h.gateway)
    rows = await h.rows()
    return rows[0].reserved_input_tokens, rows[0].reserved_output_tokens


async def test_a_shared_output_cap_reserves_one_ceiling(tmp_path: Path) -> None:
    shared = NATIVE | {"output_cap": "shared"}
    h = harness(tmp_path, {"a": (route(shared), ScriptedProvider([Answer(chat_body("x", "y"))]))})
    assert await _reserved(h, n=2, temperature=1.0) == (HI_ESTIMATE, 256)


async def test_an_emulated_branch_reserves_its_own_prefill(tmp_path: Path) -> None:
    answers = [Answer(chat_body("x")), Answer(chat_body("y"))]
    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider(answers))})
    assert await _reserved(h, n=2, temperature=1.0) == (HI_ESTIMATE, 256)
    native = harness(tmp_path, {"a": (route(), ScriptedProvider([Answer(chat_body("x", "y"))]))})
    assert await _reserved(native, n=2, temperature=1.0) == (HI_ESTIMATE, 512)


async def test_a_contract_with_a_max_age_is_judged_at_the_accountings_clock(
    tmp_path: Path,
) -> None:
    verified = (datetime.now(UTC) - timedelta(days=1)).isoformat()
    fresh = NATIVE | {"max_age": "30d", "verified_at": verified}
    h = harness(tmp_path, {"a": (route(fresh), ScriptedProvider([Answer(chat_body("x", "y"))]))})
    reply = await h.chat(n=2, temperature=1.0)
    assert reply.status == 200 and reply.settling
    await settled(h.gateway)


@pytest.mark.parametrize(
    ("recorded", "stale"),
    [
        ({"provider": "gemini"}, True),
        ({"upstream_model": "other-model"}, True),
        ({"provider": "openai", "upstream_model": "up", "gateway_version": __version__}, False),
    ],
)
async def test_a_contract_verified_for_another_provider_or_model_is_stale(
    tmp_path: Path, recorded: dict[str, str], stale: bool
) -> None:
    contract = NATIVE | {"fingerprint": recorded}
    provider = ScriptedProvider([Answer(chat_body("x", "y"))])
    h = harness(tmp_path, {"a": (route(contract, upstream_model="up"), provider)})
    if stale:
        with pytest.raises(RouteContractStale):
            await h.chat(n=2, temperature=1.0)
    else:
        reply = await h.chat(n=2, temperature=1.0)
        assert reply.settling
        await settled(h.gateway)


# -- the legacy endpoint's own rules --------------------------------------------------------


def _completion_body(text: str = "ok") -> bytes:
    return msgspec.json.encode(
        {
            "id": "cmpl-up",
            "object": "text_completion",
            "created": 1,
            "model": "scripted",
            "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
    )


async def _legacy(h: Harness, request_id: str = "req-1", **body: Any) -> Any:
    raw = msgspec.json.encode({"model": "m", "prompt": "hi", **body})
    return await h.gateway.completions(raw, CALLER, request_id)


@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]]])
async def test_a_batch_of_prompts_is_refused_word_for_word(tmp_path: Path, prompt: Any) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))})
    with pytest.raises(InvalidValue) as info:
        await _legacy(h, prompt=prompt)
    assert info.value.message == (
        "Invalid value for 'prompt': the gateway takes one prompt per request (a string, one "
        "array of token ids, or an array holding one of them); send a batch as separate "
        "requests."
    )
    assert info.value.param == "prompt"


@pytest.mark.parametrize("prompt", ["one", ["one"], [1, 2, 3], [[1, 2]]])
async def test_one_prompt_in_any_form_is_served(tmp_path: Path, prompt: Any) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Answer(_completion_body())]))})
    reply = await _legacy(h, prompt=prompt)
    assert reply.status == 200 and reply.settling
    await settled(h.gateway)


def _gemini() -> dict[str, Any]:
    return route(provider="gemini", upstream_model="gemini-2.5-flash", base_url=None)


async def test_a_gemini_primary_refuses_the_legacy_endpoint_word_for_word(tmp_path: Path) -> None:
    h = harness(tmp_path, {"g": (_gemini(), ScriptedProvider([]))})
    with pytest.raises(InvalidValue) as info:
        await _legacy(h)
    assert info.value.message == (
        "This model's route is a Gemini route, which serves /v1/chat/completions only, not "
        "the legacy /v1/completions."
    )
    assert info.value.param == "model"


async def test_a_gemini_fallback_is_left_out_of_a_legacy_chain(tmp_path: Path) -> None:
    gemini = ScriptedProvider([Answer(_completion_body())])
    routes = {"a": (route(retries=0), ScriptedProvider([OVERLOADED])), "g": (_gemini(), gemini)}
    h = harness(tmp_path, routes)
    with pytest.raises(Overloaded):
        await _legacy(h)
    assert gemini.sent == []


async def test_best_of_above_n_on_an_emulating_route_word_for_word(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider([]))})
    with pytest.raises(RouteDoesNotSupportCandidates) as info:
        await _legacy(h, n=2, best_of=3, temperature=1)
    assert info.value.message == (
        "best_of > n needs the route to rank candidates itself; route a emulates n by "
        "fan-out. Send best_of equal to n."
    )
    assert info.value.param == "best_of"


def test_the_legacy_input_estimate_measures_prompt_and_suffix() -> None:
    # {"prompt":"hello world","suffix":"tail"} is 40 bytes
    body = {"prompt": "hello world", "suffix": "tail"}
    assert input_estimate(body, "completions") == 16 + 8 + 40
    # {"prompt":"hello world","suffix":null} is 38 bytes
    assert input_estimate({"prompt": "hello world"}, "completions") == 16 + 8 + 38


def test_the_chat_input_estimate_counts_tools_functions_and_format() -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],  # 30 bytes
        "tools": [{"type": "x"}],  # 14 bytes
        "functions": [{"type": "yy"}],  # 15 bytes
        "response_format": {"type": "json_object"},  # 22 bytes
    }
    assert input_estimate(body, "chat") == 16 + 8 + 30 + 14 + 15 + 22


# -- what each route receives ----------------------------------------------------------------


class Recording(ScriptedProvider):
    """The scripted provider, with each call's timeout and endpoint."""

    def __init__(self, steps: list[Any]) -> None:
        super().__init__(steps)
        self.calls: list[tuple[float, RequestKind]] = []

    async def complete(
        self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
    ) -> UpstreamResult:
        self.calls.append((timeout, kind))
        return await super().complete(body, timeout=timeout, kind=kind)

    def stream(self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat") -> Any:
        self.calls.append((timeout, kind))
        return super().stream(body, timeout=timeout, kind=kind)


async def test_each_attempt_gets_its_routes_timeout_and_endpoint(tmp_path: Path) -> None:
    text = sse(chunk(0, "hi", finish="stop"), chunk(None, usage=(3, 1)))
    provider = Recording([Answer(chat_body("x")), Stream(text), Answer(_completion_body())])
    h = harness(tmp_path, {"a": (route(timeout_s=7), provider)})
    reply = await h.chat()
    assert reply.settling
    await settled(h.gateway)
    await drain((await h.chat("req-2", stream=True)).stream)
    legacy = await _legacy(h, "req-3")
    assert legacy.settling
    await settled(h.gateway)
    assert provider.calls == [(7.0, "chat"), (7.0, "chat"), (7.0, "completions")]


async def test_an_empty_stream_ends_with_an_error_event(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Stream(b"")]))})
    reply = await h.chat(stream=True)
    out = events(await drain(reply.stream))
    assert out == [UpstreamError("The upstream stream ended early.").envelope()]
    (row,) = await h.rows()
    assert (row.state, row.reconciliation_reason) == ("pending", "stream_cut")


async def test_a_fallback_gets_only_the_extra_fields_it_allows(tmp_path: Path) -> None:
    primary = ScriptedProvider([OVERLOADED])
    fallback = ScriptedProvider([Answer(chat_body("x"))])
    routes = {"a": (route(retries=0, extra_fields=["top_k"]), primary), "b": (route(), fallback)}
    h = harness(tmp_path, routes)
    reply = await h.chat(top_k=5)
    assert reply.settling
    await settled(h.gateway)
    assert primary.sent[0]["top_k"] == 5
    assert "top_k" not in fallback.sent[0]


async def test_an_unknown_field_with_a_non_string_model_is_refused(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(extra_fields=["top_k"]), ScriptedProvider([]))})
    with pytest.raises(UnknownParameter):
        await h.chat(model=["m"], top_k=5)


async def test_a_retry_waits_the_upstreams_retry_after(tmp_path: Path) -> None:
    busy = Fail(AttemptFailed("status", 503, retry_after=2.5))
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([busy, Answer(chat_body("x"))]))})
    reply = await h.chat()
    assert reply.settling
    await settled(h.gateway)
    assert h.sleeps == [2.5]


# -- the books' own columns, the metrics of an admitted request ----------------------------


def _sqlite_budgets(tmp: Path) -> Any:
    from ncap.stores import SQLiteBudgetStore

    return SQLiteBudgetStore(tmp / "budgets-host.db")


async def test_every_row_names_the_budget_stores_real_scope(tmp_path: Path) -> None:
    budgets = _sqlite_budgets(tmp_path)
    steps = [Answer(chat_body("x"))]
    h = harness(
        tmp_path,
        {"a": (route(), ScriptedProvider(steps))},
        budgets=budgets,
        workloads={"default": {"requests_per_minute": 1}},
    )
    reply = await h.gateway.chat(_raw(), RETRIED, "req-1")
    assert reply.settling
    await settled(h.gateway)
    (answered,) = await h.rows("req-1")
    assert (answered.quota_scope, answered.client_retry_count) == ("host", 3)
    with pytest.raises(RateLimited):
        await h.chat("req-2")
    (denied,) = await h.rows("req-2")
    assert (denied.quota_scope, denied.state) == ("host", "denied")
    await budgets.close()


async def test_an_idempotent_repeat_names_the_budget_stores_real_scope(tmp_path: Path) -> None:
    from ncap.stores.sqlite.idempotency import SQLiteIdempotency

    budgets = _sqlite_budgets(tmp_path)
    h = harness(
        tmp_path, {"a": (route(), ScriptedProvider([Answer(chat_body("x"))]))}, budgets=budgets
    )
    gw = Gateway(
        h.gateway.config,
        h.gateway.routes,
        h.gateway.accounting,
        idempotency=SQLiteIdempotency(budgets),
    )
    reply = await gw.chat(_raw(), CALLER, "req-1", idempotency_key="k")
    assert reply.settling
    await settled(gw)
    with pytest.raises(IdempotencyKeyReused):
        await gw.chat(_raw(), CALLER, "req-2", idempotency_key="k")
    (row,) = await h.rows("req-2")
    assert row.quota_scope == "host"
    await budgets.close()


async def test_an_exceptions_policy_result_and_reason_reach_the_row(tmp_path: Path) -> None:
    exceptions = [
        {
            "id": "eval",
            "workload": "default",
            "owner": "o",
            "max_candidates": 8,
            "expires": "2030-01-01T00:00:00Z",
        }
    ]
    answer = Answer(chat_body(*"abcdef"))
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([answer]))}, exceptions=exceptions)
    reply = await h.chat(n=6, temperature=1.0)
    assert reply.settling
    await settled(h.gateway)
    (row,) = await h.rows()
    assert (row.policy_result, row.exception_id) == ("allow", "eval")
    assert row.policy_reason not in (None, "within_default")


async def test_each_workload_has_its_own_windows(tmp_path: Path) -> None:
    workloads = {"default": {"requests_per_minute": 100}, "tight": {"requests_per_minute": 1}}
    answers = [Answer(chat_body("x")) for _ in range(3)]
    h = harness(tmp_path, {"a": (route(), ScriptedProvider(answers))}, workloads=workloads)
    for rid in ("req-1", "req-2"):
        reply = await h.chat(rid)
        assert reply.settling
        await settled(h.gateway)
    tight = Caller("tight", "test")
    reply = await h.gateway.chat(_raw(), tight, "req-3")
    assert reply.settling
    await settled(h.gateway)
    with pytest.raises(RateLimited):
        await h.gateway.chat(_raw(), tight, "req-4")


async def test_an_admitted_request_is_counted_by_workload_and_reason(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Answer(chat_body("x", "y"))]))})
    reply = await h.chat(n=2, temperature=1.0)
    assert reply.settling
    await settled(h.gateway)
    sample = h.metrics.registry.get_sample_value
    labels = {"workload": "default", "policy_result": "allow", "reason": "within_default"}
    assert sample("ncap_requests_total", labels) == 1
    assert sample("ncap_candidates_requested_count", {"workload": "default"}) == 1
    assert sample("ncap_candidates_requested_sum", {"workload": "default"}) == 2


async def test_the_plan_of_an_admitted_request(tmp_path: Path) -> None:
    clock = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Answer(chat_body("x"))]))})
    observer = Observer()
    gw = _observed(h, observer, clock)
    reply = await gw.chat(_raw(), CALLER, "req-1")
    assert reply.settling
    await settled(gw)
    (plan,) = observer.plans
    assert (plan.timestamp, plan.alias, plan.kind) == (clock, "m", "chat")
    assert plan.started > 0


# -- what policy reads of the request --------------------------------------------------------


async def test_policy_reads_the_temperature_and_max_tokens(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))})
    with pytest.raises(PolicyDenied) as greedy:
        await h.chat("req-1", n=2, temperature=0)
    assert "temperature 0" in greedy.value.message
    with pytest.raises(PolicyDenied) as ceiling:
        await h.chat("req-2", max_tokens=5000)
    assert "5000" in ceiling.value.message


async def test_a_primary_without_a_contract_is_named_in_the_refusal(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route({}), ScriptedProvider([]))})
    with pytest.raises(RouteDoesNotSupportCandidates) as info:
        await h.chat(n=2, temperature=1.0)
    assert info.value.message.startswith("Route 'a' has no verified contract for n > 1")


async def _fallback_served(tmp_path: Path, fallback_contract: dict[str, Any]) -> list[Any]:
    fallback = ScriptedProvider([Answer(chat_body("x", "y"))])
    routes = {
        "a": (route(retries=0), ScriptedProvider([OVERLOADED])),
        "b": (route(fallback_contract, upstream_model="up"), fallback),
    }
    h = harness(tmp_path, routes)
    try:
        reply = await h.chat(n=2, temperature=1.0)
        assert reply.settling
        await settled(h.gateway)
    except Overloaded:
        pass
    return fallback.sent


async def test_a_fresh_fallback_with_a_max_age_serves(tmp_path: Path) -> None:
    verified = (datetime.now(UTC) - timedelta(days=1)).isoformat()
    assert (
        len(await _fallback_served(tmp_path, NATIVE | {"max_age": "30d", "verified_at": verified}))
        == 1
    )


async def test_a_fallback_verified_for_another_provider_is_dropped(tmp_path: Path) -> None:
    assert await _fallback_served(tmp_path, NATIVE | {"fingerprint": {"provider": "gemini"}}) == []


async def test_an_emulating_fallback_is_dropped_for_n_above_one(tmp_path: Path) -> None:
    assert await _fallback_served(tmp_path, EMULATE) == []


def _legacy_raw(**body: Any) -> bytes:
    return msgspec.json.encode({"model": "m", "prompt": "hi", **body})


async def test_the_legacy_count_is_best_of_else_n(tmp_path: Path) -> None:
    answers = [Answer(_completion_body()), Answer(_completion_body()), Answer(_completion_body())]
    h = harness(tmp_path, {"a": (route(), ScriptedProvider(answers))})
    for rid, body in (("req-1", {"best_of": 1}), ("req-2", {"n": 1})):
        reply = await h.gateway.completions(_legacy_raw(**body), CALLER, rid)
        assert reply.settling
        await settled(h.gateway)
    assert [(await h.rows(r))[0].requested_candidate_count for r in ("req-1", "req-2")] == [1, 1]


async def test_best_of_above_an_absent_n_returns_one(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Answer(_completion_body())]))})
    reply = await h.gateway.completions(_legacy_raw(best_of=3, temperature=1), CALLER, "req-1")
    assert reply.settling
    await settled(h.gateway)
    (row,) = await h.rows()
    assert (row.requested_candidate_count, row.state) == (3, "settled")


@pytest.mark.parametrize("body", [{"n": 2}, {"n": 2, "best_of": 2}])
async def test_n_candidates_all_returned_may_be_emulated(
    tmp_path: Path, body: dict[str, Any]
) -> None:
    answers = [Answer(_completion_body("a")), Answer(_completion_body("b"))]
    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider(answers))})
    reply = await h.gateway.completions(_legacy_raw(temperature=1, **body), CALLER, "req-1")
    assert reply.settling
    await settled(h.gateway)
    assert [c["index"] for c in msgspec.json.decode(reply.body)["choices"]] == [0, 1]
    assert msgspec.json.decode(reply.body)["id"] == "cmpl-req-1"


async def test_a_legacy_stream_is_opened_on_the_completions_endpoint(tmp_path: Path) -> None:
    chunk_ = {
        "id": "c",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "x", "finish_reason": "stop"}],
    }
    text = b"data: " + msgspec.json.encode(chunk_) + b"\n\ndata: [DONE]\n\n"
    provider = Recording([Stream(text)])
    h = harness(tmp_path, {"a": (route(timeout_s=7), provider)})
    reply = await h.gateway.completions(_legacy_raw(stream=True), CALLER, "req-1")
    await drain(reply.stream)
    assert provider.calls == [(7.0, "completions")]


# -- the gateway's own refusals and the Idempotency-Key switch -------------------------------


async def test_an_unknown_or_forbidden_model_word_for_word(tmp_path: Path) -> None:
    h = harness(
        tmp_path,
        {"a": (route(), ScriptedProvider([Answer(chat_body("x"))]))},
        workloads={"default": {"models": ["m"]}},
    )
    for model in ("nope", "fake-model"):
        with pytest.raises(ModelNotFound) as info:
            await h.chat(model=model)
        assert info.value.message == (
            f"The model `{model}` does not exist or you do not have access to it."
        )
        assert info.value.param == "model"
    reply = await h.chat()  # the alias the workload allows
    assert reply.settling
    await settled(h.gateway)


async def test_a_key_without_a_store_and_a_store_without_a_key(tmp_path: Path) -> None:
    from ncap.stores.memory.idempotency import MemoryIdempotency

    answers = [Answer(chat_body("x")), Answer(chat_body("y"))]
    h = harness(tmp_path, {"a": (route(), ScriptedProvider(answers))})
    reply = await h.gateway.chat(_raw(), CALLER, "req-1", idempotency_key="k")  # no store
    assert reply.settling
    await settled(h.gateway)
    gw = Gateway(
        h.gateway.config, h.gateway.routes, h.gateway.accounting, idempotency=MemoryIdempotency()
    )
    reply = await gw.chat(_raw(), CALLER, "req-2")  # no key: no hook
    assert reply.settling
    await settled(gw)


async def test_a_legacy_best_of_of_zero_counts_as_absent(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Answer(_completion_body())]))})
    reply = await h.gateway.completions(_legacy_raw(best_of=0), CALLER, "req-1")
    assert reply.settling
    await settled(h.gateway)
    (row,) = await h.rows()
    assert (row.requested_candidate_count, row.effective_candidate_count) == (None, 1)


async def test_a_legacy_best_of_over_the_maximum_is_refused_by_that_name(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))})
    with pytest.raises(PolicyDenied) as info:
        await _legacy(h, best_of=9, temperature=1)
    assert info.value.param == "best_of"
    assert info.value.message.startswith("best_of=9 exceeds the approved maximum of ")


async def test_a_legacy_max_tokens_of_zero_reserves_one_token_a_candidate(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Answer(_completion_body())]))})
    reply = await _legacy(h, max_tokens=0)
    if reply.settling:
        await settled(h.gateway)
    (row,) = await h.rows()
    assert row.reserved_output_tokens == 1  # a bound, never short, and no more


async def test_a_decision_taken_for_one_request_shape_follows_the_grants_and_the_clock(
    tmp_path: Path,
) -> None:
    """Admission remembers an allowed decision per workload and request shape; it is
    taken again once an exception of the workload expires, when the clock is set back
    before a grant's expiry, and when the grants change (the admin API: a new grant,
    a revoked one)."""
    from ncap.config import ExceptionGrant
    from ncap.domain.grants import GrantChanges

    expires = datetime(2030, 1, 1, tzinfo=UTC)
    grant = {"id": "eval", "workload": "default", "owner": "o", "max_candidates": 8}
    now = [expires - timedelta(seconds=1)]
    answers = [Answer(chat_body(*"abcdef")) for _ in range(4)]
    h = harness(
        tmp_path,
        {"a": (route(), ScriptedProvider(answers))},
        exceptions=[{**grant, "expires": expires.isoformat()}],
    )
    gw = Gateway(h.gateway.config, h.gateway.routes, _books(h, lambda: now[0]))

    async def ask(request_id: str) -> None:
        reply = await gw.chat(_raw(n=6, temperature=1.0), CALLER, request_id)
        assert reply.settling
        await settled(gw)

    await ask("req-1")  # the exception allows n=6 (the workload 4)
    now[0] = expires  # it has expired: the same shape is refused
    with pytest.raises(PolicyDenied):
        await gw.chat(_raw(n=6, temperature=1.0), CALLER, "req-2")
    now[0] = expires - timedelta(minutes=1)  # set back: it is live again
    await ask("req-3")
    now[0] = expires + timedelta(days=1)
    with pytest.raises(PolicyDenied):
        await gw.chat(_raw(n=6, temperature=1.0), CALLER, "req-4")
    later = ExceptionGrant(**{**grant, "id": "eval-2"}, expires=expires + timedelta(days=30))
    gw.accounting.grants.apply(GrantChanges(exceptions=(later,), revoked_exceptions=frozenset()))
    await ask("req-5")  # a new grant: allowed at once
    gw.accounting.grants.apply(GrantChanges(revoked_exceptions=frozenset({"eval-2"})))
    with pytest.raises(PolicyDenied):  # revoked: refused at once
        await gw.chat(_raw(n=6, temperature=1.0), CALLER, "req-6")
    rows = {rid: (await h.rows(rid))[0] for rid in ("req-1", "req-2", "req-3", "req-5")}
    assert [r.policy_result for r in rows.values()] == ["allow", "deny", "allow", "allow"]
    assert rows["req-2"].policy_reason == "candidate_count_exceeds_policy"
    assert rows["req-5"].exception_id == "eval-2"


def _books(h: Harness, clock: Any) -> Accounting:
    return Accounting(
        h.gateway.config, h.ledger, h.budgets, instance="test", metrics=h.metrics, clock=clock
    )
