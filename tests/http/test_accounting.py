"""Policy before dispatch, per-attempt ledger rows and their budget effect,
through the real gateway in front of the fake upstream."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ncap.domain.events import LedgerEvent
from ncap.domain.reservation import estimate_input_tokens
from ncap.stores import SQLiteBudgetStore, SQLiteLedgerStore
from ncap.stores.ports import Hold
from ncap.testing.fake_upstream import FakeState
from tests.support import ServerThread, gateway, gateway_config
from tests.wire import validate_chunk, validate_response

MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "Pick a number."}]
BODY: dict[str, Any] = {"model": "fake-model", "messages": MESSAGES}


async def rows(tmp: Path, request_id: str | None = None) -> list[LedgerEvent]:
    store = SQLiteLedgerStore(tmp / "ledger.db")
    try:
        if request_id is not None:
            return await store.get(request_id)
        return [e async for e in store.export()]
    finally:
        await store.close()


async def holds(tmp: Path) -> list[Hold]:
    store = SQLiteBudgetStore(tmp / "budgets.db", gateway_instance="reader")
    try:
        return await store.outstanding()
    finally:
        await store.close()


async def settled_rows(tmp: Path, request_id: str, count: int = 1) -> list[LedgerEvent]:
    """An answered attempt settles beside (non-streamed) or just after (streamed) its
    last byte, its reserved row being durable already: wait for the final state."""
    deadline = time.monotonic() + 5
    while True:
        found = await rows(tmp, request_id)
        if len(found) >= count and all(r.state != "reserved" for r in found):
            return found
        assert time.monotonic() < deadline, found
        await asyncio.sleep(0.05)


async def final_rows(tmp: Path) -> list[LedgerEvent]:
    deadline = time.monotonic() + 10
    while True:
        found = await rows(tmp)
        if all(e.state != "reserved" for e in found):
            return found
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


@pytest.fixture
def faulty(fake: tuple[str, FakeState], tmp_path: Path) -> Iterator[Any]:
    """Start a gateway whose route sends the given fault headers upstream."""
    servers: list[Any] = []

    def start(headers: dict[str, str], **config: Any) -> ServerThread:
        route = {"headers": headers, **config.pop("route", {})}
        cfg = gateway_config(fake[0], tmp_path, routes={"fake": route}, **config)
        cm = gateway(cfg)
        servers.append(cm)
        return cm.__enter__()

    yield start
    for cm in servers:
        cm.__exit__(None, None, None)


def _fail_once(fault: str) -> dict[str, str]:
    return {"x-fake-fault": fault, "x-fake-fail-times": "1", "x-fake-fail-key": uuid.uuid4().hex}


async def post(gw: ServerThread, body: dict[str, Any], **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        return await client.post("/v1/chat/completions", json=body, **kw)


# -- denial before dispatch -------------------------------------------------------------


async def test_denied_request_makes_no_upstream_call(
    gw: ServerThread, fake_state: FakeState, tmp_path: Path
) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x")  # default: 2 retries
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**BODY, n=5)
    assert info.value.code == "candidate_count_exceeds_policy"
    assert info.value.param == "n"
    assert "4" in info.value.message  # the maximum is stated
    assert fake_state.stats()["requests"] == 0
    events = await rows(tmp_path)
    assert len(events) == 1  # one event: the SDK did not retry
    (event,) = events
    assert (event.state, event.policy_result, event.policy_reason) == (
        "denied",
        "deny",
        "candidate_count_exceeds_policy",
    )
    assert (event.requested_candidate_count, event.effective_candidate_count) == (5, 5)
    assert await holds(tmp_path) == []


@pytest.mark.parametrize(
    ("extra", "code", "param"),
    [
        ({"n": 2, "temperature": 0}, "candidates_with_greedy_sampling", "n"),
        ({"max_completion_tokens": 5000}, "output_ceiling_exceeds_policy", "max_completion_tokens"),
        ({"max_tokens": 5000}, "output_ceiling_exceeds_policy", "max_tokens"),
    ],
)
async def test_policy_denials(
    gw: ServerThread,
    fake_state: FakeState,
    tmp_path: Path,
    extra: dict[str, Any],
    code: str,
    param: str,
) -> None:
    r = await post(gw, {**BODY, **extra})
    assert r.status_code == 400
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param)
    assert r.headers["x-should-retry"] == "false"
    assert fake_state.stats()["requests"] == 0
    assert [e.state for e in await rows(tmp_path)] == ["denied"]


async def test_route_without_contract_refuses_n_above_one(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    cfg = gateway_config(fake[0], tmp_path, routes={"fake": {"contract": {"candidates": None}}})
    fake[1].reset()
    with gateway(cfg) as gw:
        denied = await post(gw, {**BODY, "n": 2})
        allowed = await post(gw, BODY)
    assert denied.json()["error"]["code"] == "route_does_not_support_candidates"
    assert allowed.status_code == 200
    assert fake[1].stats()["requests"] == 1


def _emulated(fake: tuple[str, FakeState], tmp: Path, **route: Any) -> Any:
    contract = {"candidates": "emulate", "max_candidates": 8}
    return gateway_config(fake[0], tmp, routes={"fake": {"contract": contract, **route}})


async def test_emulated_route_fans_out_single_candidate_requests(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    fake[1].reset()
    with gateway(_emulated(fake, tmp_path)) as gw:
        r = await post(gw, {**BODY, "n": 3, "max_completion_tokens": 40})
        events = await settled_rows(tmp_path, r.headers["x-request-id"], 3)
    body = r.json()
    validate_response(body)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert r.headers["x-ncap-candidates-returned"] == "3"
    sent = fake[1].stats()["recent_bodies"]
    assert len(sent) == 3 and all("n" not in b for b in sent)  # k single-candidate calls
    each = [
        (e.attempt, e.state, e.returned_candidate_count, e.effective_candidate_count)
        for e in events
    ]
    assert each == [(1, "settled", 1, 3), (2, "settled", 1, 3), (3, "settled", 1, 3)]
    # every prefill is paid and recorded; the response's usage is their sum
    assert body["usage"]["prompt_tokens"] == sum(e.input_tokens or 0 for e in events)
    assert body["usage"]["completion_tokens"] == sum(e.output_tokens_total or 0 for e in events)
    assert [e.reserved_output_tokens for e in events] == [40, 40, 40]
    assert int(r.headers["x-ncap-reserved-tokens"]) == sum(
        e.reserved_input_tokens + e.reserved_output_tokens for e in events
    )
    assert await holds(tmp_path) == []


@pytest.mark.parametrize("stream", [False, True])
async def test_emulated_branches_get_consecutive_seeds(
    fake: tuple[str, FakeState], tmp_path: Path, stream: bool
) -> None:
    """A client's seed s reaches branch i as s + i: k independent draws, not k copies."""
    fake[1].reset()
    with gateway(_emulated(fake, tmp_path)) as gw:
        r = await post(gw, {**BODY, "n": 4, "seed": 7, "stream": stream})
        await settled_rows(tmp_path, r.headers["x-request-id"], 4)
    assert r.status_code == 200
    sent = fake[1].stats()["recent_bodies"]
    assert sorted(b["seed"] for b in sent) == [7, 8, 9, 10]
    assert all("n" not in b for b in sent)


