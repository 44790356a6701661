"""A store going away mid-run: the gateway fails closed (503, nothing sent upstream),
/readyz names the store, and service resumes by itself when the store is back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from ncap.testing.fake_upstream import FakeState
from tests.scale.support import BEAT, Client, chat, client, holds, wait_for
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
    assert any(p.startswith(store) for p in ready.json()["problems"]), ready.text
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
