"""The official SDK retrying a request whose first try timed out
at the client, and a second replica receiving the same Idempotency-Key: one upstream
call in all, and the ledger shows every try with its x-stainless-retry-count."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest

from ncap.testing.fake_upstream import FakeState
from tests.scale.support import BEAT, gateways, rows, shared_config, wait_for
from tests.services import pg_schema, redis_prefix

pytestmark = [pytest.mark.postgresql, pytest.mark.redis]

MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]
UPSTREAM_MS = 2500  # the fake's answer takes this long
SDK_TIMEOUT_S = 1.0  # the client gives up on each try well before that


def _sdk(url: str, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-client", **kw)


async def test_sdk_retry_after_a_client_timeout_and_a_second_replica_make_one_upstream_call(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    async with pg_schema() as ledger_url, redis_prefix() as budgets_url:
        config = shared_config(
            fake[0],
            tmp_path,
            ledger_url,
            budgets_url,
            server={**BEAT, "idempotency_keep_answers": True, "idempotency_ttl_s": 120},
            routes={
                "fake": {"headers": {"x-fake-fault": f"latency={UPSTREAM_MS}"}, "timeout_s": 30}
            },
        )
        fake[1].reset()
        key = f"idem-{uuid.uuid4().hex}"
        with gateways(config, 2, tmp_path / "gw.log") as (a, b):
            results: dict[str, Any] = {}

            def retrying() -> None:  # times out at the client, then retries (same key)
                sdk = _sdk(a.url, timeout=SDK_TIMEOUT_S, max_retries=4)
                results["a"] = sdk.chat.completions.with_raw_response.create(
                    model="fake-model", messages=MESSAGES, extra_headers={"Idempotency-Key": key}
                )

            def other_replica() -> None:  # the same key on the second gateway, mid-flight
                time.sleep(0.5)
                sdk = _sdk(b.url, timeout=30, max_retries=0)
                results["b"] = sdk.chat.completions.with_raw_response.create(
                    model="fake-model", messages=MESSAGES, extra_headers={"Idempotency-Key": key}
                )

            threads = [threading.Thread(target=f) for f in (retrying, other_replica)]
            started = time.monotonic()
            for t in threads:
                t.start()
            await asyncio.to_thread(lambda: [t.join(60) for t in threads])
            assert {"a", "b"} <= results.keys(), results
            assert time.monotonic() - started >= UPSTREAM_MS / 1000
            assert fake[1].requests == 1  # one upstream call in all
            got_a, got_b = results["a"].parse(), results["b"].parse()
            assert got_a.id == got_b.id  # both are the one upstream answer

            async def settled() -> list[Any]:
                found = await rows(ledger_url)
                return found if any(r.state == "settled" for r in found) else []

            ledger = await wait_for(settled)
        dispatched = [r for r in ledger if r.policy_result == "allow"]
        repeats = [r for r in ledger if r.policy_result == "deny"]
        assert len(dispatched) == 1 and dispatched[0].state == "settled"
        first = dispatched[0]
        assert first.client_retry_count == 0 and first.cost_micros
        assert all(r.policy_reason == "idempotent_replay" for r in repeats), repeats
        assert all(r.cost_micros is None and r.denied_by == "idempotency_key" for r in repeats)
        # gateway B's one try (the SDK's try 0), on the other replica
        b_rows = [r for r in repeats if r.gateway_instance != first.gateway_instance]
        assert [r.client_retry_count for r in b_rows] == [0]
        # gateway A: try 0 dispatched, then the SDK's retries 1, 2, … each a row of its own
        a_retries = sorted(
            r.client_retry_count or 0
            for r in repeats
            if r.gateway_instance == first.gateway_instance
        )
        assert a_retries and a_retries == list(range(1, len(a_retries) + 1))
        assert len({r.request_id for r in ledger}) == len(ledger) == 2 + len(a_retries)
