"""The lifecycle's settlement service (``ncap.lifecycle.settlement``): a whole answer's
settlement is handed to it by the lifecycle, runs beside the answer in one batch task
per loop tick (holds first), ends the request's record once done, and is run to the
end by ``stop`` before the stores close. The plan stays frozen and the client's body
is never written into."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ncap.errors import StoreUnavailable
from ncap.http.signals import RequestSignals
from ncap.lifecycle import Accounting, Attempt, AttemptReport, Gateway, Plan, Settlement
from ncap.lifecycle.attempts import for_route
from ncap.lifecycle.settlement import Deferred
from ncap.metrics import Metrics
from ncap.protocol.responses import SummaryUsage
from ncap.protocol.validate import parse_chat_request
from ncap.stores import MemoryLedgerStore
from ncap.stores.ports import RowUpdate, update_each
from ncap.testing.scripted import Answer, ScriptedProvider, chat_body
from tests.lifecycle.harness import CALLER, EMULATE, Harness, harness, route, settled


def _with_settlement(h: Harness, settlement: Settlement) -> Gateway:
    gw = h.gateway
    accounting = Accounting(
        gw.config, h.ledger, h.budgets, instance="test", metrics=h.metrics, settlement=settlement
    )
    return Gateway(gw.config, gw.routes, accounting)


async def _attempt(gw: Gateway, request_id: str) -> tuple[Attempt, AttemptReport]:
    """An admitted request's first attempt, begun, and an answer's report of it."""
    body, request = parse_chat_request(_raw())
    plan, holds = await gw._admitter.admit(request_id, CALLER, request, body, [gw.routes["a"]])
    attempt = await gw.accounting.begin(plan, holds, 1, plan.usable_routes[0])
    usage = SummaryUsage(prompt_tokens=3, completion_tokens=2)
    return attempt, AttemptReport(None, 1, {"stop": 1}, usage, False, None)


def _raw(**body: Any) -> bytes:
    return msgspec.json.encode(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    )


async def test_answers_of_one_tick_share_one_batch_and_each_ends_its_record(
    tmp_path: Path,
) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))})
    ended: list[str] = []
    settlement = Settlement(h.metrics, on_request_settled=ended.append)
    gw = _with_settlement(h, settlement)
    created: list[str] = []
    loop = asyncio.get_running_loop()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task[Any]:
        created.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop)

    begun = [await _attempt(gw, f"req-{i}") for i in range(3)]  # admission may yield
    loop.set_task_factory(counting)
    try:
        for answer in begun:  # three answers in one loop iteration (no await in between)
            gw.accounting.answered_beside([answer])
        assert ended == []  # nothing ran yet: the answers go out first
        await settlement.drain()
    finally:
        loop.set_task_factory(None)
    # one batch task for the tick, settling the three together: no task per request
    assert created == ["Settlement._run_batch"]
    await settlement.drain()
    assert sorted(ended) == ["req-0", "req-1", "req-2"]
    for i in range(3):
        (row,) = await h.rows(f"req-{i}")
        assert (row.state, row.total_tokens) == ("settled", 5)  # 3 in + 2 out, as reported
    assert await h.outstanding() == []


async def test_the_hold_is_settled_before_the_loop_reads_the_next_request(
    tmp_path: Path,
) -> None:
    """No timer: the batch task starts in the next loop iteration, so a client that
    sends its next request as soon as it has the answer finds its slot free."""
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([Answer(chat_body("x"))]))})
    reply = await h.chat()
    assert reply.settling and len(await h.outstanding()) == 1
    for _ in range(3):  # the batch task's first step, then its gathered child's
        await asyncio.sleep(0)
    assert await h.outstanding() == []


class LedgerDown(MemoryLedgerStore):
    """Rows are written, but their final state cannot be (the ledger went away)."""

    async def update(self, request_id: str, attempt: int, /, **fields: Any) -> None:
        raise StoreUnavailable("ledger", "PostgreSQL", "ConnectionError")

    async def update_many(self, updates: Sequence[RowUpdate]) -> None:
        await update_each(self, updates)


async def test_a_hold_is_settled_at_once_while_rows_wait_for_the_ledger(tmp_path: Path) -> None:
    """Settlements waiting for a store are kept in order, but only their rows wait: a
    later answer's hold is settled at once (its concurrency slot free), not queued
    behind the rows."""
    answers = [Answer(chat_body("x")), Answer(chat_body("y"))]
    h = harness(tmp_path, {"a": (route(), ScriptedProvider(answers))}, ledger=LedgerDown())
    settlement = Settlement(h.metrics, deferred=Deferred(sleep=_never))
    gw = _with_settlement(h, settlement)
    for request_id in ("req-1", "req-2"):
        assert (await gw.chat(_raw(), CALLER, request_id)).settling
        await settlement.drain()
    assert settlement.pending == 2  # both rows wait for the ledger, in order
    assert await h.outstanding() == []  # both holds are settled
    assert [(await h.rows(r))[0].state for r in ("req-1", "req-2")] == ["reserved"] * 2
    await settlement.stop()


async def _never(seconds: float) -> None:
    await asyncio.Event().wait()


async def test_a_fan_out_is_settled_as_one_request(tmp_path: Path) -> None:
    answers = [Answer(chat_body("x", usage=(2, 1))), Answer(chat_body("y", usage=(2, 1)))]
    h = harness(tmp_path, {"a": (route(EMULATE), ScriptedProvider(answers))})
    ended: list[str] = []
    gw = _with_settlement(h, Settlement(h.metrics, on_request_settled=ended.append))
    reply = await gw.chat(_raw(n=2, temperature=1.0), CALLER, "req-1")
    assert reply.settling
    await gw.accounting.settlement.drain()
    assert ended == ["req-1"]  # one record end, after both branches' rows
    assert [(r.attempt, r.state) for r in await h.rows()] == [(1, "settled"), (2, "settled")]


async def test_stop_runs_every_queued_settlement_before_returning(tmp_path: Path) -> None:
    """The composition root stops the service before it closes the stores: nothing
    queued is left behind for the closed stores."""
    answers = [Answer(chat_body(str(i))) for i in range(4)]
    h = harness(tmp_path, {"a": (route(), ScriptedProvider(answers))})
    settlement = Settlement(h.metrics)
    gw = _with_settlement(h, settlement)
    for i in range(4):
        assert (await gw.chat(_raw(), CALLER, f"req-{i}")).settling
    assert await settlement.stop(deadline_s=0.0) == 0
    for i in range(4):
        assert [r.state for r in await h.rows(f"req-{i}")] == ["settled"]
    assert await h.outstanding() == []


class OneRowFails(MemoryLedgerStore):
    """Every row's final state is written but one request's (a bug's error, not an
    outage)."""

    async def update(self, request_id: str, attempt: int, /, **fields: Any) -> None:
        if request_id == "req-1":
            raise OSError("disk full")
        await super().update(request_id, attempt, **fields)

    async def update_many(self, updates: Sequence[RowUpdate]) -> None:
        await update_each(self, updates)


async def test_a_row_that_fails_in_a_tick_fails_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tick's rows go to the ledger in one call; when it fails for a reason other
    than an outage, each request is settled again on its own: the others are settled,
    the failing one is counted once, and every record ends."""
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))}, ledger=OneRowFails())
    ended: list[str] = []
    settlement = Settlement(h.metrics, on_request_settled=ended.append)
    gw = _with_settlement(h, settlement)
    for i in range(3):
        gw.accounting.answered_beside([await _attempt(gw, f"req-{i}")])
    with caplog.at_level(logging.ERROR, logger="ncap.lifecycle"):
        await settlement.drain()
    assert sorted(ended) == ["req-0", "req-1", "req-2"]
    states = [[r.state for r in await h.rows(f"req-{i}")] for i in range(3)]
    assert states == [["settled"], ["reserved"], ["settled"]]
    assert await h.outstanding() == []  # every hold settled, the failing row's too
    assert [r.getMessage() for r in caplog.records] == ["settlement failed: OSError"]
    assert h.metrics.registry.get_sample_value("ncap_bookkeeping_failures_total") == 1


