"""Timeouts that follow the engine, on the real SmolLM2: queued time is not charged, a
timed-out request is cancelled at once (its sequences freed, the next request admitted)
and its ledger row says so. ``make bench-engine-timeouts`` runs the loaded version (two
CPU burners, 20 n=4 requests through the embedded default)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ncap.config import LocalRoute, Stores, default_config
from ncap.engine import GenerationParams, collect
from ncap.engine.scheduler import EngineSpeed
from ncap.lifecycle.failures import retryable
from ncap.providers.base import AttemptFailed
from ncap.providers.local import LocalProvider
from tests.engine._require import require_engine
from tests.http.test_accounting import settled_rows
from tests.support import ServerThread, gateway

require_engine()
pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

ASK = ({"role": "user", "content": "Tell me a long story about a lighthouse keeper."},)
BODY: dict[str, Any] = {"model": "smollm2", "messages": list(ASK), "seed": 7}
# a request that must run to its token limit: no end-of-generation token (ids 0 and 2)
NO_END = {0: -100.0, 2: -100.0}
LONG_BODY: dict[str, Any] = {**BODY, "logit_bias": {str(t): int(b) for t, b in NO_END.items()}}


def test_speed_follows_the_machine_and_starts_pessimistic() -> None:
    speed = EngineSpeed()
    assert (speed.prefill_s, speed.decode_s) == (0.02, 0.05)
    speed.observe(0.5, 100, 0)  # a prefill step: 5 ms a row replaces the prior
    speed.observe(0.08, 4, 4)  # a decode step: 20 ms a sequence
    assert speed.prefill_s == pytest.approx(0.005) and speed.decode_s == pytest.approx(0.02)
    speed.observe(0.4, 4, 4)  # the machine got busy: the mean moves a fifth of the way
    assert speed.decode_s == pytest.approx(0.02 + 0.2 * (0.1 - 0.02))
    assert speed.now() == (speed.prefill_s, speed.decode_s)
    # a step running for 2 s over 4 sequences: at least 0.5 s a sequence until it ends
    speed.running = (time.perf_counter() - 2.0, 4, 4)
    assert speed.now()[1] >= 0.5 and speed.now()[0] == speed.prefill_s
    speed.running = (time.perf_counter() - 2.0, 100, 0)  # a prefill step: 20 ms a row
    assert speed.now()[0] >= 0.02 and speed.now()[1] == speed.decode_s


@pytest.fixture
async def provider() -> AsyncIterator[LocalProvider]:
    p = LocalProvider(LocalRoute(provider="local", n_ctx=1024, max_sequences=4, threads=2))
    yield p
    await p.aclose()


async def test_the_budget_grows_with_the_request_and_with_a_slower_engine(
    provider: LocalProvider,
) -> None:
    engine = await provider.engine()
    small = engine.prepare(GenerationParams(messages=ASK, n=1, max_tokens=16))
    large = engine.prepare(GenerationParams(messages=ASK * 8, n=4, max_tokens=256))
    assert 30 < engine.time_budget(small) < engine.time_budget(large)
    before = engine.time_budget(large)
    engine._scheduler.speed.decode_s *= 4  # the same engine, measured four times slower
    assert engine.time_budget(large) > 3 * (before - 30)


async def test_cancel_frees_the_sequences_and_the_next_request_starts_at_once(
    provider: LocalProvider,
) -> None:
    engine = await provider.engine()
    long = GenerationParams(messages=ASK, n=4, max_tokens=600, seed=1, logit_bias=NO_END)
    short = GenerationParams(messages=ASK, n=4, max_tokens=2, seed=2)
    async with engine.open(long) as first, engine.open(short) as second:
        await first.started.wait()
        await asyncio.sleep(1.0)  # a few steps: every sequence id is the first's
        assert not second.started.is_set() and engine.stats().queue_depth == 1
        freed = await first.cancel()
        assert freed.completion_tokens > 0 and freed.prompt_tokens > 0
        # the cancel and the admission happen in the same scheduler iteration
        await asyncio.wait_for(second.started.wait(), 0.5)
        done = await collect(second)
    assert [c.tokens for c in done.choices] == [2, 2, 2, 2]
    assert engine.stats().live_sequences == 0  # counted before the last event was sent


async def test_queued_time_is_not_charged_to_the_attempt() -> None:
    # 3 s for the attempt once admitted; it waits longer than that behind another request
    # that holds every sequence (one thread: two spin-waiting threads crawl on a machine
    # busy with other work), with the cells for all of its 800 tokens (a blocker that ran
    # out of cells would end early on a fast machine, and let the queued one in)
    p = LocalProvider(
        LocalRoute(provider="local", n_ctx=4096, max_sequences=4, threads=1, timeout_s=3)
    )
    try:
        engine = await p.engine()
        blocker = GenerationParams(messages=ASK, n=4, max_tokens=800, seed=3, logit_bias=NO_END)
        async with engine.open(blocker) as first:
            await first.started.wait()
            queued = asyncio.create_task(p.complete({**BODY, "n": 4, "max_tokens": 1}, timeout=3))
            await asyncio.sleep(4.5)
            assert not queued.done() and engine.stats().queue_depth == 1
            await first.cancel()
            result = await asyncio.wait_for(queued, 60)
        assert result.status == 200
    finally:
        await p.aclose()


async def test_a_timed_out_attempt_reports_what_it_used_once_its_sequences_are_freed() -> None:
    p = LocalProvider(
        LocalRoute(provider="local", n_ctx=1024, max_sequences=4, threads=2, timeout_s=1.5)
    )
    try:
        with pytest.raises(AttemptFailed) as info:
            await p.complete({**LONG_BODY, "n": 4, "max_tokens": 900}, timeout=1.5)
        failure = info.value
        assert failure.kind == "timeout" and not retryable(failure)
        assert failure.usage is not None and failure.usage.completion_tokens > 0
        engine = await p.engine()
        assert engine.stats().live_sequences == 0 and engine.stats().running_requests == 0
    finally:
        await p.aclose()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Path]]:
    tmp = tmp_path_factory.mktemp("timeouts")
    base = default_config()
    route = base.routes["local-smollm2"].model_copy(
        update={"threads": 1, "n_ctx": 2048, "max_sequences": 4, "timeout_s": 5, "retries": 0}
    )
    config = base.model_copy(
        update={
            "stores": Stores(
                ledger=f"sqlite:///{tmp}/ledger.db", budgets=f"sqlite:///{tmp}/budgets.db"
            ),
            "routes": {"local-smollm2": route},
        }
    )
    with gateway(config) as server:
        yield server, tmp


def test_a_timeout_through_the_gateway_is_a_504_settled_as_cancelled(
    gw: tuple[ServerThread, Path],
) -> None:
    server, tmp = gw
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.with_raw_response.create(**LONG_BODY, n=4, max_tokens=1000)
    assert info.value.status_code == 504
    request_id = info.value.response.headers["x-request-id"]
    (row,) = asyncio.run(settled_rows(tmp, request_id))
    assert row.state == "settled" and row.reconciliation_reason is None
    assert row.finish_reasons == {"cancelled": 4}
    assert row.output_tokens_total and row.output_tokens_total > 0
    assert row.input_tokens and row.usage_source == "provider_response"
    # the next request is admitted at once and answers
    began = time.monotonic()
    answer = client.chat.completions.create(**BODY, n=4, max_tokens=1)
    assert len(answer.choices) == 4 and time.monotonic() - began < 20
