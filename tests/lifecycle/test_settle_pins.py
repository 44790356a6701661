"""Pins found by mutation testing (docs/mutation.md) for the books of a request
(``ncap.lifecycle.settle``): what the observers are told, the failure and denial log
lines with their levels, the hold settled or given back, the row's latency, the kept
settlements' backlog, warnings and backoff; over the scripted provider, socket-free."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest

import ncap.lifecycle.settle as settle_module
from ncap.errors import (
    BudgetExhausted,
    InvalidRequest,
    NcapError,
    RateLimited,
    StoreUnavailable,
    UpstreamError,
)
from ncap.lifecycle import Accounting, Gateway
from ncap.lifecycle.plan import Attempt, Plan
from ncap.lifecycle.settlement import Deferred, Steps
from ncap.protocol.responses import Usage
from ncap.protocol.validate import parse_chat_request
from ncap.providers.base import AttemptFailed, UpstreamErrorDetail
from ncap.stores import MemoryBudgetStore
from ncap.streaming.sse import StreamPiece, iter_pieces
from ncap.testing.scripted import Answer, Fail, ScriptedProvider, Stream, chat_body, chunk, sse
from tests.lifecycle.harness import CALLER, EMULATE, Harness, drain, harness, route, settled

NOW = datetime(2026, 11, 29, 10, 15, 30, tzinfo=UTC)


def _sample(h: Harness, name: str, **labels: str) -> float | None:
    return h.metrics.registry.get_sample_value(name, labels)


async def _settled(h: Harness, reply: Any) -> None:
    if reply.settling:
        await settled(h.gateway)
    if reply.stream is not None:
        await drain(reply.stream)


# -- observers ---------------------------------------------------------------------------


class Observer:
    def __init__(self, *, fails: bool = False) -> None:
        self.seen: list[tuple[Plan, Attempt | None, dict[str, Any], str]] = []
        self.fails = fails

    def attempt_closed(
        self, plan: Plan, attempt: Attempt | None, final: Mapping[str, Any], outcome: str
    ) -> None:
        if self.fails:
            raise ValueError("observer bug")
        self.seen.append((plan, attempt, dict(final), outcome))


def _observed(
    tmp: Path,
    steps: list[Any],
    observer: Observer,
    *,
    budgets: MemoryBudgetStore | None = None,
    **overrides: Any,
) -> Harness:
    h = harness(tmp, {"a": (route(), ScriptedProvider(steps))}, budgets=budgets, **overrides)
    accounting = Accounting(
        h.gateway.config,
        h.ledger,
        h.budgets,
        instance="test",
        metrics=h.metrics,
        observers=[observer],
    )
    h.gateway = Gateway(h.gateway.config, h.gateway.routes, accounting, sleep=_no_sleep)
    return h


async def _no_sleep(_: float) -> None:
    return None


async def test_observers_are_told_each_final_row(tmp_path: Path) -> None:
    observer = Observer()
    h = _observed(tmp_path, [Answer(chat_body("a"))], observer)
    await _settled(h, await h.chat())
    ((plan, attempt, final, outcome),) = observer.seen
    assert plan.request_id == "req-1" and outcome == "completed"
    assert attempt is not None and (attempt.number, attempt.route.id) == (1, "a")
    assert (final["state"], final["input_tokens"], final["usage_source"]) == (
        "settled",
        10,
        "provider_response",
    )


async def test_observers_are_told_of_a_denial_with_its_plan(tmp_path: Path) -> None:
    observer = Observer()
    h = _observed(
        tmp_path,
        [Answer(chat_body("a"))],
        observer,
        workloads={"default": {"requests_per_minute": 1}},
    )
    await _settled(h, await h.chat("req-1"))
    with pytest.raises(RateLimited):
        await h.chat("req-2")
    plan, attempt, final, outcome = observer.seen[-1]
    assert (plan.request_id, attempt, outcome) == ("req-2", None, "denied")
    assert final == {
        "state": "denied",
        "policy_reason": "rate_limit_exceeded",
        "denied_by": "requests_minute",  # which window refused (the budget alerts read it)
    }


async def test_an_observers_bug_is_logged_and_the_settlement_stands(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    h = _observed(tmp_path, [Answer(chat_body("a"))], Observer(fails=True))
    with caplog.at_level(logging.ERROR, "ncap.lifecycle"):
        await _settled(h, await h.chat())
    assert caplog.messages == ["attempt observer failed: ValueError"]
    (row,) = await h.rows()
    assert row.state == "settled"


# -- the row of an answer, a failure, a stream -----------------------------------------


async def test_an_answer_row_keeps_the_providers_own_id_and_every_finish(tmp_path: Path) -> None:
    answer = Answer(chat_body("a", "b", usage=(7, 4)), provider_request_id="hdr-1")
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([answer]))})
    await _settled(h, await h.chat(n=2, temperature=1.0))
    (row,) = await h.rows()
    assert (row.provider_request_id, row.finish_reasons) == ("hdr-1", {"stop": 2})
    assert (row.usage_source, row.cached_input_tokens, row.reasoning_tokens) == (
        "provider_response",
        0,
        None,
    )
    assert row.output_tokens_per_choice is None  # two choices, counts unknown


async def test_one_native_choice_is_not_split_from_the_total(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Answer(chat_body("a"))]))})
    await _settled(h, await h.chat())
    (row,) = await h.rows()
    assert row.output_tokens_per_choice is None


async def test_reasoning_and_cached_tokens_reach_the_row(tmp_path: Path) -> None:
    body = msgspec.json.decode(chat_body("a", usage=(10, 5)))
    body["usage"] |= {
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 3},
    }
    answer = Answer(msgspec.json.encode(body))
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([answer]))})
    await _settled(h, await h.chat())
    (row,) = await h.rows()
    assert (row.cached_input_tokens, row.reasoning_tokens) == (4, 3)


async def test_a_failed_attempt_row_returned_nothing(tmp_path: Path) -> None:
    h = harness(
        tmp_path, {"a": (route(retries=0), ScriptedProvider([Fail(AttemptFailed("timeout"))]))}
    )
    with pytest.raises(UpstreamError):
        await h.chat()
    (row,) = await h.rows()
    assert (row.returned_candidate_count, row.finish_reasons) == (0, {})
    assert row.state == "usage_reconciliation_required"


async def test_a_stream_that_fails_to_open_is_pending(tmp_path: Path) -> None:
    h = harness(
        tmp_path, {"a": (route(retries=0), ScriptedProvider([Fail(AttemptFailed("timeout"))]))}
    )
    with pytest.raises(UpstreamError):
        await h.chat(stream=True)
    (row,) = await h.rows()
    assert (row.state, row.stream_mode) == ("pending", True)


async def test_a_refused_attempt_gives_its_hold_back_whole(tmp_path: Path) -> None:
    refused = Fail(AttemptFailed("status", 400, error=UpstreamErrorDetail("no", param="messages")))
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([refused]))})
    with pytest.raises(InvalidRequest):
        await h.chat()
    usage = await h.budgets.usage("default")
    assert (usage.requests_minute, usage.tokens_minute, usage.in_flight) == (0, 0, 0)


async def test_a_zero_usage_answer_settles_at_zero(tmp_path: Path) -> None:
    answer = Answer(chat_body("a", usage=(0, 0)))
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([answer]))})
    await _settled(h, await h.chat())
    usage = await h.budgets.usage("default")
    assert (usage.tokens_minute, usage.cost_day, usage.requests_minute) == (0, 0, 1)


async def test_the_rows_latency_in_milliseconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Clock:
        now = 100.0

        def monotonic(self) -> float:
            self.now += 0.0123456
            return self.now

    monkeypatch.setattr(settle_module, "time", Clock())
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Answer(chat_body("a"))]))})
    await _settled(h, await h.chat())
    (row,) = await h.rows()
    assert row.latency_ms == 12.346  # one tick of the clock, to the microsecond


async def test_a_complete_stream_is_a_completed_attempt(tmp_path: Path) -> None:
    text = sse(chunk(0, "hi", finish="stop"), chunk(None, usage=(3, 1)))
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Stream(text)]))})
    await _settled(h, await h.chat(stream=True))
    assert _sample(h, "ncap_upstream_attempts_total", route="a", outcome="completed") == 1
    assert _sample(h, "ncap_upstream_attempts_total", route="a", outcome="stream_cut") is None
    (row,) = await h.rows()
    assert (row.state, row.usage_source) == ("settled", "provider_stream")


async def test_a_stream_the_client_left_is_held_and_not_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    text = sse(chunk(0, "a"), chunk(0, "b"), chunk(0, finish="stop"), chunk(None, usage=(3, 1)))
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Stream(text)]))})
    reply = await h.chat(stream=True)
    assert reply.stream is not None
    with caplog.at_level(logging.INFO, "ncap.lifecycle"):
        await anext(reply.stream)
        await reply.stream.aclose()  # type: ignore[attr-defined]
    (row,) = await h.rows()
    assert (row.state, row.reconciliation_reason) == ("pending", "stream_cut")
    assert caplog.messages == []
    assert _sample(h, "ncap_pending_reconciliation") == 1


async def test_a_stream_that_ends_early_is_logged_as_truncated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    text = sse(chunk(0, "a"), done=False) + b": keep-alive\n\n"
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Stream(text)]))})
    with caplog.at_level(logging.INFO, "ncap.lifecycle"):
        await _settled(h, await h.chat(stream=True))
    assert caplog.messages == [
        "upstream failure: request=req-1 workload=default route=a attempt=1 status=- "
        "reason=stream_truncated outcome=stream_cut"
    ]
    assert caplog.records[0].levelno == logging.WARNING


async def test_an_unusual_done_spelling_still_ends_a_stream(tmp_path: Path) -> None:
    text = sse(chunk(0, "a", finish="stop"), chunk(None, usage=(3, 1)), done=False)
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Stream(text + b"data:[DONE]\n\n")]))})
    await _settled(h, await h.chat(stream=True))
    (row,) = await h.rows()
    assert row.state == "settled"
    assert _sample(h, "ncap_upstream_attempts_total", route="a", outcome="completed") == 1


async def test_a_choice_without_a_finish_is_counted_as_none(tmp_path: Path) -> None:
    text = sse(chunk(0, "a"), chunk(None, usage=(3, 1)))
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Stream(text)]))})
    await _settled(h, await h.chat(stream=True))
    (row,) = await h.rows()
    assert row.finish_reasons == {"none": 1}


class Engine(ScriptedProvider):
    """A provider that knows each choice's output tokens (like the local engine)."""

    @asynccontextmanager
    async def stream(
        self, body: Mapping[str, Any], *, timeout: float, kind: Any = "chat"
    ) -> AsyncIterator[tuple[str | None, AsyncIterator[StreamPiece]]]:
        self.sent.append(body)

        async def events() -> AsyncIterator[StreamPiece]:
            async def lines() -> AsyncIterator[bytes]:
                text = sse(
                    chunk(0, "a", finish="stop"),
                    chunk(1, "b", finish="stop"),
                    chunk(None, usage=(3, 5)),
                )
                for line in text.splitlines(keepends=True):
                    yield line

            async for piece in iter_pieces(lines()):
                if any(summary.usage is not None for summary in piece.summaries):
                    piece = StreamPiece(
                        piece.raw, piece.summaries, piece.done, choice_tokens=(2, 3)
                    )
                yield piece

        yield "engine-1", events()


