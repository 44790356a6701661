"""The admin store on a shared ledger: two gateways on one
PostgreSQL schema (replicas) or one SQLite file (``--workers``) see each other's admin
changes within ``stores.admin_refresh_s`` (a key created on one is accepted by the
other, a revoked one refused by both), and an admin call while PostgreSQL is
unreachable is an OpenAI-shaped 503, never a 500."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from ncap.auth import hash_key
from ncap.config import Config
from ncap.http.app import create_app
from ncap.testing.fake_upstream import FakeState
from tests.scale.support import BEAT, wait_for
from tests.servers import tcp_proxy
from tests.services import PG_URL, pg_schema
from tests.support import ServerThread, gateway_config

ADMIN_ENV = "NCAP_TEST_ADMIN_KEY"
ADMIN = {"Authorization": "Bearer admin-secret-for-tests", "X-Ncap-Actor": "ops@example.com"}
CONFIG_KEY = "ncap-config-key-for-tests"  # keys are required from the start
REFRESH_S = 0.3


@pytest.fixture(autouse=True)
def admin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_ENV, ADMIN["Authorization"].removeprefix("Bearer "))


def _config(fake_url: str, tmp: Path, ledger: str, instance: str) -> Config:
    return gateway_config(
        fake_url,
        tmp,
        stores={"ledger": ledger, "budgets": "memory://", "admin_refresh_s": REFRESH_S},
        server={**BEAT, "admin_key_env": ADMIN_ENV, "instance_id": instance},
        keys=[{"hash": hash_key(CONFIG_KEY), "workload": "default", "label": "config"}],
    )


@contextmanager
def _replicas(fake_url: str, tmp: Path, ledger: str, n: int = 2) -> Iterator[list[ServerThread]]:
    started: list[ServerThread] = []
    try:
        for i in range(n):
            config = _config(fake_url, tmp, ledger, f"gw-{i}")
            started.append(ServerThread(lambda c=config: create_app(c)).start())
        yield started
    finally:
        for server in started:
            server.stop()


async def _models(http: httpx.AsyncClient, gw: ServerThread, key: str) -> int:
    reply = await http.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    return reply.status_code


@pytest.fixture(params=[pytest.param("postgresql", marks=pytest.mark.postgresql), "sqlite"])
async def shared_ledger(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/ledger.db"
        return
    async with pg_schema() as url:
        yield url


async def test_a_key_made_on_one_replica_works_on_the_other_and_its_revocation_too(
    fake: tuple[str, FakeState], tmp_path: Path, shared_ledger: str
) -> None:
    ledger = shared_ledger
    async with httpx.AsyncClient(timeout=10) as http:
        with _replicas(fake[0], tmp_path, ledger) as (a, b):
            made = await http.post(
                a.url + "/admin/keys", json={"workload": "default", "label": "ci"}, headers=ADMIN
            )
            assert made.status_code == 201, made.text
            key = made.json()["key"]
            assert await _models(http, a, key) == 200  # at once where it was made
            since = time.monotonic()

            async def b_accepts() -> bool:
                return await _models(http, b, key) == 200

            assert await wait_for(b_accepts, timeout=10, every=0.05)
            seen_after = time.monotonic() - since
            # an exception made on b is listed (and in force) on a
            grant: dict[str, Any] = {
                "id": "eval-q4",
                "workload": "default",
                "owner": "finops@example.com",
                "max_candidates": 4,
                "expires": "2099-01-01T00:00:00Z",
            }
            assert (
                await http.post(b.url + "/admin/exceptions", json=grant, headers=ADMIN)
            ).status_code == 201

            async def a_lists_it() -> bool:
                listed = await http.get(a.url + "/admin/exceptions", headers=ADMIN)
                return [e["id"] for e in listed.json()["data"]] == ["eval-q4"]

            assert await wait_for(a_lists_it, timeout=10, every=0.05)

            revoked = await http.delete(a.url + "/admin/keys/ci", headers=ADMIN)
            assert revoked.status_code == 200, revoked.text
            assert await _models(http, a, key) == 401
            since = time.monotonic()

            async def b_refuses() -> bool:
                return await _models(http, b, key) == 401

            assert await wait_for(b_refuses, timeout=10, every=0.05)
            refused_after = time.monotonic() - since
            # within the interval (and a slack for this shared machine)
            assert max(seen_after, refused_after) < REFRESH_S + 2.0
            assert await _models(http, b, CONFIG_KEY) == 200  # the config's key untouched
            # one audit trail, the same on both
            trails = [
                (await http.get(gw.url + "/admin/audit", headers=ADMIN)).json()["data"]
                for gw in (a, b)
            ]
            assert trails[0] == trails[1]
            assert [(e["action"], e["kind"]) for e in trails[0]] == [
                ("create", "key"),
                ("create", "exception"),
                ("revoke", "key"),
            ]
            # an id used through one replica is refused through the other
            again = await http.post(b.url + "/admin/exceptions", json=grant, headers=ADMIN)
            assert again.status_code == 400 and again.json()["error"]["param"] == "id"


@pytest.mark.postgresql
async def test_admin_calls_while_postgresql_is_unreachable_are_503s(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    target = urlsplit(PG_URL)
    async with pg_schema() as ledger_url, httpx.AsyncClient(timeout=30) as http:
        with tcp_proxy(target.hostname or "127.0.0.1", target.port or 5432) as proxy:
            proxied = ledger_url.replace(
                f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}"
            )
            with _replicas(fake[0], tmp_path, proxied, n=1) as (gw,):
                body = {"workload": "default", "label": "ci"}
                assert (
                    await http.post(gw.url + "/admin/keys", json=body, headers=ADMIN)
                ).status_code == 201
                proxy.cut()
                calls = [
                    http.post(gw.url + "/admin/keys", json={"workload": "default"}, headers=ADMIN),
                    http.delete(gw.url + "/admin/keys/ci", headers=ADMIN),
                    http.get(gw.url + "/admin/audit", headers=ADMIN),
                ]
                for call in calls:
                    down = await call
                    assert down.status_code == 503, down.text
                    error = down.json()["error"]
                    assert (error["type"], error["code"]) == ("server_error", "store_unavailable")
                    assert error["message"].startswith(
                        "The gateway's admin store (PostgreSQL) is unavailable; "
                    )
                    assert down.headers["retry-after"] == "1"
                # what is in memory still answers; the key it had is still listed
                listed = await http.get(gw.url + "/admin/keys", headers=ADMIN)
                assert [k["label"] for k in listed.json()["data"]] == ["config", "ci"]
                proxy.restore()

                async def revoked() -> bool:
                    reply = await http.delete(gw.url + "/admin/keys/ci", headers=ADMIN)
                    return reply.status_code == 200

                assert await wait_for(revoked, timeout=20, every=0.2)
                trail = (await http.get(gw.url + "/admin/audit", headers=ADMIN)).json()["data"]
                assert [(e["action"], e["kind"]) for e in trail] == [
                    ("create", "key"),
                    ("revoke", "key"),
                ]
