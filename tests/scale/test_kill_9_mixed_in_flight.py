"""``kill -9`` of an ``ncap serve`` on the shipped default stores (a SQLite ledger,
in-process budgets rebuilt from it) with 20 requests in flight, whole and streamed
(some streams already relaying), then a restart on the same files.

Every attempt's row was durable before dispatch (``reserved``); the restart turns each
into ``usage_reconciliation_required``/``gateway_lost`` and changes nothing else in it;
the rebuilt budget holds every one of them at its full reservation (held, not spent,
their concurrency slots free), so the counters the restarted gateway exports are
exactly the sums the ledger implies, before and after it serves a new request.
"""

from __future__ import annotations

import asyncio
import signal
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from ncap.domain.events import LedgerEvent
from ncap.testing.fake_upstream import FakeState
from tests.golden.traffic import plain
from tests.scale.support import (
    chat,
    rows,
    shared_config,
    start,
    stop,
    wait_for,
    wait_ready,
)
from tests.support import UPSTREAM_KEY_ENV

WHOLE, STREAMED = 10, 10
HOLD_S = 60  # the upstream holds every request far longer than the test runs


def _route(fault: str) -> dict[str, Any]:
    return {
        "provider": "openai",
        "base_url": "",  # set below to the fake's URL
        "upstream_model": "fake-model",
        "api_key_env": UPSTREAM_KEY_ENV,
        "timeout_s": HOLD_S + 30,
        "retries": 0,
        "pricing": {"input_per_mtok": 0.15, "output_per_mtok": 0.6},
        "headers": {"x-fake-fault": fault},
        "contract": {
            "candidates": "native",
            "max_candidates": 8,
            "output_cap": "per_candidate",
            "stream_usage": "include_usage",
        },
    }


def _config(fake_url: str, tmp: Path) -> Path:
    # held before the answer starts, and held after a stream's first event went out
    routes = {
        "held": _route(f"latency={HOLD_S * 1000}"),
        "paused": _route(f"first_chunk_then_pause={HOLD_S * 1000}"),
    }
    for route in routes.values():
        route["base_url"] = fake_url
    return shared_config(
        fake_url,
        tmp,
        f"sqlite:///{tmp}/ledger.db",
        "memory://",
        server={"metrics_cache_s": 0},
        workloads={"default": {"max_candidates": 4, "output_ceiling": 64}},
        models={"held-model": ["held"], "paused-model": ["paused"]},
        routes=routes,
    )


def _bodies() -> list[dict[str, Any]]:
    """Whole and streamed, n of 1 to 3, output ceilings that differ: no two requests
    reserve the same, so a hold lost or counted twice changes the sums."""
    out = []
    for i in range(WHOLE):
        out.append({**chat("held-model"), "n": 1 + i % 3, "max_completion_tokens": 8 + i})
    for i in range(STREAMED):
        body = {**chat("paused-model" if i % 2 else "held-model"), "stream": True}
        body |= {"n": 1 + i % 2, "max_completion_tokens": 20 + i}
        if i % 3 == 0:
            body["stream_options"] = {"include_usage": True}
        out.append(body)
    return out