async def test_a_streams_per_choice_counts_reach_the_row(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), Engine([]))})
    await _settled(h, await h.chat(n=2, temperature=1.0, stream=True))
    (row,) = await h.rows()
    assert (row.state, row.output_tokens_per_choice) == ("settled", (2, 3))


# -- failure log lines and their levels -------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "line", "level"),
    [
        (
            AttemptFailed("status", 400, error=UpstreamErrorDetail("no", param="messages")),
            "status=400 reason=request_rejected outcome=rejected",
            logging.INFO,
        ),
        (AttemptFailed("status", 413), "status=413 reason=other_4xx", logging.INFO),
        (AttemptFailed("status", 500), "status=500 reason=other_status", logging.WARNING),
        (AttemptFailed("timeout"), "status=- reason=timeout", logging.WARNING),
    ],
)
async def test_each_failure_is_one_line_at_its_level(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, failure: AttemptFailed, line: str, level: int
) -> None:
    h = harness(tmp_path, {"a": (route(retries=0), ScriptedProvider([Fail(failure)]))})
    with caplog.at_level(logging.INFO, "ncap.lifecycle"), pytest.raises(NcapError):
        await h.chat()
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "upstream failure: request=req-1 workload=default route=a attempt=1 "
    )
    assert line in record.getMessage()
    assert record.levelno == level


