"""Pins found by mutation testing (docs/mutation.md): what each failure class tells the
client, word for word, with its retry delay; the lifecycle's fast, socket-free killers
of mutants the wider lifecycle tests let through."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ncap.config import parse_route
from ncap.domain.reservation import Reservation
from ncap.errors import (
    InvalidRequest,
    Overloaded,
    RateLimited,
    SlowDown,
    StoreUnavailable,
    UpstreamError,
    UpstreamTimeout,
)
from ncap.lifecycle import Caller, attempts
from ncap.lifecycle.asked import candidate_param
from ncap.lifecycle.attempt_report import Tally, summed_usage
from ncap.lifecycle.failures import as_failure, client_error, ledger_outcome
from ncap.lifecycle.final_row import _whole_need
from ncap.lifecycle.plan import RouteRuntime
from ncap.lifecycle.settlement import Deferred, Steps
from ncap.protocol.chat import ChatCompletionRequest
from ncap.protocol.completions import CompletionRequest
from ncap.protocol.responses import ResponseSummary, SummaryUsage, SummaryUsageDetails
from ncap.providers.base import AttemptFailed, UpstreamErrorDetail
from ncap.stores import MemoryLedgerStore
from ncap.stores.ports import hold_id_for
from ncap.testing.scripted import Answer, Fail, ScriptedProvider, Stream, chat_body, chunk, sse
from tests.lifecycle.harness import CALLER, EMULATE, drain, events, harness, route, settled

OVERLOADED_503 = Fail(AttemptFailed("status", 503))
RATE = UpstreamErrorDetail("Rate limit reached", code="rate_limit_exceeded")

EXACT: list[tuple[AttemptFailed, type, str, float | None]] = [
    (AttemptFailed("status", 429, retry_after=3.0, error=RATE), RateLimited,
     "The upstream rate limit was reached.", 3.0),
    (AttemptFailed("status", 429, retry_after=2.5), SlowDown,
     "Your request rate increased too quickly upstream. Please back off.", 2.5),
    (AttemptFailed("status", 503, retry_after=1.5), Overloaded,
     "The model is temporarily overloaded. Please retry your request after a brief delay.",
     1.5),
    (AttemptFailed("status", 404), UpstreamError,
     "The upstream rejected the request (status 404).", None),
    (AttemptFailed("status", 413), UpstreamError, "The upstream answered with status 413.", None),
    (
        AttemptFailed("status", 403),
        UpstreamError,
        "The upstream provider refused the gateway's credential for this route.",
        None,
    ),
    (AttemptFailed("timeout"), UpstreamError, "The upstream did not answer in time.", None),
    (AttemptFailed("connection"), UpstreamError, "The upstream failed to answer.", None),
]  # fmt: skip


@pytest.mark.parametrize(("failure", "kind", "message", "retry_after"), EXACT)
def test_each_client_error_word_for_word(
    failure: AttemptFailed, kind: type, message: str, retry_after: float | None
) -> None:
    error = client_error(failure)
    assert isinstance(error, kind)
    assert (error.message, error.retry_after) == (message, retry_after)


def test_a_relayed_400_without_param_or_code() -> None:
    error = client_error(AttemptFailed("status", 422, error=UpstreamErrorDetail("Nope")))
    assert isinstance(error, InvalidRequest)
    assert (error.message, error.param, error.code) == ("Upstream: Nope", None, "invalid_value")


def _usage(prompt: int | None, completion: int | None, cached: int | None = None) -> SummaryUsage:
    details = SummaryUsageDetails(cached_tokens=cached) if cached is not None else None
    return SummaryUsage(prompt, completion, prompt_tokens_details=details)


SUMS: list[tuple[list[SummaryUsage | None], dict[str, Any] | None]] = [
    ([_usage(3, 4), _usage(3, 5)],
     {"prompt_tokens": 6, "completion_tokens": 9, "total_tokens": 15}),
    ([_usage(3, 4, cached=2), _usage(3, 5), _usage(3, 1, cached=3)],
     {"prompt_tokens": 9, "completion_tokens": 10, "total_tokens": 19,
      "prompt_tokens_details": {"cached_tokens": 5}}),
    ([_usage(3, 4), _usage(3, None)], None),  # one count missing: the total is unknown
    ([_usage(None, 4), _usage(3, 4)], None),
    ([_usage(3, 4), None], None),
]  # fmt: skip


@pytest.mark.parametrize(("usages", "expected"), SUMS)
def test_summed_usage(usages: list[SummaryUsage | None], expected: dict[str, Any] | None) -> None:
    assert summed_usage(usages) == expected


WHOLE = Reservation(input_tokens=10, output_tokens=30, cost_micros=777)


@pytest.mark.parametrize(
    ("window", "need"),
    [("tokens_per_day", 40), ("tokens_per_minute", 40), ("usd_per_day", 777),
     ("usd_per_month", 777), ("exception", 777), ("requests_per_minute", 3),
     ("concurrency", 3)],
)  # fmt: skip
def test_a_denied_emulated_request_names_what_the_whole_fan_out_needed(
    window: str, need: int
) -> None:
    assert _whole_need(window, WHOLE, 3) == need


ROW_FIELDS = (
    "request_id", "attempt", "workload_id", "environment", "route_id", "model_alias",
    "upstream_model", "requested_candidate_count", "effective_candidate_count",
    "exception_id", "reserved_input_tokens", "reserved_output_tokens",
    "reserved_cost_micros", "stream_mode", "quota_scope", "policy_result",
    "policy_reason", "gateway_instance", "provider_request_id", "input_tokens",
    "output_tokens_total", "total_tokens", "state",
)  # fmt: skip


async def test_every_identity_field_of_an_answered_row(tmp_path: Path) -> None:
    """Each column ``Accounting.row`` writes, from where it comes (a field dropped or
    taken from elsewhere fails), and the metrics the attempt feeds."""
    provider = ScriptedProvider([Answer(chat_body("a", "b", usage=(10, 8)))])
    h = harness(tmp_path, {"a": (route(upstream_model="up-model"), provider)})
    before = datetime.now(UTC)
    reply = await h.chat(n=2, temperature=1.0)
    assert reply.settling
    await settled(h.gateway)
    (row,) = await h.rows()
    got = {name: getattr(row, name) for name in ROW_FIELDS}
    assert got == {
        "request_id": "req-1", "attempt": 1, "workload_id": CALLER.workload_id,
        "environment": CALLER.environment, "route_id": "a", "model_alias": "m",
        "upstream_model": "up-model", "requested_candidate_count": 2,
        "effective_candidate_count": 2, "exception_id": None,
        "reserved_input_tokens": row.reserved_input_tokens,
        "reserved_output_tokens": 2 * 256, "reserved_cost_micros": row.reserved_cost_micros,
        "stream_mode": False, "quota_scope": "instance", "policy_result": "allow",
        "policy_reason": "within_default", "gateway_instance": "test",
        "provider_request_id": "up-1", "input_tokens": 10, "output_tokens_total": 8,
        "total_tokens": 18, "state": "settled",
    }  # fmt: skip
    assert row.reserved_input_tokens > 0 and row.reserved_cost_micros > 0
    assert before <= row.timestamp <= datetime.now(UTC)
    sample = h.metrics.registry.get_sample_value
    assert sample("ncap_tokens_total", {"route": "a", "direction": "in"}) == 10
    assert sample("ncap_tokens_total", {"route": "a", "direction": "out"}) == 8
    assert sample("ncap_upstream_attempts_total", {"route": "a", "outcome": "completed"}) == 1
    latency = sample("ncap_upstream_latency_seconds_sum", {"route": "a"})
    assert latency is not None and 0 <= latency < 60  # now minus start, not plus
    assert sample("ncap_pending_reconciliation") == 0


async def test_the_upstream_model_defaults_to_the_alias(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Answer(chat_body("a"))]))})
    reply = await h.chat()
    assert reply.settling
    await settled(h.gateway)
    (row,) = await h.rows()
    assert row.upstream_model == "m"


async def test_a_held_attempt_counts_as_pending_reconciliation(tmp_path: Path) -> None:
    timeout = Fail(AttemptFailed("timeout"))
    h = harness(tmp_path, {"a": (route(retries=0), ScriptedProvider([timeout]))})
    with pytest.raises(UpstreamTimeout):
        await h.chat()
    (row,) = await h.rows()
    assert row.state == "usage_reconciliation_required"
    assert h.metrics.registry.get_sample_value("ncap_pending_reconciliation") == 1


def test_the_backoff_doubles_with_jitter_and_retry_after_wins_up_to_a_minute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[float, float]] = []

    def uniform(lo: float, hi: float) -> float:
        calls.append((lo, hi))
        return 0.8

    monkeypatch.setattr(attempts.random, "uniform", uniform)
    rt = parse_route(route(backoff_s=0.5))
    plain = AttemptFailed("status", 500)
    assert [attempts._delay(rt, i, plain) for i in (1, 2, 3, 4)] == [0.4, 0.8, 1.6, 3.2]
    assert calls == [(0.75, 1.25)] * 4
    assert attempts._delay(rt, 2, AttemptFailed("status", 429, retry_after=60.0)) == 60.0
    assert attempts._delay(rt, 2, AttemptFailed("status", 429, retry_after=60.5)) == 0.8


def test_a_providers_own_refusal_as_the_attempts_failure() -> None:
    failure = as_failure(Overloaded("busy"))
    assert (failure.kind, failure.status, failure.dispatched) == ("status", 503, False)
    assert failure.detail == "server_is_overloaded"
    assert ledger_outcome(AttemptFailed("status", 500, error=UpstreamErrorDetail("x"))) == (
        "upstream_error"  # without the route's say-so an error answer stays an unknown
    )


def _summary(text: bytes) -> ResponseSummary:
    return msgspec.json.decode(text, type=ResponseSummary)


def test_a_tally_keeps_the_first_id_and_each_choices_last_finish() -> None:
    tally = Tally()
    tally.add(_summary(b'{"id":"first","choices":[{"index":2,"finish_reason":null},'
                       b'{"finish_reason":null}]}'))  # fmt: skip
    tally.add(_summary(b'{"id":"second","choices":[{"index":2,"finish_reason":"stop"}]}'))
    tally.add(_summary(b'{"id":"third","choices":[{"index":2,"finish_reason":null}]}'))
    assert tally.provider_request_id == "first"
    assert tally.finish == {2: "stop", 0: None}  # no index counts as 0; a later null keeps stop
    kept = Tally(provider_request_id="from-headers")
    kept.add(_summary(b'{"id":"body","choices":[]}'))
    assert kept.provider_request_id == "from-headers"


async def test_a_settled_attempt_moves_its_actuals_into_the_budget(tmp_path: Path) -> None:
    """The budget counters hold what the row says was spent (not the reservation, not 0
    or 1), and the row's latency is the attempt's own, in milliseconds."""
    provider = ScriptedProvider([Answer(chat_body("a", usage=(10, 5)))])
    h = harness(tmp_path, {"a": (route(), provider)})
    reply = await h.chat()
    assert reply.settling
    await settled(h.gateway)
    (row,) = await h.rows()
    usage = await h.budgets.usage(CALLER.workload_id)
    assert row.cost_micros == 20  # 10 in at 1 USD/M + 5 out at 2 USD/M
    assert (usage.tokens_day, usage.cost_day, usage.cost_month) == (15, 20, 20)
    assert (usage.tokens_minute, usage.requests_minute, usage.in_flight) == (15, 1, 0)
    assert row.latency_ms is not None and 0 <= row.latency_ms < 10_000
    assert row.latency_ms == round(row.latency_ms, 3)


async def test_a_refused_attempt_returned_nothing(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(retries=0), ScriptedProvider([OVERLOADED_503]))})
    with pytest.raises(Overloaded):
        await h.chat(n=2, temperature=1.0)
    (row,) = await h.rows()
    assert (row.state, row.returned_candidate_count, row.cost_micros) == ("settled", 0, 0)
    usage = await h.budgets.usage(CALLER.workload_id)
    assert (usage.tokens_day, usage.cost_day, usage.in_flight) == (0, 0, 0)


async def test_usage_on_the_last_choice_chunk_is_only_for_a_client_that_asked(
    tmp_path: Path,
) -> None:
    """The bug this pins, socket-free: only that chunk is re-encoded without usage;
    the row still settles from it, with the provider id from the stream's head."""
    last = {**chunk(0, "lo", finish="stop"), "usage": chunk(None, usage=(3, 2))["usage"]}
    text = sse(chunk(0, "hel"), last)
    for asked in (False, True):
        provider = ScriptedProvider([Stream(text, provider_request_id="head-id")])
        h = harness(tmp_path, {"a": (route(), provider)})
        extra = {"stream_options": {"include_usage": True}} if asked else {}
        out = await drain((await h.chat(stream=True, **extra)).stream)
        assert out[0] == sse(chunk(0, "hel"), done=False)  # relayed as it came
        expected = last if asked else {k: v for k, v in last.items() if k != "usage"}
        assert events(out)[1:] == [expected, "[DONE]"]
        (row,) = await h.rows()
        assert (row.state, row.total_tokens, row.provider_request_id) == (
            "settled", 5, "head-id",
        )  # fmt: skip


