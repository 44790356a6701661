"""``ncap serve --workers 3`` with ``server.instance_id`` set: one id per worker, a
killed worker swept by its siblings, a stop during a restart that leaves no process
behind, and a group that stops when a worker cannot start."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import asyncpg
import pytest

from ncap.cli.workers import Supervisor
from ncap.testing.fake_upstream import FakeState
from tests.scale.support import NCAP, Gateway, rows, shared_config, wait_for, wait_ready
from tests.servers import free_port
from tests.services import pg_schema, redis_prefix
from tests.support import UPSTREAM_KEY, UPSTREAM_KEY_ENV


def _ours(marker: str) -> list[int]:
    """Every process whose command line names ``marker`` (this test's config path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            except OSError:
                continue
            if marker in cmdline and state != "Z":
                found.append(int(entry.name))
    return found


async def _registry(ledger_url: str) -> dict[str, int]:
    dsn, _, schema = ledger_url.partition("?schema=")
    conn = await asyncpg.connect(dsn, server_settings={"search_path": schema})
    try:
        return {r[0]: r[1] for r in await conn.fetch("SELECT instance, pid FROM gateway_instances")}
    finally:
        await conn.close()


async def _post(session: aiohttp.ClientSession, port: int) -> int:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with session.post(url, json=body) as reply:  # a new connection each
        return reply.status


@pytest.mark.postgresql
@pytest.mark.redis
async def test_three_workers_with_an_instance_id(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    async with pg_schema() as ledger_url, redis_prefix() as budgets_url:
        config = shared_config(
            fake[0],
            tmp_path,
            ledger_url,
            budgets_url,
            server={
                # a sibling finds the killed worker silent 0.75–1.25 s after the kill;
                # the supervisor's restart comes up no sooner than its 1 s delay plus a
                # worker's start-up (with 2 s the two raced on a loaded machine)
                "heartbeat_interval_s": 0.25,
                "heartbeat_timeout_s": 1.0,
                "instance_id": "edge",
            },
            routes={"fake": {"headers": {"x-fake-fault": "latency=3000"}, "timeout_s": 30}},
        )
        port = free_port()
        env = {**os.environ, UPSTREAM_KEY_ENV: UPSTREAM_KEY}
        with (tmp_path / "workers.log").open("ab") as log:
            proc = subprocess.Popen(
                [*NCAP, "serve", "--workers", "3", "--port", str(port), "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            await asyncio.to_thread(wait_ready, Gateway(proc, f"http://127.0.0.1:{port}"))
            ids = await wait_for(lambda: _three(ledger_url), timeout=20)
            assert sorted(ids) == ["edge-w1", "edge-w2", "edge-w3"]  # distinct, derived
            # a worker registers before it says it listens: wait for all three lines, so
            # the one after the supervisor's restart line below is the restarted worker's
            log_path = tmp_path / "workers.log"
            assert await wait_for(lambda: _listening(log_path, 3), timeout=20)

            fake[1].reset()
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=connector) as session:
                slow = [asyncio.create_task(_post(session, port)) for _ in range(12)]
                assert await wait_for(lambda: _in_flight(fake[1], 12), timeout=20, every=0.05)
                busy = {e.gateway_instance for e in await rows(ledger_url) if e.state == "reserved"}
                victim = sorted(busy)[0]
                os.kill(ids[victim], signal.SIGKILL)
                await asyncio.gather(*slow, return_exceptions=True)
            lost = await wait_for(lambda: _lost_of(ledger_url, victim), timeout=20)
            assert lost, "the killed worker's rows were not recovered"
            events = await rows(ledger_url)
            others = [e for e in events if e.gateway_instance != victim]
            assert {e.state for e in others} <= {"settled"}  # siblings' rows untouched
            assert {e.gateway_instance for e in events} <= set(ids)
            # swept by a sibling: before the supervisor's restart of it came up
            # the supervisor's line and the sibling's can reach the shared log in any order
            assert await wait_for(lambda: _logged(log_path, "restarting it"), timeout=20)
            text = log_path.read_text()
            swept = text.index(f"gateway {victim} was lost")
            restarted = text.index("restarting it")
            came_up = text.find("ncap listening", restarted)
            assert came_up == -1 or swept < came_up

            # the group serves on: the killed worker is back under its own id
            assert await wait_for(lambda: _three_alive(ledger_url, ids), timeout=20)
            # a stop while a worker is being restarted: nothing is left running
            again = await _registry(ledger_url)
            os.kill(again["edge-w2"], signal.SIGKILL)
            await asyncio.sleep(0.4)  # the supervisor noticed and waits to restart it
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 60) == 0
            await asyncio.sleep(0.5)
            assert _ours(str(config)) == [], "a worker outlived its supervisor"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            for pid in _ours(str(config)):
                os.kill(pid, signal.SIGKILL)


async def _three(ledger_url: str) -> dict[str, int] | None:
    found = await _registry(ledger_url)
    return found if len(found) == 3 else None


async def _three_alive(ledger_url: str, before: dict[str, int]) -> bool:
    found = await _registry(ledger_url)
    return sorted(found) == sorted(before) and all(_alive(pid) for pid in found.values())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _in_flight(fake: FakeState, count: int) -> bool:
    return fake.in_flight >= count


async def _lost_of(ledger_url: str, instance: str) -> bool:
    mine = [e for e in await rows(ledger_url) if e.gateway_instance == instance]
    return bool(mine) and all(e.reconciliation_reason == "gateway_lost" for e in mine)


def test_a_worker_that_cannot_start_stops_the_group_after_three_tries() -> None:
    started: list[int] = []

    def command(slot: int) -> list[str]:
        started.append(slot)
        failing = "import sys; sys.exit(3)"
        return [sys.executable, "-c", failing if slot == 2 else "import time; time.sleep(60)"]

    group = Supervisor(command, 2, restart_delay_s=0.05)
    t0 = time.monotonic()
    code = group.run()
    assert code == 3 and time.monotonic() - t0 < 20
    assert started.count(2) == 3  # three tries, then the group stopped
    assert all(p.poll() is not None for p in group.procs)  # the healthy one stopped too


def test_a_signal_during_a_restart_delay_starts_nothing_more() -> None:
    spawned: list[int] = []

    def command(slot: int) -> list[str]:
        spawned.append(slot)
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    group = Supervisor(command, 2, restart_delay_s=5.0, startup_s=0.0)

    def kill_one_then_stop() -> None:
        while len(group.procs) < 2:
            time.sleep(0.05)
        group.procs[0].kill()
        time.sleep(0.6)  # inside the 5 s restart delay
        group.stop()

    threading.Thread(target=kill_one_then_stop, daemon=True).start()
    t0 = time.monotonic()
    group.run()
    assert time.monotonic() - t0 < 5.0  # the delay was cut short
    assert spawned == [1, 2]  # and the killed worker was not started again
    assert all(p.poll() is not None for p in group.procs)


async def _logged(path: Path, line: str) -> bool:
    return line in path.read_text()


async def _listening(path: Path, workers: int) -> bool:
    return path.read_text().count("ncap listening") >= workers
