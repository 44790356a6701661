"""A graceful stop during a Redis outage, with settlements deferred: they are retried
until the shutdown deadline, and what is left stays where recovery finds it (the
instance stays registered), never ``reserved`` for ever."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import asyncpg
import pytest
from typer.testing import CliRunner

from ncap.cli.main import app as cli
from ncap.testing.fake_upstream import FakeState
from tests.scale.support import (
    chat,
    client,
    holds,
    rows,
    shared_config,
    start,
    stop,
    wait_for,
    wait_ready,
)
from tests.servers import private_redis
from tests.services import pg_schema

pytestmark = [pytest.mark.postgresql, pytest.mark.redis]

IN_FLIGHT = 6


async def _registered(ledger_url: str) -> list[str]:
    dsn, _, schema = ledger_url.partition("?schema=")
    conn = await asyncpg.connect(dsn, server_settings={"search_path": schema})
    try:
        return [r[0] for r in await conn.fetch("SELECT instance FROM gateway_instances")]
    finally:
        await conn.close()


async def _answered_then_redis_down(
    fake: FakeState, url: str, redis_stop: object, count: int = IN_FLIGHT
) -> None:
    async with client() as http:
        answers = [
            asyncio.create_task(http.post(url + "/v1/chat/completions", json=chat()))
            for _ in range(count)
        ]
        assert await wait_for(lambda: _upstream(fake, count), timeout=20, every=0.02)
        await asyncio.to_thread(redis_stop)  # type: ignore[arg-type]
        replies = await asyncio.gather(*answers)
    assert [r.status_code for r in replies] == [200] * count
    await asyncio.sleep(0.5)  # their settlements met the outage: deferred


async def _upstream(fake: FakeState, count: int) -> bool:
    return fake.in_flight >= count


def _config(fake_url: str, tmp: Path, ledger: str, budgets: str, retry_s: float) -> Path:
    return shared_config(
        fake_url,
        tmp,
        ledger,
        budgets,
        server={
            "heartbeat_interval_s": 0.25,
            "heartbeat_timeout_s": 2.0,
            "shutdown_retry_s": retry_s,
        },
        routes={"fake": {"headers": {"x-fake-fault": "latency=1500"}, "timeout_s": 30}},
    )


async def test_sigterm_during_a_redis_outage_leaves_the_rows_to_recovery(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    async with pg_schema() as ledger_url:
        with private_redis(tmp_path, persist=True) as redis_server:
            budgets_url = redis_server.url + "?prefix=stop"
            config = _config(fake[0], tmp_path, ledger_url, budgets_url, retry_s=1.0)
            fake[1].reset()
            first = start(config, tmp_path / "gw.log")
            try:
                await asyncio.to_thread(wait_ready, first)
                await _answered_then_redis_down(fake[1], first.url, redis_server.stop)
                first.proc.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(first.proc.wait, 30) == 0
            finally:
                stop(first)
            stopped = await rows(ledger_url)
            assert [e.state for e in stopped] == ["reserved"] * IN_FLIGHT
            # left registered: a restart or a peer will recover its rows
            assert len(await _registered(ledger_url)) == 1
            log = (tmp_path / "gw.log").read_text()
            assert "settlements not applied by the shutdown deadline" in log

            await asyncio.to_thread(redis_server.start)  # Redis back, its data kept
            second = start(config, tmp_path / "gw.log")
            try:
                await asyncio.to_thread(wait_ready, second)
                after = await rows(ledger_url)
            finally:
                stop(second)
            kept = await holds(budgets_url)
            listed = await asyncio.to_thread(
                CliRunner().invoke,
                cli,
                ["reconcile", "list", "--format", "json", "--config", str(config)],
            )
    # every row visibly pending (gateway_lost), its hold kept (still counted)
    assert [(e.state, e.reconciliation_reason) for e in after] == [
        ("usage_reconciliation_required", "gateway_lost")
    ] * IN_FLIGHT
    assert len(kept) == IN_FLIGHT and {h.state for h in kept} == {"kept"}
    assert listed.exit_code == 0, listed.output
    assert len([line for line in listed.stdout.splitlines() if '"request_id"' in line]) == IN_FLIGHT


async def test_sigterm_during_a_redis_outage_settles_when_redis_returns_before_the_deadline(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    async with pg_schema() as ledger_url:
        with private_redis(tmp_path, persist=True) as redis_server:
            budgets_url = redis_server.url + "?prefix=stop"
            config = _config(fake[0], tmp_path, ledger_url, budgets_url, retry_s=20.0)
            fake[1].reset()
            gw = start(config, tmp_path / "gw.log")
            try:
                await asyncio.to_thread(wait_ready, gw)
                await _answered_then_redis_down(fake[1], gw.url, redis_server.stop)
                gw.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(1.0)
                assert gw.proc.poll() is None  # still retrying its settlements
                await asyncio.to_thread(redis_server.start)
                assert await asyncio.to_thread(gw.proc.wait, 30) == 0
            finally:
                stop(gw)
            events = await rows(ledger_url)
            assert [e.state for e in events] == ["settled"] * IN_FLIGHT
            assert await holds(budgets_url) == []
            assert await _registered(ledger_url) == []  # nothing left: it left the registry
