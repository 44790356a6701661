"""A store going away mid-run: the gateway fails closed (503, nothing sent upstream),
/readyz names the store, and service resumes by itself when the store is back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from ncap.domain.events import LedgerEvent
from ncap.testing.fake_upstream import FakeState
from tests.scale.support import BEAT, Client, chat, client, holds, rows, wait_for
from tests.servers import private_redis, tcp_proxy
from tests.services import PG_URL, pg_schema
from tests.support import gateway, gateway_config


async def _served(http: Client, url: str) -> bool:
    return (await http.post(url + "/v1/chat/completions", json=chat())).status_code == 200


async def _outage_then_recovery(
    http: Client,
    url: str,
    fake: FakeState,
    store: str,
    cut: Callable[[], None],
    restore: Callable[[], None],
) -> None:
    ok = await http.post(url + "/v1/chat/completions", json=chat())
    assert ok.status_code == 200, ok.text
    sent = fake.requests
    await asyncio.to_thread(cut)
    for _ in range(3):
        down = await http.post(url + "/v1/chat/completions", json=chat())
        assert down.status_code == 503, down.text
        error = down.json()["error"]
        assert error["code"] == "store_unavailable" and store in error["message"]
    assert fake.requests == sent, "a request was sent upstream without metering"
    ready = await http.get(url + "/readyz")
    assert ready.status_code == 503
    backend = "redis" if store == "budgets" else "postgresql"
    assert any(p.startswith(f"{store} ({backend}): ") for p in ready.json()["problems"]), ready.text
    named = ready.json()["stores"][store]
    assert named["backend"] == backend and named["ready"] is False and named["error"]
    await asyncio.to_thread(restore)
    assert await wait_for(lambda: _served(http, url), timeout=20, every=0.2)
    assert (await http.get(url + "/readyz")).status_code == 200
    assert fake.requests == sent + 1  # the first request served again; nothing replayed


@pytest.mark.redis
async def test_redis_stopped_mid_run(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    with private_redis(tmp_path) as redis_server:
        config = gateway_config(
            fake[0],
            tmp_path,
            stores={"budgets": redis_server.url + "?prefix=outage"},
            server=BEAT,
        )
        fake[1].reset()
        with gateway(config) as gw:
            async with client() as http:
                await _outage_then_recovery(
                    http, gw.url, fake[1], "budgets", redis_server.stop, redis_server.start
                )


@pytest.mark.postgresql
async def test_postgresql_cut_mid_run(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    target = urlsplit(PG_URL)
    async with pg_schema() as ledger_url:
        with tcp_proxy(target.hostname or "127.0.0.1", target.port or 5432) as proxy:
            proxied = ledger_url.replace(
                f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}"
            )
            config = gateway_config(fake[0], tmp_path, stores={"ledger": proxied}, server=BEAT)
            fake[1].reset()
            with gateway(config) as gw:
                async with client() as http:
                    await _outage_then_recovery(
                        http, gw.url, fake[1], "ledger", proxy.cut, proxy.restore
                    )
            budgets = f"sqlite:///{tmp_path}/budgets.db"
            assert await holds(budgets) == []  # the refused requests' holds were released


@pytest.mark.redis
async def test_a_settlement_that_meets_a_redis_outage_is_retried_until_redis_is_back(
    fake: tuple[str, FakeState], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis goes away while a request is upstream: the answer still reaches the
    client, its row stays ``reserved`` and its hold active while Redis is down, and
    both settle by themselves once Redis is back (the gateway is never restarted)."""
    with private_redis(tmp_path, persist=True) as redis_server:
        budgets = redis_server.url + "?prefix=retry"
        config = gateway_config(
            fake[0],
            tmp_path,
            stores={"budgets": budgets},
            server=BEAT,
            routes={"fake": {"headers": {"x-fake-fault": "latency=1500"}, "timeout_s": 30}},
        )
        fake[1].reset()
        with gateway(config) as gw:
            async with client() as http:
                answer = asyncio.create_task(
                    http.post(gw.url + "/v1/chat/completions", json=chat())
                )
                assert await wait_for(lambda: _upstream_busy(fake[1]), timeout=10, every=0.02)
                await asyncio.to_thread(redis_server.stop)
                reply = await answer
                assert reply.status_code == 200, reply.text
                await asyncio.sleep(1.0)  # several retries fail meanwhile
                (row,) = await rows_of(tmp_path)
                assert row.state == "reserved"
                await asyncio.to_thread(redis_server.start)
                assert len(await holds(budgets)) == 1  # the hold survived, still active

                async def settled() -> bool:
                    (row,) = await rows_of(tmp_path)
                    return row.state == "settled"

                assert await wait_for(settled, timeout=20, every=0.1)
                assert await holds(budgets) == []
        deferred = [r for r in caplog.records if "settlement deferred" in r.getMessage()]
        assert len(deferred) == 1  # logged once, not once per retry


async def _upstream_busy(fake: FakeState) -> bool:
    return fake.in_flight > 0


async def rows_of(tmp: Path) -> list[LedgerEvent]:
    return await rows(f"sqlite:///{tmp}/ledger.db")
