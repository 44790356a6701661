"""Pins found by mutation testing (docs/mutation.md) for the Idempotency-Key hook, over
the scripted provider and the in-memory record store: what a repeat is told, word for
word, the denial row it writes (every column), the replayed answer, and the claim a
failed first request withdraws (socket-free; the HTTP tests cover the wire)."""

from __future__ import annotations

import hashlib
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest

import ncap.lifecycle.idempotency as idem
from ncap.config import parse_route
from ncap.errors import (
    IdempotencyKeyMismatch,
    IdempotencyKeyReused,
    InvalidValue,
    StoreUnavailable,
    UpstreamError,
)
from ncap.lifecycle import Caller, Gateway, Reply, RouteRuntime
from ncap.lifecycle.idempotency import IN_FLIGHT_S
from ncap.providers.base import AttemptFailed
from ncap.stores.memory.idempotency import MemoryIdempotency
from ncap.testing.scripted import Answer, Fail, ScriptedProvider, Stream, chat_body, chunk, sse
from tests.lifecycle.harness import CALLER, Harness, drain, harness, route, settled

TTL = 120.0
_encode_bytes = msgspec.json.encode
REPEATER = Caller("default", "test", client_retry_count=3)


def _raw(**body: Any) -> bytes:
    return msgspec.json.encode(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    )


class Recording(MemoryIdempotency):
    """The in-memory records, with every swap's arguments (a failing one on demand)."""

    def __init__(self, *, swap_fails: bool = False) -> None:
        super().__init__()
        self.swaps: list[tuple[str, bytes, bytes | None, float]] = []
        self.swap_fails = swap_fails

    async def swap(self, key: str, expected: bytes, record: bytes | None, ttl_s: float) -> bool:
        self.swaps.append((key, expected, record, ttl_s))
        if self.swap_fails:
            raise StoreUnavailable("budgets", "Redis", "ConnectionError")
        return await super().swap(key, expected, record, ttl_s)


def _gateway(
    tmp: Path,
    steps: list[Any],
    *,
    keep: bool = False,
    store: MemoryIdempotency | None = None,
    **route_fields: Any,
) -> tuple[Harness, Gateway, ScriptedProvider, MemoryIdempotency]:
    provider = ScriptedProvider(steps)
    server = {"idempotency_ttl_s": TTL, "idempotency_keep_answers": keep}
    h = harness(tmp, {"a": (route(**route_fields), provider)}, server=server)
    store = store or Recording()
    gw = Gateway(h.gateway.config, h.gateway.routes, h.gateway.accounting, idempotency=store)
    return h, gw, provider, store


async def _answered(gw: Gateway, raw: bytes, request_id: str, key: str = "k") -> bytes:
    reply = await gw.chat(raw, CALLER, request_id, idempotency_key=key)
    assert reply.status == 200
    if reply.settling:
        await settled(gw)
    if reply.stream is not None:
        return b"".join(await drain(reply.stream))
    return reply.body


async def test_a_repeat_is_refused_word_for_word_with_its_own_denial_row(tmp_path: Path) -> None:
    h, gw, provider, _ = _gateway(
        tmp_path, [Answer(chat_body("a", "b"))], upstream_model="up-model"
    )
    await _answered(gw, _raw(n=2, temperature=1.0), "req-1")
    before = datetime.now(UTC)
    with pytest.raises(IdempotencyKeyReused) as info:
        await gw.chat(_raw(n=2, temperature=1.0), REPEATER, "req-2", idempotency_key="k")
    after = datetime.now(UTC)
    assert info.value.message == (
        "A request with this Idempotency-Key and body was already sent as request req-1; "
        "it is not dispatched again."
    )
    assert info.value.param == "Idempotency-Key"
    assert len(provider.sent) == 1  # not dispatched again
    (row,) = await h.rows("req-2")
    assert before <= row.timestamp <= after
    assert (row.request_id, row.attempt, row.workload_id, row.environment) == (
        "req-2",
        0,
        "default",
        "test",
    )
    assert (row.route_id, row.model_alias, row.upstream_model) == ("a", "m", "up-model")
    assert (row.requested_candidate_count, row.effective_candidate_count) == (2, 2)
    assert (row.stream_mode, row.quota_scope, row.gateway_instance) == (False, "instance", "test")
    assert (row.policy_result, row.policy_reason, row.state) == (
        "deny",
        "idempotency_key_reused",
        "denied",
    )
    assert (row.denied_by, row.client_retry_count) == ("idempotency_key", 3)
    assert (row.reserved_cost_micros, row.cost_micros) == (0, None)
    labels = {"workload": "default", "policy_result": "deny", "reason": "idempotency_key_reused"}
    assert h.metrics.registry.get_sample_value("ncap_requests_total", labels) == 1