# -- denials ----------------------------------------------------------------------------


class Exhausted(MemoryBudgetStore):
    """A budget store refusing with a bare BudgetExhausted (no window named)."""

    async def reserve(self, *args: Any, **kwargs: Any) -> Any:
        raise BudgetExhausted("Workload 'default' is out of budget.")


async def test_a_budget_denial_without_a_window_is_counted_as_unknown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))}, budgets=Exhausted())
    with caplog.at_level(logging.WARNING, "ncap.lifecycle"), pytest.raises(BudgetExhausted):
        await h.chat()
    assert caplog.messages == [
        "budget exhausted: request=req-1 workload=default route=a status=429 "
        "reason=budget_exhausted window=unknown limit=None needed=None"
    ]
    assert _sample(h, "ncap_budget_exhausted_total", workload="default", window="unknown") == 1
    (row,) = await h.rows()
    assert (row.attempt, row.state, row.reserved_cost_micros) == (0, "denied", 0)
    assert row.reserved_input_tokens > 0  # sized before the store refused


@pytest.mark.parametrize(
    ("workload", "window"),
    [({"requests_per_minute": 1}, "requests_minute"), ({"max_concurrency": 1}, "concurrency")],
)
async def test_a_denied_fan_out_records_one_request_per_branch(
    tmp_path: Path, workload: dict[str, Any], window: str
) -> None:
    h = harness(
        tmp_path,
        {"a": (route(EMULATE), ScriptedProvider([]))},
        workloads={"default": workload | {"max_candidates": 3}},
    )
    with pytest.raises(RateLimited):
        await h.chat(n=3, temperature=1.0)
    (row,) = await h.rows()
    assert (row.denied_by, row.denied_limit, row.denied_amount) == (window, 1, 3)