async def test_a_failed_settlement_still_ends_the_record_and_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = Metrics()
    ended: list[str] = []
    settlement = Settlement(metrics, on_request_settled=ended.append)

    async def broken(batch: list[tuple[str, Any]]) -> None:
        raise KeyError("a row's secret content")

    settlement.settles_with(broken)
    settlement.beside_answer("req-1", [])
    with caplog.at_level(logging.ERROR, logger="ncap.lifecycle"):
        await settlement.drain()
    assert ended == ["req-1"]
    assert [r.getMessage() for r in caplog.records] == ["settlement failed: KeyError"]
    assert metrics.registry.get_sample_value("ncap_bookkeeping_failures_total") == 1


def test_a_record_settled_before_its_status_is_known_ends_at_responded() -> None:
    """An Idempotency-Key's store write can come between the answer and the handler's
    ``responded``: the settlement may be done first; the access line still carries the
    status."""
    signals = RequestSignals(access_log=True)
    lines: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("ncap.access")
    handler, saved = Capture(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        signals.begin("req-1")
        signals.settled("req-1")
        assert lines == []
        signals.responded("req-1", 200)
        assert len(lines) == 1 and msgspec.json.decode(lines[0])["status"] == 200
        signals.begin("req-2")
        signals.responded("req-2", 200)
        signals.settled("req-2")  # the usual order: ends at once
        assert len(lines) == 2
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


async def test_the_ceiling_is_sent_on_a_copy_and_the_plan_carries_no_row(
    tmp_path: Path,
) -> None:
    provider = ScriptedProvider([Answer(chat_body("x"))])
    h = harness(tmp_path, {"a": (route(), provider)})
    assert (await h.chat()).settling
    await settled(h.gateway)
    assert "max_completion_tokens" in provider.sent[0]  # the plan's ceiling went upstream
    body = {"model": "m", "messages": []}
    rt = h.gateway.routes["a"]
    routed = for_route(body, rt, frozenset(), stream=False, ceiling={"max_tokens": 16})
    assert routed == {"model": "m", "messages": [], "max_tokens": 16}
    assert body == {"model": "m", "messages": []}  # the client's body is never written
    assert "first_row" not in Plan.__struct_fields__