async def test_emulated_branches_without_seed_send_none(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    fake[1].reset()
    with gateway(_emulated(fake, tmp_path)) as gw:
        r = await post(gw, {**BODY, "n": 3})
        await settled_rows(tmp_path, r.headers["x-request-id"], 3)
    assert all("seed" not in b for b in fake[1].stats()["recent_bodies"])


async def test_emulated_fan_out_is_all_or_nothing(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    key = uuid.uuid4().hex
    headers = {"x-fake-fault": "overloaded", "x-fake-fail-times": "1", "x-fake-fail-key": key}
    with gateway(_emulated(fake, tmp_path, headers=headers)) as gw:
        r = await post(gw, {**BODY, "n": 3})
        events = await final_rows(tmp_path)
    assert (r.status_code, r.json()["error"]["code"]) == (503, "server_is_overloaded")
    states = sorted((e.state, e.returned_candidate_count) for e in events)
    # the refused branch cost nothing; the two answered ones were paid and are settled
    assert states == [("settled", 0), ("settled", 1), ("settled", 1)]
    assert await holds(tmp_path) == []


def _sse(text: str) -> list[Any]:
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


@pytest.mark.parametrize("include_usage", [True, False])
async def test_emulated_stream_merges_branches_by_index(
    fake: tuple[str, FakeState], tmp_path: Path, include_usage: bool
) -> None:
    fake[1].reset()
    body = {**BODY, "n": 3, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with gateway(_emulated(fake, tmp_path)) as gw:
        r = await post(gw, body)
        events = await settled_rows(tmp_path, r.headers["x-request-id"], 3)
    assert r.text.endswith("data: [DONE]\n\n")
    chunks = _sse(r.text)
    for chunk in chunks:
        validate_chunk(chunk)
    finish = {c["index"]: c["finish_reason"] for ch in chunks for c in ch["choices"]
              if c["finish_reason"]}  # fmt: skip
    assert finish == {0: "stop", 1: "stop", 2: "stop"}
    usages = [ch["usage"] for ch in chunks if ch.get("usage")]
    assert len(fake[1].stats()["recent_bodies"]) == 3
    assert [(e.state, e.usage_source, e.returned_candidate_count) for e in events] == [
        ("settled", "provider_stream", 1)
    ] * 3
    if include_usage:
        (usage,) = usages
        assert usage["completion_tokens"] == sum(e.output_tokens_total or 0 for e in events)
        assert usage["prompt_tokens"] == sum(e.input_tokens or 0 for e in events)
    else:
        assert usages == []
    assert await holds(tmp_path) == []


async def test_emulated_stream_branch_reset_ends_with_an_error_and_holds(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    faults = {"x-fake-fault": "reset_mid_stream=3,slow_chunks=30"}
    with gateway(_emulated(fake, tmp_path, headers=faults)) as gw:
        r = await post(gw, {**BODY, "n": 2, "stream": True})
        events = await final_rows(tmp_path)
    assert "[DONE]" not in r.text
    assert r.text.rstrip().splitlines()[-1].startswith('data: {"error"')
    assert {(e.state, e.reconciliation_reason) for e in events} == {("pending", "stream_cut")}
    assert {h.state for h in await holds(tmp_path)} == {"kept"}


@pytest.mark.parametrize(
    "contract",
    [
        {"verified_at": "2026-01-01T00:00:00Z", "max_age": "30d"},  # too old
        {"max_age": "30d"},  # never verified
        {"fingerprint": {"upstream_model": "another-model"}},  # verified for something else
    ],
)
async def test_stale_contract_refuses_n_above_one(
    fake: tuple[str, FakeState], tmp_path: Path, contract: dict[str, Any]
) -> None:
    cfg = gateway_config(fake[0], tmp_path, routes={"fake": {"contract": contract}})
    fake[1].reset()
    with gateway(cfg) as gw:
        stale = await post(gw, {**BODY, "n": 2})
        single = await post(gw, BODY)
    assert (stale.status_code, stale.json()["error"]["code"]) == (400, "route_contract_stale")
    assert single.status_code == 200
    assert fake[1].stats()["requests"] == 1
    reasons = [e.policy_reason for e in await rows(tmp_path)]
    assert reasons == ["route_contract_stale", "within_default"]


async def test_omitted_n_is_recorded_as_null(
    gw: ServerThread, fake_state: FakeState, tmp_path: Path
) -> None:
    r = await post(gw, BODY)
    assert r.headers["x-ncap-candidates-requested"] == "omitted"
    (event,) = await settled_rows(tmp_path, r.headers["x-request-id"])
    assert event.requested_candidate_count is None
    assert event.effective_candidate_count == 1
    assert event.returned_candidate_count == 1
    assert event.state == "settled"
    assert event.usage_source == "provider_response"
    # the request set no ceiling: the gateway sent the one it reserved for
    (sent,) = fake_state.stats()["recent_bodies"]
    assert sent["max_completion_tokens"] == 256
    assert event.reserved_output_tokens == 256


async def test_settled_row_replaces_reservation(gw: ServerThread, tmp_path: Path) -> None:
    r = await post(gw, {**BODY, "n": 3, "max_completion_tokens": 50})
    (event,) = await settled_rows(tmp_path, r.headers["x-request-id"])
    assert event.state == "settled"
    assert event.reserved_output_tokens == 3 * 50
    assert event.reserved_input_tokens == estimate_input_tokens(MESSAGES)
    assert int(r.headers["x-ncap-reserved-tokens"]) == (
        event.reserved_input_tokens + event.reserved_output_tokens
    )
    usage = r.json()["usage"]
    assert (event.input_tokens, event.output_tokens_total) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert event.cost_micros is not None and event.cost_micros <= event.reserved_cost_micros
    assert event.finish_reasons == {"stop": 3}
    assert await holds(tmp_path) == []


# -- the fault matrix -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "returned", "reason"),
    [
        ("extra_choices", 3, "returned_mismatch"),
        ("fewer_choices", 1, "returned_mismatch"),
        ("missing_usage", 2, "usage_missing"),
    ],
)
async def test_non_stream_mismatch_is_flagged_and_held(
    faulty: Any, tmp_path: Path, fault: str, returned: int, reason: str
) -> None:
    gw = faulty({"x-fake-fault": fault})
    r = await post(gw, {**BODY, "n": 2})
    assert r.status_code == 200
    assert r.headers["x-ncap-candidates-returned"] == str(returned)
    (event,) = await settled_rows(tmp_path, r.headers["x-request-id"])
    assert event.state == "usage_reconciliation_required"
    assert event.reconciliation_reason == reason
    assert event.returned_candidate_count == returned
    assert event.provider_request_id is not None
    assert event.cost_micros is None  # never guessed
    (hold,) = await holds(tmp_path)
    assert (hold.state, hold.tokens) == ("kept", event.reserved_input_tokens + 512)


async def test_stream_without_usage_stays_pending(faulty: Any, tmp_path: Path) -> None:
    gw = faulty({"x-fake-fault": "stream_no_usage"})
    r = await post(gw, {**BODY, "n": 2, "stream": True})
    assert r.text.endswith("data: [DONE]\n\n")
    (event,) = await settled_rows(tmp_path, r.headers["x-request-id"])
    assert (event.state, event.reconciliation_reason) == ("pending", "usage_missing")
    assert event.usage_source == "none"
    assert event.returned_candidate_count == 2
    assert [h.state for h in await holds(tmp_path)] == ["kept"]


async def test_stream_with_usage_settles(gw: ServerThread, tmp_path: Path) -> None:
    r = await post(gw, {**BODY, "n": 2, "stream": True})
    (event,) = await settled_rows(tmp_path, r.headers["x-request-id"])
    assert (event.state, event.usage_source) == ("settled", "provider_stream")
    assert event.output_tokens_total and event.output_tokens_total > 0
    assert await holds(tmp_path) == []


async def test_client_disconnect_mid_stream_stays_pending(
    faulty: Any, fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    gw = faulty({"x-fake-fault": "slow_chunks", "x-fake-chunk-delay-ms": "100"})
    async with (
        httpx.AsyncClient(base_url=gw.url, timeout=10) as client,
        client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r,
    ):
        request_id = r.headers["x-request-id"]
        async for _line in r.aiter_lines():
            break  # the client leaves after the first event
    (event,) = await settled_rows(tmp_path, request_id)
    assert (event.state, event.reconciliation_reason) == ("pending", "stream_cut")
    assert [h.state for h in await holds(tmp_path)] == ["kept"]
    deadline = time.monotonic() + 3
    while fake[1].stats()["in_flight"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert fake[1].stats()["in_flight"] == 0  # the upstream request was cancelled too


async def test_upstream_reset_mid_stream(faulty: Any, tmp_path: Path) -> None:
    # paced chunks: the reset lands after the first event reached the client
    faults = "reset_mid_stream=3,slow_chunks=30"
    gw = faulty({"x-fake-fault": faults})
    r = await post(gw, {**BODY, "n": 2, "stream": True})
    assert r.text.startswith("data: ") and "[DONE]" not in r.text
    assert r.text.rstrip().splitlines()[-1].startswith('data: {"error"')
    (event,) = await settled_rows(tmp_path, r.headers["x-request-id"])
    assert (event.state, event.reconciliation_reason) == ("pending", "stream_cut")
    assert [h.state for h in await holds(tmp_path)] == ["kept"]


async def test_429_then_success_writes_two_attempts(faulty: Any, tmp_path: Path) -> None:
    gw = faulty(_fail_once("rate_limit=0"))
    r = await post(gw, BODY)
    assert r.status_code == 200
    first, second = await settled_rows(tmp_path, r.headers["x-request-id"], 2)
    assert (first.attempt, first.state, first.cost_micros) == (1, "settled", 0)
    assert first.returned_candidate_count == 0
    assert (second.attempt, second.state) == (2, "settled")
    assert second.output_tokens_total
    assert await holds(tmp_path) == []


async def test_timeout_then_success_keeps_first_attempt_open(faulty: Any, tmp_path: Path) -> None:
    gw = faulty(_fail_once("timeout"), route={"timeout_s": 0.3})
    r = await post(gw, BODY)
    assert r.status_code == 200
    first, second = await settled_rows(tmp_path, r.headers["x-request-id"], 2)
    assert (first.state, first.reconciliation_reason) == (
        "usage_reconciliation_required",
        "timeout",
    )
    assert first.cost_micros is None
    assert second.state == "settled"
    (hold,) = await holds(tmp_path)  # the timed-out attempt's reservation stays held
    assert hold.hold_id.endswith("#1") and hold.state == "kept"


async def test_fallback_after_503(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    primary = {
        "provider": "openai",
        "base_url": fake[0],
        "upstream_model": "fake-model",
        "retries": 1,
        "backoff_s": 0.01,
        "headers": {"x-fake-fault": "overloaded"},
        "contract": {"candidates": "native", "max_candidates": 8},
    }
    cfg = gateway_config(
        fake[0],
        tmp_path,
        models={"fake-model": ["primary", "fake"]},
        routes={"primary": primary},
    )
    with gateway(cfg) as gw:
        r = await post(gw, {**BODY, "n": 2})
    assert r.status_code == 200
    assert r.headers["x-ncap-route"] == "fake"
    events = await settled_rows(tmp_path, r.headers["x-request-id"], 3)
    assert [(e.attempt, e.route_id, e.state) for e in events] == [
        (1, "primary", "settled"),
        (2, "primary", "settled"),
        (3, "fake", "settled"),
    ]
    assert [e.cost_micros for e in events[:2]] == [0, 0]
    assert events[2].returned_candidate_count == 2


async def test_fallback_without_contract_is_not_used_for_n_above_one(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    primary = {
        "provider": "openai",
        "base_url": fake[0],
        "retries": 0,
        "headers": {"x-fake-fault": "overloaded"},
        "contract": {"candidates": "native", "max_candidates": 8},
    }
    cfg = gateway_config(
        fake[0],
        tmp_path,
        models={"fake-model": ["primary", "fake"]},
        routes={"primary": primary, "fake": {"contract": {"candidates": "unsupported"}}},
    )
    with gateway(cfg) as gw:
        multi = await post(gw, {**BODY, "n": 2})
        single = await post(gw, BODY)
    assert multi.status_code == 503  # the fallback cannot serve n=2: not used
    assert single.status_code == 200 and single.headers["x-ncap-route"] == "fake"


# -- concurrency against a budget -------------------------------------------------------


async def _burst_against_50_reservations(
    fake: tuple[str, FakeState], tmp: Path, latency_ms: int
) -> tuple[list[httpx.Response], list[LedgerEvent], int, bool]:
    ceiling = 100
    per_request = estimate_input_tokens(MESSAGES) + ceiling
    cfg = gateway_config(
        fake[0],
        tmp,
        routes={"fake": {"headers": {"x-fake-fault": f"latency={latency_ms}"}, "timeout_s": 60}},
        workloads={
            "default": {
                "max_candidates": 4,
                "max_concurrency": None,
                "tokens_per_day": 50 * per_request,
            }
        },
    )
    fake[1].reset()
    body = {**BODY, "max_completion_tokens": ceiling}
    limits = httpx.Limits(max_connections=200)
    with gateway(cfg) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=90, limits=limits) as client:
            responses = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for _ in range(200))
            )
        events = await final_rows(tmp)
    # the scenario needs every request decided before the first one settles (settling
    # frees budget): checked on the ledger's own clock, not assumed from the latency
    decided = max(e.timestamp for e in events)
    first_settled = min(
        e.timestamp + timedelta(milliseconds=e.latency_ms or 0)
        for e in events
        if e.state == "settled"
    )
    return responses, events, per_request, decided < first_settled


async def test_200_concurrent_requests_against_50_reservations(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    # a slow machine gets a slower upstream: the latency grows until all 200 requests
    # were admitted or denied while the first 50 were still upstream
    for attempt, latency_ms in enumerate((3000, 8000, 20000)):
        tmp = tmp_path / f"run{attempt}"
        tmp.mkdir()
        responses, events, per_request, valid = await _burst_against_50_reservations(
            fake, tmp, latency_ms
        )
        if valid:
            break
    assert valid, "the machine could not decide 200 requests within 20 s"
    codes = [r.status_code for r in responses]
    assert codes.count(200) == 50
    assert codes.count(429) == 150
    assert {r.json()["error"]["code"] for r in responses if r.status_code == 429} == {
        "budget_exhausted"
    }
    assert fake[1].stats()["requests"] == 50
    settled = [e for e in events if e.state == "settled"]
    assert len(settled) == 50
    assert len([e for e in events if e.state == "denied"]) == 150
    assert sum(e.total_tokens or 0 for e in settled) <= 50 * per_request


async def test_extra_fields_reach_only_the_routes_that_allow_them(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    primary = {
        "provider": "openai",
        "base_url": fake[0],
        "upstream_model": "fake-model",
        "retries": 0,
        "extra_fields": ["top_k"],
        "headers": {"x-fake-fault": "overloaded"},
    }
    cfg = gateway_config(
        fake[0], tmp_path, models={"fake-model": ["primary", "fake"]}, routes={"primary": primary}
    )
    fake[1].reset()
    with gateway(cfg) as gw:
        r = await post(gw, {**BODY, "top_k": 5})
    assert r.status_code == 200 and r.headers["x-ncap-route"] == "fake"
    first, second = fake[1].stats()["recent_bodies"]
    assert first["top_k"] == 5  # the route that allows it got it
    assert "top_k" not in second  # the fallback that does not, did not


@pytest.mark.parametrize(("stream_usage", "asked"), [("include_usage", True), ("none", False)])
async def test_gateway_asks_for_stream_usage_only_where_the_contract_allows(
    fake: tuple[str, FakeState], tmp_path: Path, stream_usage: str, asked: bool
) -> None:
    cfg = gateway_config(
        fake[0], tmp_path, routes={"fake": {"contract": {"stream_usage": stream_usage}}}
    )
    fake[1].reset()
    with gateway(cfg) as gw:
        r = await post(gw, {**BODY, "stream": True})
        (event,) = await settled_rows(tmp_path, r.headers["x-request-id"])
    (sent,) = fake[1].stats()["recent_bodies"]
    assert ("stream_options" in sent) is asked
    assert '"usage":{' not in r.text  # the client did not ask: never relayed
    assert event.state == ("settled" if asked else "pending")