async def test_a_repeat_without_n_records_one_candidate_and_the_alias(tmp_path: Path) -> None:
    h, gw, _, _ = _gateway(tmp_path, [Answer(chat_body("a"))])
    await _answered(gw, _raw(), "req-1")
    with pytest.raises(IdempotencyKeyReused):
        await gw.chat(_raw(), CALLER, "req-2", idempotency_key="k")
    (row,) = await h.rows("req-2")
    assert (row.requested_candidate_count, row.effective_candidate_count) == (None, 1)
    assert (row.upstream_model, row.client_retry_count) == ("m", None)


async def test_the_same_key_with_another_body_word_for_word(tmp_path: Path) -> None:
    h, gw, provider, _ = _gateway(tmp_path, [Answer(chat_body("a"))])
    await _answered(gw, _raw(), "req-1")
    with pytest.raises(IdempotencyKeyMismatch) as info:
        await gw.chat(_raw(temperature=0.5), CALLER, "req-2", idempotency_key="k")
    assert info.value.message == (
        "This Idempotency-Key was used by request req-1 with another request body; use a "
        "new key for a new request."
    )
    assert info.value.param == "Idempotency-Key"
    assert len(provider.sent) == 1
    (row,) = await h.rows("req-2")
    assert (row.policy_reason, row.denied_by) == ("idempotency_key_mismatch", "idempotency_key")


async def test_key_order_and_spacing_are_the_same_body(tmp_path: Path) -> None:
    _, gw, provider, _ = _gateway(tmp_path, [Answer(chat_body("a"))])
    await _answered(gw, b'{"model":"m","messages":[{"role":"user","content":"hi"}]}', "req-1")
    spaced = b'{"messages": [{"content": "hi", "role": "user"}], "model": "m"}'
    with pytest.raises(IdempotencyKeyReused):
        await gw.chat(spaced, CALLER, "req-2", idempotency_key="k")
    assert len(provider.sent) == 1


async def test_a_stream_is_never_replayed_and_says_so(tmp_path: Path) -> None:
    text = sse(chunk(0, "hi"), chunk(0, finish="stop"), chunk(None, usage=(3, 1)))
    h, gw, _, _ = _gateway(tmp_path, [Stream(text)], keep=True)
    await _answered(gw, _raw(stream=True), "req-1")
    with pytest.raises(IdempotencyKeyReused) as info:
        await gw.chat(_raw(stream=True), CALLER, "req-2", idempotency_key="k")
    assert info.value.message == (
        "A request with this Idempotency-Key and body was already sent as request req-1 "
        "(a stream, never replayed); it is not dispatched again."
    )
    (row,) = await h.rows("req-2")
    assert row.stream_mode is True


async def test_a_kept_answer_is_replayed_with_its_headers(tmp_path: Path) -> None:
    h, gw, provider, _ = _gateway(tmp_path, [Answer(chat_body("a"))], keep=True)
    first = await gw.chat(_raw(), CALLER, "req-1", idempotency_key="k")
    assert first.settling
    await settled(gw)
    replay = await gw.chat(_raw(), CALLER, "req-2", idempotency_key="k")
    assert (replay.status, replay.body, replay.stream) == (200, first.body, None)
    assert replay.headers == first.headers | {"x-ncap-idempotent-replay": "req-1"}
    assert len(provider.sent) == 1
    (row,) = await h.rows("req-2")
    assert (row.policy_reason, row.state) == ("idempotent_replay", "denied")


async def test_a_failed_first_request_withdraws_its_claim(tmp_path: Path) -> None:
    refused = Fail(AttemptFailed("status", 404))
    _, gw, provider, store = _gateway(tmp_path, [refused, Answer(chat_body("a"))])
    with pytest.raises(UpstreamError):
        await gw.chat(_raw(), CALLER, "req-1", idempotency_key="k")
    assert isinstance(store, Recording)
    scoped = f"default:{hashlib.sha256(b'k').hexdigest()}"
    ((key, expected, record, ttl),) = store.swaps
    assert (key, record, ttl) == (scoped, None, TTL)
    assert msgspec.json.decode(expected)["request_id"] == "req-1"
    assert await store.get(scoped) is None  # withdrawn: the retry may run
    await _answered(gw, _raw(), "req-2")
    assert len(provider.sent) == 2


