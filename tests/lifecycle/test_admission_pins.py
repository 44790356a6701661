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
    InvalidValue,
    Overloaded,
    PolicyDenied,
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
from tests.lifecycle.harness import CALLER, EMULATE, NATIVE, Harness, drain, events, harness, route

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
    [(None, None, 1), (1, 1, 1), (3, 3, 3), (128, 128, 128), (129, None, 1), (0, None, 1),
     (True, None, 1)],
)  # fmt: skip
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
        "deny", "unknown_multi_candidate_field", "denied",
    )  # fmt: skip
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
        await gw.chat(_raw(n=9, temperature=1.0, stream=True,
                           stream_options={"include_usage": True}), CALLER, "req-1")  # fmt: skip
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
    if reply.after is not None:
        await reply.after
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
    assert reply.status == 200 and reply.after is not None
    await reply.after


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
        assert reply.after is not None
        await reply.after


# -- the legacy endpoint's own rules --------------------------------------------------------


def _completion_body(text: str = "ok") -> bytes:
    return msgspec.json.encode({
        "id": "cmpl-up", "object": "text_completion", "created": 1, "model": "scripted",
        "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    })  # fmt: skip


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
    assert reply.status == 200 and reply.after is not None
    await reply.after


def _gemini() -> dict[str, Any]:
    return route(provider="gemini", upstream_model="gemini-2.5-flash", base_url=None)


async def test_a_gemini_primary_refuses_the_legacy_endpoint_word_for_word(tmp_path: Path) -> None:
    h = harness(tmp_path, {"g": (_gemini(), ScriptedProvider([]))})
    with pytest.raises(InvalidValue) as info:
        await _legacy(h)
    assert info.value.message == (
        "This model's route is a Gemini route, which serves /v1/chat/completions only, not the "
        "legacy /v1/completions."
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
    # {"prompt":"ab","suffix":"c"} is 28 bytes
    assert input_estimate({"prompt": "ab", "suffix": "c"}, "completions") == 16 + 8 + 28
    # {"prompt":"ab","suffix":null} is 29 bytes
    assert input_estimate({"prompt": "ab"}, "completions") == 16 + 8 + 29


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

    def stream(self, body: Mapping[str, Any], *, timeout: float, kind: RequestKind = "chat"
               ) -> Any:  # fmt: skip
        self.calls.append((timeout, kind))
        return super().stream(body, timeout=timeout, kind=kind)


async def test_each_attempt_gets_its_routes_timeout_and_endpoint(tmp_path: Path) -> None:
    text = sse(chunk(0, "hi", finish="stop"), chunk(None, usage=(3, 1)))
    provider = Recording([Answer(chat_body("x")), Stream(text), Answer(_completion_body())])
    h = harness(tmp_path, {"a": (route(timeout_s=7), provider)})
    reply = await h.chat()
    assert reply.after is not None
    await reply.after
    await drain((await h.chat("req-2", stream=True)).stream)
    legacy = await _legacy(h, "req-3")
    assert legacy.after is not None
    await legacy.after
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
    routes = {"a": (route(retries=0, extra_fields=["top_k"]), primary),
              "b": (route(), fallback)}  # fmt: skip
    h = harness(tmp_path, routes)
    reply = await h.chat(top_k=5)
    assert reply.after is not None
    await reply.after
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
    assert reply.after is not None
    await reply.after
    assert h.sleeps == [2.5]