async def test_a_stream_without_its_end_is_truncated_word_for_word(tmp_path: Path) -> None:
    provider = ScriptedProvider([Stream(sse(chunk(0, "hi", finish="stop"), done=False))])
    h = harness(tmp_path, {"a": (route(), provider)})
    out = events(await drain((await h.chat(stream=True)).stream))
    assert out[-1]["error"]["message"] == "The upstream stream ended early."
    (row,) = await h.rows()
    assert (row.state, row.reconciliation_reason) == ("pending", "stream_cut")


async def test_nothing_after_done_is_relayed(tmp_path: Path) -> None:
    usage = chunk(None, usage=(3, 1))
    text = sse(chunk(0, "hi", finish="stop"), usage) + sse(chunk(0, "late"), done=False)
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Stream(text)]))})
    out = await drain((await h.chat(stream=True)).stream)
    assert b"".join(out) == sse(chunk(0, "hi", finish="stop"))
    (row,) = await h.rows()
    assert row.state == "settled"


# -- for_route: the body as each route of the chain receives it ----------------------------


def _rt(**kw: Any) -> RouteRuntime:
    fields: dict[str, Any] = {"provider": "openai", "base_url": "http://scripted.invalid/v1"}
    return RouteRuntime("r", parse_route(fields | kw), ScriptedProvider([]))


