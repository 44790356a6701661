"""The request lifecycle end to end over scripted providers: no sockets, no HTTP."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ncap.errors import InvalidRequest, Overloaded, UpstreamError
from ncap.lifecycle import AttemptReport
from ncap.lifecycle.admit import Admitter
from ncap.protocol.validate import parse_chat_request
from ncap.providers.base import AttemptFailed, UpstreamErrorDetail
from ncap.stores import MemoryLedgerStore
from ncap.stores.ports import RowUpdate, update_each
from ncap.testing.scripted import Answer, Fail, ScriptedProvider, Stream, chat_body, chunk, sse
from tests.lifecycle.harness import CALLER, EMULATE, drain, events, harness, route, settled

OVERLOADED = Fail(AttemptFailed("status", 503))


async def test_retry_then_success(tmp_path: Path) -> None:
    provider = ScriptedProvider([OVERLOADED, Answer(chat_body("hello"))])
    h = harness(tmp_path, {"a": (route(), provider)})
    reply = await h.chat()
    assert reply.status == 200 and reply.settling
    assert msgspec.json.decode(reply.body)["choices"][0]["message"]["content"] == "hello"
    await settled(h.gateway)
    first, second = await h.rows()
    assert (first.attempt, first.state, first.cost_micros) == (1, "settled", 0)  # refused
    assert (second.attempt, second.state, second.input_tokens) == (2, "settled", 10)
    assert second.output_tokens_total == 5 and second.provider_request_id == "up-1"
    assert len(h.sleeps) == 1  # one backoff between the two tries of the route
    assert await h.outstanding() == []
    # every attempt carries the explicit output ceiling the reservation was sized for
    assert [body["max_completion_tokens"] for body in provider.sent] == [256, 256]


async def test_fallback_that_refuses_n_is_skipped(tmp_path: Path) -> None:
    primary = ScriptedProvider([OVERLOADED] * 3)
    fallback = ScriptedProvider([Answer(chat_body("a", "b"))])
    single = {"candidates": "native", "max_candidates": 1}
    h = harness(tmp_path, {"a": (route(), primary), "b": (route(single), fallback)})
    with pytest.raises(Overloaded):
        await h.chat(n=2, temperature=1.0)
    assert fallback.sent == []  # its contract does not approve n=2: never tried
    rows = await h.rows()
    assert [(r.attempt, r.route_id, r.state) for r in rows] == [
        (1, "a", "settled"),
        (2, "a", "settled"),
        (3, "a", "settled"),
    ]
    assert await h.outstanding() == []


async def test_fallback_serves_n_1_when_the_primary_is_spent(tmp_path: Path) -> None:
    primary = ScriptedProvider([OVERLOADED] * 3)
    fallback = ScriptedProvider([Answer(chat_body("from b"))])
    single = {"candidates": "native", "max_candidates": 1}
    h = harness(tmp_path, {"a": (route(), primary), "b": (route(single), fallback)})
    reply = await h.chat()
    assert reply.headers["x-ncap-route"] == "b" and reply.settling
    await settled(h.gateway)
    assert [(r.attempt, r.route_id) for r in await h.rows()] == [
        (1, "a"),
        (2, "a"),
        (3, "a"),
        (4, "b"),
    ]
    assert len(h.sleeps) == 2  # two retries of a; the fallback is tried at once


async def test_fan_out_with_one_failed_branch(tmp_path: Path) -> None:
    bad = UpstreamErrorDetail("bad request", code="invalid_value", param="messages")
    provider = ScriptedProvider(
        [
            Answer(chat_body("one", id_="b1")),
            Fail(AttemptFailed("status", 400, error=bad)),
            Answer(chat_body("three", id_="b3")),
        ]
    )
    h = harness(tmp_path, {"a": (route(EMULATE), provider)})
    with pytest.raises(InvalidRequest) as info:
        await h.chat(n=3, temperature=1.0)
    assert (info.value.code, info.value.param) == ("invalid_value", "messages")
    assert all("n" not in body for body in provider.sent)  # single-candidate branches
    rows = await h.rows()
    assert [(r.attempt, r.state, r.input_tokens) for r in rows] == [
        (1, "settled", 10),  # answered branches are settled: they were paid
        (2, "settled", 0),  # the refusal generated nothing
        (3, "settled", 10),
    ]
    assert await h.outstanding() == []


async def test_fan_out_merges_branches_in_order(tmp_path: Path) -> None:
    provider = ScriptedProvider([Answer(chat_body(text, id_=text)) for text in ("x", "y")])
    h = harness(tmp_path, {"a": (route(EMULATE), provider)})
    reply = await h.chat(n=2, temperature=1.0)
    body = msgspec.json.decode(reply.body)
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [(0, "x"), (1, "y")]
    assert body["id"] == "chatcmpl-req-1"
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 10, "total_tokens": 30}
    assert reply.headers["x-ncap-candidates-returned"] == "2" and reply.settling
    await settled(h.gateway)


async def test_fan_out_stream_rebases_each_branch(tmp_path: Path) -> None:
    def branch(text: str) -> Stream:
        return Stream(
            sse(chunk(0, text), chunk(0, finish="stop"), chunk(None, usage=(4, 1))),
            provider_request_id=text,
        )

    provider = ScriptedProvider([branch("x"), branch("y")])
    h = harness(tmp_path, {"a": (route(EMULATE), provider)})
    reply = await h.chat(n=2, temperature=1.0, stream=True, stream_options={"include_usage": True})
    out = events(await drain(reply.stream))
    assert out[-1] == "[DONE]" and out.count("[DONE]") == 1
    assert out[-2]["usage"] == {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}
    texts = {
        c["choices"][0]["index"]: c["choices"][0]["delta"].get("content")
        for c in out[:-2]
        if c["choices"][0]["delta"]
    }
    assert texts == {0: "x", 1: "y"}
    assert {c["id"] for c in out[:-1]} == {"chatcmpl-req-1"}
    assert [r.state for r in await h.rows()] == ["settled", "settled"]


async def test_stream_cut_before_usage(tmp_path: Path) -> None:
    cut = AttemptFailed("connection", detail="reset", partial=True)
    text = sse(chunk(0, "hel"), chunk(0, "lo", finish="stop"), done=False)
    provider = ScriptedProvider([Stream(text, then=cut)])
    h = harness(tmp_path, {"a": (route(), provider)})
    reply = await h.chat(stream=True)
    out = events(await drain(reply.stream))
    assert [c["choices"][0]["delta"]["content"] for c in out[:2]] == ["hel", "lo"]
    assert out[-1]["error"]["code"] == "upstream_error"  # the stream ends with an error event
    assert provider.sent[0]["stream_options"] == {"include_usage": True}  # asked on our behalf
    (row,) = await h.rows()
    assert (row.state, row.reconciliation_reason) == ("pending", "stream_cut")
    assert row.returned_candidate_count == 1 and row.finish_reasons == {"stop": 1}
    (held,) = await h.outstanding()  # usage unknown: the hold stays until reconciled
    assert held.hold_id == "req-1#1"


async def test_stream_relays_bytes_unchanged_and_hides_our_usage_chunk(tmp_path: Path) -> None:
    text = sse(chunk(0, "hi", finish="stop"), chunk(None, usage=(3, 1)))
    provider = ScriptedProvider([Stream(text)])
    h = harness(tmp_path, {"a": (route(), provider)})
    reply = await h.chat(stream=True)
    relayed = b"".join(await drain(reply.stream))
    assert relayed == sse(chunk(0, "hi", finish="stop"))  # the usage chunk was ours
    (row,) = await h.rows()
    assert (row.state, row.input_tokens, row.usage_source) == ("settled", 3, "provider_stream")


class FailingLedger(MemoryLedgerStore):
    def __init__(self, *, on: str) -> None:
        super().__init__()
        self.on = on

    async def append(self, event: Any) -> None:
        if self.on == "append":
            raise OSError("disk full")
        await super().append(event)

    async def update(self, request_id: str, attempt: int, /, **fields: Any) -> None:
        if self.on == "update":
            raise OSError("disk full")
        await super().update(request_id, attempt, **fields)

    async def update_many(self, updates: Sequence[RowUpdate]) -> None:
        await update_each(self, updates)


async def test_a_failed_reserved_row_write_is_raised_and_releases_the_hold(tmp_path: Path) -> None:
    provider = ScriptedProvider([Answer(chat_body("never sent"))])
    h = harness(tmp_path, {"a": (route(), provider)}, ledger=FailingLedger(on="append"))
    with pytest.raises(OSError, match="disk full"):
        await h.chat()
    assert provider.sent == []  # nothing is dispatched without its durable row
    assert await h.outstanding() == []


async def test_a_failed_settlement_write_is_logged_and_counted_not_swallowed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    provider = ScriptedProvider([Answer(chat_body("answered"))])
    h = harness(tmp_path, {"a": (route(), provider)}, ledger=FailingLedger(on="update"))
    reply = await h.chat()
    assert reply.status == 200 and reply.settling
    with caplog.at_level(logging.ERROR, logger="ncap.lifecycle"):
        await settled(h.gateway)
    assert [r.getMessage() for r in caplog.records] == ["settlement failed: OSError"]
    assert h.metrics.registry.get_sample_value("ncap_bookkeeping_failures_total") == 1
    (row,) = await h.rows()
    assert row.state == "reserved"  # left for recovery (gateway_lost), never faked


async def test_an_attempt_is_closed_exactly_once(tmp_path: Path) -> None:
    h = harness(tmp_path, {"a": (route(), ScriptedProvider([]))})
    accounting = h.gateway.accounting
    body, request = parse_chat_request(b'{"model":"m","messages":[{"role":"user","content":"x"}]}')
    admitter = Admitter(
        h.gateway.config,
        accounting,
        grants=accounting.grants,
        metrics=accounting.metrics,
        clock=accounting.clock,
    )
    plan, holds = await admitter.admit("req-2", CALLER, request, body, [h.gateway.routes["a"]])
    attempt = await accounting.begin(plan, holds, 1, plan.usable_routes[0])
    await accounting.failed(attempt, AttemptFailed("timeout"))
    with pytest.raises(RuntimeError, match="closed twice"):
        await accounting.answered(attempt, AttemptReport(None, 1, {}, None, False, None))
    (row,) = await h.rows("req-2")
    assert (row.state, row.reconciliation_reason) == ("usage_reconciliation_required", "timeout")


async def test_upstream_mid_stream_failure_after_a_native_stream_is_not_retried(
    tmp_path: Path,
) -> None:
    provider = ScriptedProvider(
        [Stream(sse(chunk(0, "a"), done=False), then=AttemptFailed("timeout", partial=True))]
    )
    h = harness(tmp_path, {"a": (route(), provider)})
    reply = await h.chat(stream=True)
    out = events(await drain(reply.stream))
    assert (
        out[-1]["error"]["message"] == UpstreamError("The upstream stream failed mid-way.").args[0]
    )
    assert len(provider.sent) == 1
