"""Idempotency-Key and x-stainless-retry-count through the real gateway (SQLite budgets:
the records live in the budget file) with the official SDK."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ncap.auth.keys import hash_key
from ncap.testing.fake_upstream import FakeState
from tests.http.test_accounting import rows, settled_rows
from tests.support import ServerThread, gateway, gateway_config

MESSAGES: list[Any] = [{"role": "user", "content": "Pick a number."}]
BODY: dict[str, Any] = {"model": "fake-model", "messages": MESSAGES}


def _gw(fake: tuple[str, FakeState], tmp: Path, keep: bool) -> Iterator[ServerThread]:
    fake[1].reset()
    server = {"idempotency_keep_answers": keep, "idempotency_ttl_s": 60}
    with gateway(gateway_config(fake[0], tmp, server=server)) as running:
        yield running


@pytest.fixture
def gw409(fake: tuple[str, FakeState], tmp_path: Path) -> Iterator[ServerThread]:
    yield from _gw(fake, tmp_path, keep=False)


@pytest.fixture
def gw_keep(fake: tuple[str, FakeState], tmp_path: Path) -> Iterator[ServerThread]:
    yield from _gw(fake, tmp_path, keep=True)


def _post(gw: ServerThread, key: str, body: dict[str, Any] = BODY, **h: str) -> httpx.Response:
    headers = {"Idempotency-Key": key, **h}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_a_repeat_without_kept_answers_is_409_naming_the_first(
    gw409: ServerThread, fake_state: FakeState, tmp_path: Path
) -> None:
    key = uuid.uuid4().hex
    first = _post(gw409, key, **{"x-stainless-retry-count": "0"})
    assert first.status_code == 200, first.text
    first_id = first.headers["x-request-id"]
    again = _post(gw409, key, **{"x-stainless-retry-count": "1"})
    assert again.status_code == 409
    error = again.json()["error"]
    assert error["code"] == "idempotency_key_reused" and first_id in error["message"]
    assert again.headers["x-should-retry"] == "false"
    assert fake_state.requests == 1
    dup = asyncio.run(rows(tmp_path, again.headers["x-request-id"]))
    assert [(r.state, r.policy_reason, r.client_retry_count, r.cost_micros) for r in dup] == [
        ("denied", "idempotency_key_reused", 1, None)
    ]
    settled = asyncio.run(settled_rows(tmp_path, first_id))
    assert [r.client_retry_count for r in settled] == [0]


def test_the_same_key_with_another_body_is_400(
    gw409: ServerThread, fake_state: FakeState, tmp_path: Path
) -> None:
    key = uuid.uuid4().hex
    assert _post(gw409, key).status_code == 200
    other = {**BODY, "messages": [{"role": "user", "content": "Something else."}]}
    refused = _post(gw409, key, other)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "idempotency_key_mismatch"
    # key order and spacing are not a different body
    reordered = {"messages": MESSAGES, "model": "fake-model"}
    assert _post(gw409, key, reordered).json()["error"]["code"] == "idempotency_key_reused"
    assert fake_state.requests == 1
    denied = asyncio.run(rows(tmp_path, refused.headers["x-request-id"]))
    assert [(r.policy_reason, r.denied_by) for r in denied] == [
        ("idempotency_key_mismatch", "idempotency_key")
    ]


def test_keys_are_scoped_to_the_workload_and_absent_keys_change_nothing(
    gw409: ServerThread, fake_state: FakeState
) -> None:
    assert httpx.post(gw409.url + "/v1/chat/completions", json=BODY).status_code == 200
    assert httpx.post(gw409.url + "/v1/chat/completions", json=BODY).status_code == 200
    assert fake_state.requests == 2
    too_long = _post(gw409, "k" * 256)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "Idempotency-Key"


def test_a_kept_answer_is_replayed_and_an_in_flight_repeat_waits_for_it(
    gw_keep: ServerThread, fake_state: FakeState, tmp_path: Path
) -> None:
    key = uuid.uuid4().hex
    slow = {"x-fake-fault": "latency=800"}

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as http:
            url = gw_keep.url + "/v1/chat/completions"
            first = asyncio.create_task(
                http.post(url, json=BODY, headers={"Idempotency-Key": key, **slow})
            )
            await asyncio.sleep(0.3)  # the first is upstream now
            second = await http.post(url, json=BODY, headers={"Idempotency-Key": key, **slow})
            return [await first, second]

    first, second = asyncio.run(both())
    assert first.status_code == second.status_code == 200
    assert first.json() == second.json()
    assert second.headers["x-ncap-idempotent-replay"] == first.headers["x-request-id"]
    assert fake_state.requests == 1
    replayed = asyncio.run(rows(tmp_path, second.headers["x-request-id"]))
    assert [(r.state, r.policy_reason, r.cost_micros) for r in replayed] == [
        ("denied", "idempotent_replay", None)
    ]
    later = openai.OpenAI(base_url=gw_keep.url + "/v1", api_key="sk-x", max_retries=0)
    third = later.chat.completions.create(
        model="fake-model", messages=MESSAGES, extra_headers={"Idempotency-Key": key}
    )
    assert third.id == first.json()["id"] and fake_state.requests == 1


def test_a_stream_is_never_replayed(gw_keep: ServerThread, fake_state: FakeState) -> None:
    key = uuid.uuid4().hex
    sdk = openai.OpenAI(base_url=gw_keep.url + "/v1", api_key="sk-x", max_retries=0)
    stream = sdk.chat.completions.create(
        model="fake-model", messages=MESSAGES, stream=True, extra_headers={"Idempotency-Key": key}
    )
    assert list(stream)
    with pytest.raises(openai.ConflictError) as caught:
        sdk.chat.completions.create(
            model="fake-model",
            messages=MESSAGES,
            stream=True,
            extra_headers={"Idempotency-Key": key},
        )
    assert caught.value.code == "idempotency_key_reused"
    assert fake_state.requests == 1


def test_a_failed_first_request_withdraws_its_key(
    gw409: ServerThread, fake_state: FakeState
) -> None:
    """A refused (or failed) first request leaves nothing to protect: the same key and
    body are decided again, not answered with 409."""
    key = uuid.uuid4().hex
    too_many = {**BODY, "n": 10}
    for _ in range(2):
        refused = _post(gw409, key, too_many)
        assert refused.json()["error"]["code"] == "candidate_count_exceeds_policy"
    assert fake_state.requests == 0


def test_a_keyed_caller_s_retry_count_is_recorded_with_its_workload(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    fake[1].reset()
    keys = [{"hash": hash_key("sk-eval-key"), "workload": "default", "environment": "eval"}]
    with gateway(gateway_config(fake[0], tmp_path, keys=keys)) as gw:
        headers = {"Authorization": "Bearer sk-eval-key", "x-stainless-retry-count": "3"}
        r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        (row,) = asyncio.run(settled_rows(tmp_path, r.headers["x-request-id"]))
    assert (row.client_retry_count, row.workload_id, row.environment) == (3, "default", "eval")