BODY: dict[str, Any] = {"model": "m", "messages": [], "seed": 7, "user": "u", "logit_bias": {}}
EXTRAS = frozenset({"seed", "user", "top_k"})
WITH_USAGE = {"stream_usage": "include_usage"}


def test_a_route_that_changes_nothing_gets_the_body_itself() -> None:
    body = dict(BODY)
    allowing = _rt(extra_fields=["seed", "user"])
    assert attempts.for_route(body, allowing, EXTRAS, stream=False) is body
    assert attempts.for_route(body, allowing, EXTRAS, stream=True) is body  # no stream usage
    streamed = _rt(extra_fields=["seed", "user"], contract=WITH_USAGE)
    assert attempts.for_route(body, streamed, EXTRAS, stream=False) is body
    assert body == BODY


@pytest.mark.parametrize(
    ("route_fields", "stream", "expected"),
    [
        # an extra field this route does not allow is dropped; the allowed one stays
        ({"extra_fields": ["seed"]}, False,
         {"model": "m", "messages": [], "seed": 7, "logit_bias": {}}),
        ({}, False, {"model": "m", "messages": [], "logit_bias": {}}),
        # the upstream model replaces the alias, nothing else changes
        ({"upstream_model": "up", "extra_fields": ["seed", "user"]}, False, BODY | {"model": "up"}),
        # usage asked for on a stream where the contract says it can come
        ({"extra_fields": ["seed", "user"], "contract": WITH_USAGE}, True,
         BODY | {"stream_options": {"include_usage": True}}),
        ({"upstream_model": "up", "contract": WITH_USAGE}, True,
         {"model": "up", "messages": [], "logit_bias": {},
          "stream_options": {"include_usage": True}}),
        ({"upstream_model": "up", "contract": WITH_USAGE}, False,
         {"model": "up", "messages": [], "logit_bias": {}}),
    ],
)  # fmt: skip
def test_the_body_each_route_receives(
    route_fields: dict[str, Any], stream: bool, expected: dict[str, Any]
) -> None:
    body = dict(BODY)
    assert attempts.for_route(body, _rt(**route_fields), EXTRAS, stream=stream) == expected
    assert body == BODY  # the client's body is never changed in place