async def test_a_store_error_on_withdrawal_keeps_the_requests_own_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Recording(swap_fails=True)
    _, gw, _, _ = _gateway(tmp_path, [Fail(AttemptFailed("status", 404))], store=store)
    with caplog.at_level(logging.WARNING, "ncap.lifecycle"), pytest.raises(UpstreamError):
        await gw.chat(_raw(), CALLER, "req-1", idempotency_key="k")
    assert "idempotency key not withdrawn: StoreUnavailable" in caplog.messages


async def test_the_key_is_claimed_for_the_in_flight_bound_at_most(tmp_path: Path) -> None:
    _, gw, _, store = _gateway(tmp_path, [Answer(chat_body("a"))])
    await _answered(gw, _raw(), "req-1")
    assert isinstance(store, Recording)
    ((_, _, done, ttl),) = store.swaps  # marked done for the whole TTL
    assert ttl == TTL and msgspec.json.decode(done or b"{}")["done"] is True
    assert min(TTL, IN_FLIGHT_S) == TTL


@pytest.mark.parametrize("key", ["", "k" * 256])
async def test_a_key_of_the_wrong_length_word_for_word(tmp_path: Path, key: str) -> None:
    _, gw, provider, _ = _gateway(tmp_path, [])
    with pytest.raises(InvalidValue) as info:
        await gw.chat(_raw(), CALLER, "req-1", idempotency_key=key)
    assert info.value.message == "Idempotency-Key must be 1 to 255 characters."
    assert info.value.param == "Idempotency-Key"
    assert provider.sent == []


async def test_a_key_of_255_characters_is_accepted(tmp_path: Path) -> None:
    _, gw, _, _ = _gateway(tmp_path, [Answer(chat_body("a"))])
    await _answered(gw, _raw(), "req-1", key="k" * 255)


# -- a repeat while the first is still running: wait (polling the store), then as above ----

RAW = _raw()
SCOPED = f"default:{hashlib.sha256(b'k').hexdigest()}"


