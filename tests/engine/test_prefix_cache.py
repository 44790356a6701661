"""The cross-request prefix cache on the real SmolLM2: reuse, counts, equality with the
cache off, and its token budget (checked against llama.cpp's own KV memory)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from ncap.engine import Engine, EngineSettings, GenerationParams

pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

SYSTEM = (
    "You are the help desk of a harbour town. Answer questions about ferries, the market, "
    "the weather and the fishing fleet politely, briefly and accurately. "
) * 13


def ask(user: str, seed: int = 17) -> GenerationParams:
    messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": user})
    return GenerationParams(messages=messages, n=2, max_tokens=8, seed=seed)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Engine, Engine]]:
    settings = EngineSettings(n_ctx=2048, max_sequences=4, threads=2)
    cached = Engine.load(replace(settings, prefix_cache_tokens=1500))
    plain = Engine.load(settings)
    yield cached, plain
    cached.close()
    plain.close()


def texts(done: Any) -> list[str]:
    return [c.text for c in done.choices]


async def test_second_request_reuses_the_system_prompt_and_matches_the_cache_off(
    engines: tuple[Engine, Engine],
) -> None:
    cached, plain = engines
    first = await cached.run(ask("When does the first ferry leave?"))
    prompt = len(cached.prompt_tokens(ask("Is the market open on Sunday?")))
    assert prompt >= 400
    before = cached.stats()
    second = await cached.run(ask("Is the market open on Sunday?"))
    after = cached.stats()
    assert second.prompt_tokens == prompt
    assert second.cached_tokens >= 380
    # only the rest of the prompt was evaluated
    evaluated = after.prompt_tokens_evaluated - before.prompt_tokens_evaluated
    assert evaluated == prompt - second.cached_tokens
    assert after.prompt_tokens_cached - before.prompt_tokens_cached == second.cached_tokens
    assert first.cached_tokens < 380  # nothing of this system prompt was cached before

    without = await plain.run(ask("Is the market open on Sunday?"))
    assert without.cached_tokens == 0
    assert texts(second) == texts(without)
    assert [c.tokens for c in second.choices] == [c.tokens for c in without.choices]


async def test_the_same_request_twice_is_identical_with_the_cache(
    engines: tuple[Engine, Engine],
) -> None:
    cached, _ = engines
    params = ask("Describe the fishing fleet.", seed=23)
    one = await cached.run(params)
    two = await cached.run(params)
    assert two.cached_tokens == two.prompt_tokens - 2
    assert texts(one) == texts(two)


def cache_cells(engine: Engine) -> int:
    """Cells llama.cpp holds for the cache's own sequence ids (seq pos_max + 1 each)."""
    scheduler = engine._scheduler
    lib, mem = scheduler._lib, scheduler._mem
    first = scheduler.settings.max_sequences
    last = first + scheduler.settings.prefix_cache_entries
    return sum(int(lib.llama_memory_seq_pos_max(mem, s)) + 1 for s in range(first, last))


async def test_cache_stays_within_its_budget_under_100_random_prompts() -> None:
    budget = 300
    engine = Engine.load(
        EngineSettings(n_ctx=1024, max_sequences=4, threads=2, prefix_cache_tokens=budget)
    )
    rng = random.Random(12)
    words = [
        "harbour",
        "ferry",
        "gull",
        "market",
        "bread",
        "ice",
        "boat",
        "net",
        "tide",
        "rope",
        "fish",
        "school",
    ]
    stems = [" ".join(rng.choices(words, k=rng.randint(10, 60))) for _ in range(6)]
    try:
        reused = 0
        for _ in range(20):
            prompts = [
                rng.choice(stems) + " " + " ".join(rng.choices(words, k=rng.randint(1, 20)))
                for _ in range(5)
            ]
            runs = [engine.run(GenerationParams(prompt=p, max_tokens=1, seed=1)) for p in prompts]
            for done in await asyncio.gather(*runs):
                reused += done.cached_tokens
            stats = engine.stats()
            assert stats.prefix_cache_tokens <= budget
            assert cache_cells(engine) == stats.prefix_cache_tokens
            # the gauges are refreshed just after the last event is sent
            for _ in range(500):
                if engine.stats().live_sequences == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.stats().live_sequences == 0
        assert engine.stats().requests_completed == 100
        assert reused > 0  # the shared stems were served from the cache
    finally:
        engine.close()
