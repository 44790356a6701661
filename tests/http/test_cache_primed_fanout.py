"""Cache-primed fan-out: on a route whose provider caches prompts, branch 0 goes first
and the other branches once its first byte arrived, so they read its prompt from the
cache. A 2,000-token prompt at n=4, priced as Anthropic prices it (cache reads 10 % of
input, writes 125 %), against the fake Anthropic and the fake OpenAI (caching on, with a
prefill time): the ledger and ``ncap audit`` show branches 1-3 billed at the cached
rate and at least 60 % less input than a parallel fan-out; turned off by config, the
fan-out is parallel again."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from typer.testing import CliRunner

from ncap.cli.main import app
from ncap.config import Config
from ncap.domain.events import LedgerEvent
from ncap.stores import SQLiteLedgerStore
from ncap.testing.fake_anthropic import ANTHROPIC_STATE, create_anthropic_app
from ncap.testing.fake_kit import FakeState
from ncap.testing.fake_upstream import STATE, create_app
from tests.support import ServerThread, gateway, gateway_config

# ~2,000 prompt tokens as both fakes count them (characters / 4)
PROMPT = "The harbour wall was built of granite blocks in eighteen twelve. " * 123
# input $3/Mtok; cache reads 10 %, cache writes 125 %; output free, so cost = input
PRICING = {
    "input_per_mtok": 3.0,
    "cached_input_per_mtok": 0.3,
    "cache_write_input_per_mtok": 3.75,
    "output_per_mtok": 0.0,
}
PREFILL_MS = "150"  # the fakes' time to first byte: a cache entry is readable after it


@pytest.fixture
def anthropic_fake() -> Iterator[tuple[str, FakeState]]:
    server = ServerThread(lambda: create_anthropic_app()).start()
    try:
        assert server.app is not None
        yield server.url + "/v1", server.app[ANTHROPIC_STATE]
    finally:
        server.stop()


@pytest.fixture
def openai_fake() -> Iterator[tuple[str, FakeState]]:
    server = ServerThread(lambda: create_app()).start()
    try:
        assert server.app is not None
        yield server.url + "/v1", server.app[STATE]
    finally:
        server.stop()


def _route(provider: str, base_url: str, priming: bool) -> dict[str, Any]:
    if provider == "anthropic":
        headers = {"x-fake-latency-ms": PREFILL_MS}
    else:
        headers = {"x-fake-fault": "prompt_cache,latency", "x-fake-latency-ms": PREFILL_MS}
    return {
        "provider": provider,
        "base_url": base_url,
        "upstream_model": "cached-model",
        "timeout_s": 10,
        "retries": 0,
        "headers": headers,
        "pricing": PRICING,
        "fanout_cache_priming": priming,
        "contract": {
            "candidates": "emulate",
            "max_candidates": 8,
            "stream_usage": "include_usage",
            "prompt_cache": True,
        },
    }


def _config(tmp: Path, route: dict[str, Any]) -> Config:
    return gateway_config(
        "http://unused",
        tmp,
        workloads={"default": {"max_candidates": 8, "output_ceiling": 64}},
        models={"m": ["r"]},
        routes={"r": route},
    )


def _rows(tmp: Path, count: int) -> list[LedgerEvent]:
    async def read() -> list[LedgerEvent]:
        store = SQLiteLedgerStore(tmp / "ledger.db")
        try:
            return [e async for e in store.export()]
        finally:
            await store.close()

    deadline = time.monotonic() + 10
    while True:
        found = [r for r in asyncio.run(read()) if r.policy_result == "allow"]
        if len(found) >= count and all(r.state != "reserved" for r in found):
            return sorted(found, key=lambda r: r.attempt)
        assert time.monotonic() < deadline, found
        time.sleep(0.05)


def _fan_out(tmp: Path, route: dict[str, Any], stream: bool) -> tuple[list[LedgerEvent], Any]:
    tmp.mkdir()
    with gateway(_config(tmp, route)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
        messages = [{"role": "user", "content": PROMPT}]
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model="m",
                    messages=messages,
                    n=4,
                    max_completion_tokens=8,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            usage = chunks[-1].usage
        else:
            usage = client.chat.completions.create(
                model="m", messages=messages, n=4, max_completion_tokens=8
            ).usage
        rows = _rows(tmp, 4)
    return rows, usage


def _audit_cost(tmp: Path) -> int:
    result = CliRunner().invoke(
        app,
        ["audit", "--since", "1d", "--format", "json", "--ledger", f"sqlite:///{tmp}/ledger.db"],
    )
    assert result.exit_code == 0, result.output
    (route,) = json.loads(result.stdout)["spend_by_route"]
    return int(route["cost_micros"])


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
@pytest.mark.parametrize("stream", [False, True])
def test_primed_fan_out_reads_the_cache_and_costs_60_percent_less(
    provider: str,
    stream: bool,
    anthropic_fake: tuple[str, FakeState],
    openai_fake: tuple[str, FakeState],
    tmp_path: Path,
) -> None:
    base_url, state = anthropic_fake if provider == "anthropic" else openai_fake
    primed, primed_usage = _fan_out(tmp_path / "primed", _route(provider, base_url, True), stream)
    state.reset()  # a fresh cache: the parallel run starts cold too
    parallel, _ = _fan_out(tmp_path / "parallel", _route(provider, base_url, False), stream)

    prompt = primed[0].input_tokens or 0
    assert 1900 <= prompt <= 2100
    # primed: branch 0 paid the whole prompt, branches 1-3 read it from the cache
    assert primed[0].cached_input_tokens == 0
    assert all((r.cached_input_tokens or 0) >= prompt * 0.9 for r in primed[1:])
    # parallel: all four sent together, none could read another's prompt
    assert [r.cached_input_tokens for r in parallel] == [0, 0, 0, 0]
    assert primed_usage is not None and primed_usage.prompt_tokens_details is not None
    assert primed_usage.prompt_tokens_details.cached_tokens == sum(
        r.cached_input_tokens or 0 for r in primed
    )
    primed_cost = sum(r.cost_micros or 0 for r in primed)
    parallel_cost = sum(r.cost_micros or 0 for r in parallel)
    print(f"{provider} stream={stream}: primed {primed_cost} vs parallel {parallel_cost} micro-USD")
    assert primed_cost <= 0.4 * parallel_cost, (primed_cost, parallel_cost)
    assert (_audit_cost(tmp_path / "primed"), _audit_cost(tmp_path / "parallel")) == (
        primed_cost,
        parallel_cost,
    )
    # the reservation stays conservative: every branch held as if uncached
    assert [r.reserved_input_tokens for r in primed] == [r.reserved_input_tokens for r in parallel]


def test_a_failed_first_branch_sends_no_other(
    anthropic_fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    route = _route("anthropic", anthropic_fake[0], True)
    route["headers"] = {"x-fake-fault": "server_error_400"}
    with gateway(_config(tmp_path, route)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": PROMPT}],
                n=4,
                max_completion_tokens=8,
            )
        rows = _rows(tmp_path, 4)
    assert anthropic_fake[1].requests == 1
    assert [(r.state, r.cost_micros) for r in rows] == [("settled", 0)] * 4