class Clock:
    """The hook's monotonic clock, advanced by each poll's sleep."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _record(
    raw: bytes = RAW, *, stream: bool = False, done: bool = False, answer: Any = None
) -> bytes:
    return idem._encode(
        idem._Record(idem._body_hash(raw), "req-1", stream, done=done, answer=answer)
    )


def _hook(
    tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    on_sleep: Any = None,
    *,
    ttl: float = 600.0,
    keep: bool = True,
) -> tuple[idem.Idempotency, MemoryIdempotency, list[float], Clock, Harness]:
    h = harness(tmp, {"a": (route(), ScriptedProvider([]))})
    store = MemoryIdempotency()
    clock = Clock()
    monkeypatch.setattr(idem, "time", clock)
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock.now += 300
        if on_sleep is not None:
            await on_sleep(store)

    hook = idem.Idempotency(store, h.gateway.accounting, ttl_s=ttl, keep_answers=keep, sleep=sleep)
    return hook, store, sleeps, clock, h


def _request(
    raw: bytes = RAW, *, request_id: str = "req-2", stream: bool = False
) -> idem.IdempotentRequest:
    primary = RouteRuntime("a", parse_route(route()), ScriptedProvider([]))
    return idem.IdempotentRequest("k", raw, CALLER, request_id, "m", primary, stream, None)


def _never() -> Any:
    async def dispatch() -> Reply:
        raise AssertionError("a repeat is never dispatched")

    return dispatch


async def test_a_repeat_waits_for_the_first_then_gets_its_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    answer = idem._Answer(200, {"content-type": "application/json"}, b'{"id":"x"}')

    async def first_finishes(store: MemoryIdempotency) -> None:
        await store.swap(SCOPED, _record(), _record(done=True, answer=answer), 600)

    hook, store, sleeps, _, _ = _hook(tmp_path, monkeypatch, first_finishes)
    await store.claim(SCOPED, _record(), 600)
    reply = await hook.run(_request(), _never())
    assert (reply.status, reply.body) == (200, b'{"id":"x"}')
    assert reply.headers == {
        "content-type": "application/json",
        "x-ncap-idempotent-replay": "req-1",
    }
    assert sleeps == [0.05]  # one poll, of the default interval


async def test_a_repeat_waits_at_most_the_in_flight_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook, store, sleeps, _, h = _hook(tmp_path, monkeypatch)
    await store.claim(SCOPED, _record(), 600)
    with pytest.raises(IdempotencyKeyReused) as info:
        await hook.run(_request(), _never())
    assert "already sent as request req-1;" in info.value.message
    # 1000 → deadline 1600; polled at 1300, 1600 (not yet past), 1900 (past)
    assert sleeps == [0.05] * 3
    (row,) = await h.rows("req-2")
    assert row.policy_reason == "idempotency_key_reused"


async def test_the_in_flight_bound_is_the_ttl_when_shorter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook, store, sleeps, _, _ = _hook(tmp_path, monkeypatch, ttl=500.0)
    await store.claim(SCOPED, _record(), 600)
    with pytest.raises(IdempotencyKeyReused):
        await hook.run(_request(), _never())
    assert sleeps == [0.05] * 2  # deadline 1500: past at 1600


async def test_a_first_that_withdraws_lets_the_repeat_claim_and_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def first_fails(store: MemoryIdempotency) -> None:
        assert await store.swap(SCOPED, _record(), None, 600)

    hook, store, sleeps, _, _ = _hook(tmp_path, monkeypatch, first_fails, keep=False)
    await store.claim(SCOPED, _record(), 600)

    async def dispatch() -> Reply:
        return Reply(200, {"content-type": "application/json"}, b"{}")

    reply = await hook.run(_request(), dispatch)
    assert reply.status == 200 and sleeps == [0.05]
    found = await store.get(SCOPED)
    assert found is not None  # the repeat held the key, and marked it done
    record = msgspec.json.decode(found)
    assert (record["request_id"], record["done"], record["answer"]) == ("req-2", True, None)


@pytest.mark.parametrize(
    ("first", "error", "words"),
    [
        (_record(done=True), IdempotencyKeyReused, "already sent as request req-1;"),
        (_record(stream=True), IdempotencyKeyReused, "req-1 (a stream, never replayed);"),
        (_record(_raw(temperature=0.5)), IdempotencyKeyMismatch, "used by request req-1"),
    ],
    ids=["done", "a running stream", "another body, running"],
)
async def test_no_reason_to_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: bytes, error: type, words: str
) -> None:
    async def no_poll(store: MemoryIdempotency) -> None:
        raise AssertionError("nothing to wait for")

    hook, store, _, _, _ = _hook(tmp_path, monkeypatch, no_poll)
    await store.claim(SCOPED, first, 600)
    with pytest.raises(error) as info:
        await hook.run(_request(), _never())
    assert words in info.value.message


async def test_a_kept_answer_keeps_only_the_gateways_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook, store, _, _, _ = _hook(tmp_path, monkeypatch)
    headers = {
        "content-type": "application/json",
        "x-ncap-route": "a",
        "set-cookie": "s",
        "x-request-id": "r",
    }

    async def dispatch() -> Reply:
        return Reply(201, headers, b"body")

    await hook.run(_request(request_id="req-1"), dispatch)
    found = await store.get(SCOPED)
    assert found is not None
    record = msgspec.json.decode(found)
    assert record == {
        "body_hash": idem._body_hash(RAW),
        "request_id": "req-1",
        "stream": False,
        "done": True,
        "answer": {
            "status": 201,
            "headers": {"content-type": "application/json", "x-ncap-route": "a"},
            "body": msgspec.json.decode(_encode_bytes(b"body")),
        },
    }


async def test_a_streamed_answer_is_never_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook, store, _, _, _ = _hook(tmp_path, monkeypatch)

    async def chunks() -> Any:
        yield b"data: [DONE]\n\n"

    async def dispatch() -> Reply:
        return Reply(200, {"content-type": "text/event-stream"}, stream=chunks())

    await hook.run(_request(request_id="req-1", stream=True), dispatch)
    found = await store.get(SCOPED)
    assert found is not None
    record = msgspec.json.decode(found)
    assert (record["done"], record["stream"], record["answer"]) == (True, True, None)


async def test_a_store_error_marking_done_is_logged_by_class(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, gw, _, _ = _gateway(tmp_path, [Answer(chat_body("a"))], store=Recording(swap_fails=True))
    with caplog.at_level(logging.WARNING, "ncap.lifecycle"):
        await _answered(gw, _raw(), "req-1")
    assert "idempotency key not marked done: StoreUnavailable" in caplog.messages