async def test_the_hold_is_charged_at_the_accountings_clock_and_exception(
    tmp_path: Path,
) -> None:
    exceptions = [
        {
            "id": "eval",
            "workload": "default",
            "owner": "o",
            "max_candidates": 8,
            "expires": "2030-01-01T00:00:00Z",
            "budget_usd": 1.0,
        }
    ]
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))}, exceptions=exceptions)
    accounting = Accounting(
        h.gateway.config, h.ledger, h.budgets, instance="test", metrics=h.metrics, clock=lambda: NOW
    )
    gw = Gateway(h.gateway.config, h.gateway.routes, accounting)
    raw = b'{"model":"m","n":6,"temperature":1,"messages":[{"role":"user","content":"x"}]}'
    body, request = parse_chat_request(raw)
    plan, holds = await gw._admitter.admit("req-1", CALLER, request, body, [gw.routes["a"]])
    ((_, hold),) = holds.items()
    assert (hold.exception_id, hold.minute) == ("eval", "2026-11-29T10:15")
    usage = await h.budgets.usage("default", exception_id="eval", now=NOW)
    assert usage.cost_exception == plan.attempt_reservation.cost_micros > 0


async def test_an_exhausted_exception_budget_refuses(tmp_path: Path) -> None:
    exceptions = [
        {
            "id": "eval",
            "workload": "default",
            "owner": "o",
            "max_candidates": 8,
            "expires": "2030-01-01T00:00:00Z",
            "budget_usd": 0.000001,
        }
    ]
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))}, exceptions=exceptions)
    with pytest.raises(BudgetExhausted):
        await h.chat(n=6, temperature=1.0)
    (row,) = await h.rows()
    assert (row.denied_by, row.exception_id) == ("exception", "eval")


# -- kept settlements: the backlog's error, the warnings, the backoff ------------------------


