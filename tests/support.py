"""Servers for tests: any aiohttp app on an ephemeral port, in a thread with its own loop,
so that both the sync and the async ``openai`` SDK can talk to it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from ncap.config import Config, parse_config
from ncap.http.app import create_app, front_of
from ncap.http.front import FrontRunner
from ncap.testing.fake_upstream import STATE, FakeState
from ncap.testing.fake_upstream import create_app as create_fake_app

UPSTREAM_KEY_ENV = "NCAP_TEST_UPSTREAM_KEY"
UPSTREAM_KEY = "sk-route-credential"


class ServerThread:
    def __init__(self, factory: Callable[[], web.Application]) -> None:
        self._factory = factory
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0
        self.app: web.Application | None = None
        self._runner: web.AppRunner | None = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as exc:  # surfaced to the test thread by start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self.app = self._factory()
        # as ``ncap serve`` serves it: the completion routes by ncap's front
        self._runner = FrontRunner(
            self.app, front_of(self.app), access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def start(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(60)
        if self._error is not None:
            raise self._error
        return self

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def stop(self) -> None:
        if self._runner is not None:
            self.call(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def fake_upstream(profile: str | None = None) -> Iterator[tuple[str, FakeState]]:
    server = ServerThread(lambda: create_fake_app(profile)).start()
    try:
        assert server.app is not None
        yield server.url + "/v1", server.app[STATE]
    finally:
        server.stop()


def gateway_config(upstream_url: str, tmp: Path, **overrides: Any) -> Config:
    """A gateway in front of the fake: alias ``fake-model`` on route ``fake``."""
    raw: dict[str, Any] = {
        "stores": {
            "ledger": f"sqlite:///{tmp}/ledger.db",
            "budgets": f"sqlite:///{tmp}/budgets.db",
        },
        "workloads": {"default": {"max_candidates": 4, "output_ceiling": 256}},
        "models": {"fake-model": ["fake"]},
        "routes": {
            "fake": {
                "provider": "openai",
                "base_url": upstream_url,
                "upstream_model": "fake-model",
                "api_key_env": UPSTREAM_KEY_ENV,
                "timeout_s": 2,
                "retries": 2,
                "backoff_s": 0.01,
                "pricing": {"input_per_mtok": 0.15, "output_per_mtok": 0.6},
                "contract": {
                    "candidates": "native",
                    "max_candidates": 8,
                    "output_cap": "per_candidate",
                    "stream_usage": "include_usage",
                },
            }
        },
    }
    _merge(raw, overrides)
    return parse_config(yaml.safe_dump(raw))


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


@contextmanager
def gateway(config: Config) -> Iterator[ServerThread]:
    server = ServerThread(lambda: create_app(config, instance_id="test-gw")).start()
    try:
        yield server
    finally:
        server.stop()
