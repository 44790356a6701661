"""A gateway over scripted providers and in-memory stores: the whole lifecycle, no
sockets (``conftest.py`` makes any connect attempt fail the test)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ncap.domain.events import LedgerEvent
from ncap.lifecycle import Accounting, Caller, Gateway, Reply, RouteRuntime
from ncap.metrics import Metrics
from ncap.stores import MemoryBudgetStore, MemoryLedgerStore
from ncap.stores.ports import Hold
from ncap.streaming.sse import split_events
from ncap.testing.scripted import ScriptedProvider
from tests.support import gateway_config

CALLER = Caller("default", "test")
NATIVE = {"candidates": "native", "max_candidates": 8, "stream_usage": "include_usage"}
EMULATE = {"candidates": "emulate", "max_candidates": 8, "stream_usage": "include_usage"}


def route(contract: Mapping[str, Any] = NATIVE, **extra: Any) -> dict[str, Any]:
    return {
        "provider": "openai",
        "base_url": "http://scripted.invalid/v1",
        "timeout_s": 2,
        "retries": 2,
        "backoff_s": 0.01,
        "pricing": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
        "contract": dict(contract),
        **extra,
    }


@dataclass
class Harness:
    gateway: Gateway
    ledger: MemoryLedgerStore
    budgets: MemoryBudgetStore
    metrics: Metrics
    sleeps: list[float] = field(default_factory=list)

    async def chat(self, request_id: str = "req-1", **body: Any) -> Reply:
        raw = msgspec.json.encode(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
        )
        return await self.gateway.chat(raw, CALLER, request_id)

    async def rows(self, request_id: str = "req-1") -> list[LedgerEvent]:
        return sorted(await self.ledger.get(request_id), key=lambda e: e.attempt)

    async def outstanding(self) -> list[Hold]:
        return await self.budgets.outstanding()


def harness(
    tmp: Path,
    routes: Mapping[str, tuple[dict[str, Any], ScriptedProvider]],
    *,
    ledger: MemoryLedgerStore | None = None,
    budgets: MemoryBudgetStore | None = None,
    **overrides: Any,
) -> Harness:
    """Alias ``m`` on the given routes, in order (the first is the primary)."""
    cfg = gateway_config(
        "http://scripted.invalid/v1",
        tmp,
        models={"m": list(routes)},
        routes={rid: r for rid, (r, _) in routes.items()},
        **overrides,
    )
    idle = ScriptedProvider([])  # the base config's own route, never used here
    runtimes = {
        rid: RouteRuntime(rid, r, routes[rid][1] if rid in routes else idle)
        for rid, r in cfg.routes.items()
    }
    ledger = ledger or MemoryLedgerStore()
    budgets = budgets or MemoryBudgetStore()
    metrics = Metrics()
    accounting = Accounting(cfg, ledger, budgets, instance="test", metrics=metrics)
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    gw = Gateway(cfg, runtimes, accounting, sleep=sleep)
    return Harness(gw, ledger, budgets, metrics, sleeps)


async def settled(gateway: Gateway) -> None:
    """Every whole answer's settlement handed to the settlement service so far, run."""
    await gateway.accounting.settlement.drain()


async def drain(stream: AsyncIterator[bytes] | None) -> list[bytes]:
    assert stream is not None
    return [chunk async for chunk in stream]


def events(chunks: list[bytes]) -> list[Any]:
    """The JSON of each ``data:`` event, ``[DONE]`` as the string (a write may hold
    several events: what arrived together is relayed together)."""
    out: list[Any] = []
    for chunk in chunks:
        for event in split_events(chunk):
            data = event.removeprefix(b"data: ").strip()
            out.append("[DONE]" if data == b"[DONE]" else msgspec.json.decode(data))
    return out