class Flaky:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.done: list[str] = []

    def step(self, name: str) -> Any:
        async def run() -> None:
            if self.failures:
                self.failures -= 1
                raise StoreUnavailable("budgets", "Redis", "ConnectionError")
            self.done.append(name)

        return run


async def test_a_full_backlog_raises_a_store_error_of_its_own() -> None:
    store = Flaky(failures=100)

    async def never(_: float) -> None:
        await asyncio.sleep(3600)

    deferred = Deferred(max_pending=1, sleep=never)
    await deferred.run(Steps([store.step("a")]))
    with pytest.raises(StoreUnavailable) as info:
        await deferred.run(Steps([store.step("b")]))  # behind the first: no store error
    assert (info.value.store, info.value.backend, info.value.detail) == (
        "ledger or budgets",
        "store",
        "settlements backlog",
    )
    await deferred.close()


async def test_kept_settlements_warn_once_and_back_off_to_the_ceiling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = Flaky(failures=5)
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    deferred = Deferred(first_delay_s=1.0, max_delay_s=3.0, sleep=sleep)
    with caplog.at_level(logging.WARNING, "ncap.lifecycle"):
        await deferred.run(Steps([store.step("a")]))  # fails: kept, warned
        await deferred.run(Steps([store.step("b")]))  # behind it: kept, no warning
        for _ in range(100):
            if not deferred.pending:
                break
            await asyncio.sleep(0)
    assert store.done == ["a", "b"]
    assert sleeps == [1.0, 2.0, 3.0, 3.0, 3.0]  # doubled, up to the ceiling
    assert caplog.messages == [
        "settlement deferred: the budgets store (Redis) is unavailable (ConnectionError); "
        "settlements are kept and retried until it is back",
        "deferred settlements applied: the store is back",
    ]


async def test_the_default_backoff_and_backlog(caplog: pytest.LogCaptureFixture) -> None:
    store = Flaky(failures=8)
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    deferred = Deferred(sleep=sleep)
    await deferred.run(Steps([store.step("a")]))
    for _ in range(200):
        if not deferred.pending:
            break
        await asyncio.sleep(0)
    assert sleeps == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])

    async def never(_: float) -> None:
        await asyncio.sleep(3600)

    full = Deferred(sleep=never)
    stuck = Flaky(failures=1)
    await full.run(Steps([stuck.step("first")]))  # kept: the store refused
    for i in range(9_999):
        await full.run(Steps([stuck.step(str(i))]))  # queued behind it
    assert full.pending == 10_000
    with pytest.raises(StoreUnavailable):
        await full.run(Steps([stuck.step("one too many")]))
    await full.close()  # the store answers again: everything applied at shutdown
    assert full.pending == 0 and len(stuck.done) == 10_000


async def test_shutdown_stops_the_retry_task() -> None:
    async def never(_: float) -> None:
        await asyncio.sleep(3600)

    deferred = Deferred(sleep=never)
    await deferred.run(Steps([Flaky(failures=1).step("a")]))
    task = deferred._task
    assert task is not None and not task.done()
    await deferred.close()
    assert task.cancelled()


async def test_a_refusal_that_reported_usage_is_settled_at_it(tmp_path: Path) -> None:
    """Gemini's blocked prompt: a refusal (no retry, nothing generated) that reported
    the prompt tokens it read; the row and the hold are settled at them, not released."""
    blocked = Fail(
        AttemptFailed(
            "status",
            400,
            error=UpstreamErrorDetail("blocked", param="messages"),
            usage=Usage(completion_tokens=0, prompt_tokens=12, total_tokens=12),
        )
    )
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([blocked]))})
    with pytest.raises(InvalidRequest):
        await h.chat()
    (row,) = await h.rows()
    assert (row.state, row.usage_source, row.upstream_status) == (
        "settled",
        "provider_response",
        400,
    )
    assert (row.input_tokens, row.output_tokens_total, row.total_tokens) == (12, 0, 12)
    assert (row.cost_micros, row.returned_candidate_count) == (12, 0)  # 12 x $1/Mtok
    usage = await h.budgets.usage("default")
    assert (usage.tokens_minute, usage.cost_day, usage.in_flight) == (12, 12, 0)
