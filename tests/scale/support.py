"""Gateways as real ``ncap serve`` processes on shared stores, for the scale-out tests."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from ncap.config import Config
from ncap.domain.events import LedgerEvent
from ncap.stores import Hold, budgets_from_url, ledger_from_url
from tests.servers import free_port
from tests.support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, gateway_config

NCAP = [sys.executable, "-m", "ncap.cli.main"]
BEAT = {"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 2.0}


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    url: str


def shared_config(fake_url: str, tmp: Path, ledger: str, budgets: str, **extra: Any) -> Path:
    """A config on the given stores with a short heartbeat timeout; returns its path."""
    overrides: dict[str, Any] = {"stores": {"ledger": ledger, "budgets": budgets}}
    overrides["server"] = dict(BEAT)
    for key, value in extra.items():
        overrides[key] = value
    config: Config = gateway_config(fake_url, tmp, **overrides)
    path = tmp / f"ncap-{len(list(tmp.glob('ncap-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    return path


def start(config: Path, log: Path) -> Gateway:
    port = free_port()
    env = {**os.environ, UPSTREAM_KEY_ENV: UPSTREAM_KEY}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [*NCAP, "serve", "--config", str(config), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return Gateway(proc, f"http://127.0.0.1:{port}")


def wait_ready(gw: Gateway, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert gw.proc.poll() is None, "the gateway exited during start-up"
        with suppress(httpx.HTTPError):
            if httpx.get(gw.url + "/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError("the gateway did not become ready")


def stop(gw: Gateway) -> None:
    if gw.proc.poll() is None:
        gw.proc.terminate()
        with suppress(subprocess.TimeoutExpired):
            gw.proc.wait(15)
    if gw.proc.poll() is None:
        gw.proc.kill()
        gw.proc.wait(10)


@contextmanager
def gateways(config: Path, count: int, log: Path) -> Iterator[list[Gateway]]:
    """``count`` gateway processes started together on one config."""
    started = [start(config, log) for _ in range(count)]
    try:
        for gw in started:
            wait_ready(gw)
        yield started
    finally:
        for gw in started:
            stop(gw)


@dataclass
class Reply:
    status_code: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


class Client:
    """aiohttp for the load (several times cheaper per request than httpx here)."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    async def post(self, url: str, json: Any) -> Reply:
        async with self._session.post(url, json=json) as response:
            return Reply(response.status, await response.read())

    async def get(self, url: str) -> Reply:
        async with self._session.get(url) as response:
            return Reply(response.status, await response.read())


@asynccontextmanager
async def client() -> AsyncIterator[Client]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield Client(session)


def chat(model: str = "fake-model") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}]}


async def rows(ledger_url: str) -> list[LedgerEvent]:
    ledger = ledger_from_url(ledger_url)
    try:
        return [e async for e in ledger.export()]
    finally:
        await ledger.close()


async def holds(budgets_url: str, workload: str = "default") -> list[Hold]:
    budgets = budgets_from_url(budgets_url)
    try:
        return await budgets.outstanding(workload)
    finally:
        await budgets.close()


async def wait_for(predicate: Any, timeout: float = 20, every: float = 0.1) -> Any:
    """Poll an async predicate until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(every)