def test_stream_usage_keeps_the_clients_other_stream_options() -> None:
    body = BODY | {"stream_options": {"include_usage": False, "x": 1}}
    routed = attempts.for_route(body, _rt(contract=WITH_USAGE), frozenset(), stream=True)
    assert routed["stream_options"] == {"include_usage": True, "x": 1}
    assert body["stream_options"] == {"include_usage": False, "x": 1}
    none = BODY | {"stream_options": None}
    routed = attempts.for_route(none, _rt(contract=WITH_USAGE), frozenset(), stream=True)
    assert routed["stream_options"] == {"include_usage": True}


# -- readiness, the models a caller sees, shutdown of kept settlements --------------------


class _Failing(MemoryLedgerStore):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def get(self, request_id: str) -> list[Any]:
        raise self.error


@pytest.mark.parametrize(
    ("ledger_url", "budgets_url", "backends"),
    [
        ("postgres://h/db", "rediss://h:6380/0", ("postgresql", "redis")),
        ("postgresql://h/db", "redis://h/0", ("postgresql", "redis")),
        ("memory://", "sqlite:///x.db", ("memory", "sqlite")),
    ],
)
async def test_readiness_names_each_stores_backend(
    tmp_path: Path, ledger_url: str, budgets_url: str, backends: tuple[str, str]
) -> None:
    stores = {"ledger": ledger_url, "budgets": budgets_url}
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))}, stores=stores)
    assert await h.gateway.accounting.check_ready() == {
        "ledger": {"backend": backends[0], "ready": True},
        "budgets": {"backend": backends[1], "ready": True},
    }