async def _send(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    """Post and read until the connection dies with the gateway."""
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as reply:
            return reply.status, await reply.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        return exc


def _metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == (f"{name}{{{wanted}}}" if labels else name):
            return float(value)
    raise AssertionError(f"{name}{labels} is not in /metrics:\n{text}")


def _held(events: list[LedgerEvent]) -> dict[str, int]:
    """What held attempts weigh in each window (their full reservations)."""
    tokens = sum(e.reserved_input_tokens + e.reserved_output_tokens for e in events)
    cost = sum(e.reserved_cost_micros for e in events)
    return {"tokens_day": tokens, "usd_micros_day": cost, "usd_micros_month": cost}


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as reply:
        assert reply.status == 200
        return await reply.text()


async def test_kill_9_with_20_whole_and_streamed_in_flight_on_the_default_stores(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    config, log = _config(fake[0], tmp_path), tmp_path / "gateway.log"
    ledger = f"sqlite:///{tmp_path}/ledger.db"
    fake[1].reset()
    first = start(config, log)
    try:
        await asyncio.to_thread(wait_ready, first)
        timeout = aiohttp.ClientTimeout(total=HOLD_S + 30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tasks = [asyncio.create_task(_send(session, first.url, b)) for b in _bodies()]

            async def all_reserved() -> list[LedgerEvent] | None:
                found = await rows(ledger)
                ready = len(found) == 20 and {e.state for e in found} == {"reserved"}
                return found if ready and fake[1].in_flight == 20 else None

            before = await wait_for(all_reserved, timeout=20, every=0.05)
            assert before, await rows(ledger)
            first.proc.send_signal(signal.SIGKILL)
            assert await asyncio.to_thread(first.proc.wait, 10) == -signal.SIGKILL
            outcomes = await asyncio.gather(*tasks)
        # no client got an answer: each lost its connection (a stream after its head)
        assert all(isinstance(o, Exception) for o in outcomes), outcomes
    finally:
        stop(first)

    # the kill left the rows as they were: durable, still reserved
    assert await rows(ledger) == before
    assert sorted(e.stream_mode for e in before) == [False] * WHOLE + [True] * STREAMED
    dead = {e.gateway_instance for e in before}
    assert len(dead) == 1

    second = start(config, log)
    try:
        await asyncio.to_thread(wait_ready, second)
        after = await rows(ledger)
        scraped_at = datetime.now(UTC)
        metrics = await _get(second.url)

        # every in-flight attempt recovered as lost, nothing else in its row changed
        assert len(after) == 20
        assert {(e.state, e.reconciliation_reason) for e in after} == {
            ("usage_reconciliation_required", "gateway_lost")
        }
        lost = {"state": "usage_reconciliation_required", "reconciliation_reason": "gateway_lost"}
        assert sorted(map(plain, after), key=_key) == sorted(
            ({**plain(e), **lost} for e in before), key=_key
        )
        assert all(e.total_tokens is None and e.cost_micros is None for e in after)

        # the rebuilt budget: every hold kept at its reservation, nothing spent
        held = _held(after)
        assert held["tokens_day"] > 0 and held["usd_micros_day"] > 0
        assert _metric(metrics, "ncap_reservations_outstanding") == 20
        assert _metric(metrics, "ncap_pending_reconciliation") == 20
        _assert_windows(metrics, held, spent=dict.fromkeys(held, 0))
        # kept, not active: no concurrency slot is held by the dead gateway's attempts
        assert _metric(metrics, "ncap_budget_spent", workload="default", window="concurrency") == 0
        if all(_same_minute(e.timestamp, scraped_at) for e in after):  # else a new minute
            minute = {"tokens_minute": held["tokens_day"], "requests_minute": 0}
            _assert_windows(metrics, minute, spent={"tokens_minute": 0, "requests_minute": 20})

        # the slots are free (no concurrency held) and a new answer is counted beside
        fake[1].reset()
        async with aiohttp.ClientSession() as session:
            body = {**chat(), "max_completion_tokens": 16}
            async with session.post(second.url + "/v1/chat/completions", json=body) as reply:
                assert reply.status == 200, await reply.text()
                request_id = reply.headers["x-request-id"]
        answered = await wait_for(lambda: _settled(ledger, request_id), timeout=10, every=0.05)
        assert answered is not None and answered.gateway_instance not in dead
        metrics = await _get(second.url)
        tokens, cost = answered.total_tokens, answered.cost_micros
        assert tokens and cost
        spent = {"tokens_day": tokens, "usd_micros_day": cost, "usd_micros_month": cost}
        _assert_windows(metrics, held, spent=spent)
        assert _metric(metrics, "ncap_reservations_outstanding") == 20
    finally:
        stop(second)


def _assert_windows(metrics: str, held: dict[str, int], spent: dict[str, int]) -> None:
    for window, amount in held.items():
        reserved = _metric(metrics, "ncap_budget_reserved", workload="default", window=window)
        used = _metric(metrics, "ncap_budget_spent", workload="default", window=window)
        assert (reserved, used) == (amount, spent[window]), window


def _key(row: dict[str, Any]) -> tuple[str, int]:
    return row["request_id"], row["attempt"]


def _same_minute(a: datetime, b: datetime) -> bool:
    return a.astimezone(UTC).isoformat()[:16] == b.astimezone(UTC).isoformat()[:16]


async def _settled(ledger: str, request_id: str) -> LedgerEvent | None:
    found = [e for e in await rows(ledger) if e.request_id == request_id]
    return found[0] if found and found[0].state == "settled" else None