@pytest.mark.parametrize(
    ("error", "reported"),
    [
        (StoreUnavailable("ledger", "PostgreSQL", "OperationalError"), "OperationalError"),
        (StoreUnavailable("ledger", "PostgreSQL"), "StoreUnavailable"),
        (OSError("host h:5432 refused"), "OSError"),  # the class, never the message
    ],
)
async def test_readiness_reports_a_failing_store_by_its_errors_class(
    tmp_path: Path, error: Exception, reported: str
) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))}, ledger=_Failing(error))
    report = await h.gateway.accounting.check_ready()
    assert report["ledger"] == {"backend": "sqlite", "ready": False, "error": reported}
    assert report["budgets"] == {"backend": "sqlite", "ready": True}


async def test_a_caller_sees_the_models_its_workload_allows(tmp_path: Path) -> None:
    workloads = {"default": {"models": ["m"]}, "wide": {}, "narrow": {"models": ["fake-model"]}}
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))}, workloads=workloads)
    assert h.gateway.models_for(CALLER) == ["m"]
    assert h.gateway.models_for(Caller("wide", "test")) == ["fake-model", "m"]
    assert h.gateway.models_for(Caller("narrow", "test")) == ["fake-model"]


async def test_shutdown_tries_kept_settlements_once_more(caplog: pytest.LogCaptureFixture) -> None:
    done: list[str] = []
    failures = [1]

    async def flaky() -> None:
        if failures[0]:
            failures[0] -= 1
            raise StoreUnavailable("budgets", "Redis", "ConnectionError")
        done.append("applied")

    async def never() -> None:
        raise StoreUnavailable("budgets", "Redis", "ConnectionError")

    async def wait(_: float) -> None:
        await asyncio.sleep(3600)  # the retry task never gets to try before close

    deferred = Deferred(sleep=wait)
    await deferred.run(Steps([flaky]))
    assert deferred.pending == 1
    await deferred.close()
    assert (done, deferred.pending) == (["applied"], 0)

    stuck = Deferred(sleep=wait)
    await stuck.run(Steps([never]))
    await stuck.run(Steps([never]))
    with caplog.at_level(logging.ERROR, "ncap.lifecycle"):
        await stuck.close()
    assert stuck.pending == 2
    assert caplog.messages[-1] == (
        "2 settlements not applied by the shutdown deadline: their rows stay reserved for "
        "recovery (a restart or a peer marks them gateway_lost)"
    )


async def test_shutdown_retries_kept_settlements_until_its_deadline() -> None:
    done: list[str] = []
    failures = [3]
    slept: list[float] = []

    async def flaky() -> None:
        if failures[0]:
            failures[0] -= 1
            raise StoreUnavailable("budgets", "Redis", "ConnectionError")
        done.append("applied")

    async def instant(delay: float) -> None:
        slept.append(delay)

    deferred = Deferred(sleep=instant, first_delay_s=0.001, max_delay_s=0.004)
    deferred._keep(Steps([flaky]), None)  # queued as a refused settlement is
    assert await deferred.close(deadline_s=5.0) == 0
    assert done == ["applied"] and slept == [0.001, 0.002, 0.004]  # backoff, capped

    async def never() -> None:
        raise StoreUnavailable("budgets", "Redis", "ConnectionError")

    stuck = Deferred(sleep=instant, first_delay_s=0.001, max_delay_s=0.001)
    stuck._keep(Steps([never]), None)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await stuck.close(deadline_s=0.05) == 1  # given up at the deadline, kept
    assert 0.04 <= loop.time() - started < 2.0


async def test_branches_that_opened_when_another_did_not_are_held_as_cut(
    tmp_path: Path,
) -> None:
    opened = Stream(sse(chunk(0, "x"), chunk(0, finish="stop"), chunk(None, usage=(3, 1))),
                    provider_request_id="branch-1")  # fmt: skip
    refused = Fail(AttemptFailed("status", 404))
    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider([opened, refused]))})
    with pytest.raises(UpstreamError):
        await h.chat(n=2, temperature=1.0, stream=True)
    first, second = await h.rows()
    assert (first.attempt, first.provider_request_id) == (1, "branch-1")
    assert (first.state, first.reconciliation_reason) == ("pending", "stream_cut")
    assert (first.returned_candidate_count, first.usage_source) == (0, "none")
    assert (second.attempt, second.state) == (2, "settled")
    assert [hold.hold_id for hold in await h.outstanding()] == [hold_id_for(first.request_id, 1)]
    sample = h.metrics.registry.get_sample_value
    assert sample("ncap_upstream_attempts_total", {"route": "a", "outcome": "stream_cut"}) == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "n"),
        ({"best_of": 0}, "n"),  # 0: no best_of, the count is n's
        ({"best_of": 1}, "best_of"),
        ({"best_of": 3, "n": 2}, "best_of"),
    ],
)
def test_candidate_param_names_the_field_the_count_came_from(
    body: dict[str, Any], param: str
) -> None:
    legacy = msgspec.convert({"model": "m", "prompt": "hi", **body}, CompletionRequest)
    assert candidate_param(legacy) == param
    chat = msgspec.convert(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 3},
        ChatCompletionRequest,
    )
    assert candidate_param(chat) == "n"
