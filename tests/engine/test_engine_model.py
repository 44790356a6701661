"""The engine on the real SmolLM2-135M model: one prefill, n independent seeded choices,
usage, finish reasons, streaming, grammars, continuous batching, best_of, errors.

Loads the model once for the module; generations are short to keep it quick on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import jsonschema
import pytest
from aiohttp.test_utils import TestServer

from ncap.engine import Engine, EngineSettings, GenerationParams, JsonGrammar, chat_params
from ncap.errors import ContextLengthExceeded, Overloaded
from tests.engine._require import require_engine

require_engine()
pytestmark = pytest.mark.engine

FRUITS = ({"role": "user", "content": "List five fruits, one per line."},)
HAIKU = ({"role": "user", "content": "Write a haiku about the sea."},)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine.load(EngineSettings(n_ctx=2048, max_sequences=16, max_queue=8, threads=2))
    yield eng
    eng.close()


@pytest.fixture
async def server(engine: Engine) -> AsyncIterator[TestServer]:
    from ncap.engine.server import create_engine_app

    srv = TestServer(create_engine_app(engine, model_name="smollm2"))
    await srv.start_server()
    yield srv
    await srv.close()


async def until(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def texts(completion: Any) -> list[str]:
    return [c.text for c in completion.choices]


# --- 2. one prefill -------------------------------------------------------------------


async def test_n8_prefills_the_prompt_once(engine: Engine) -> None:
    params = GenerationParams(messages=HAIKU, n=8, max_tokens=4, seed=1)
    prompt = len(engine.prompt_tokens(params))
    before = engine.stats()
    done = await engine.run(params)
    after = engine.stats()
    assert len(done.choices) == 8
    assert after.prompt_tokens_evaluated - before.prompt_tokens_evaluated == prompt
    assert done.prompt_tokens == prompt
    # every later step is one batched decode over all live sequences
    assert after.decode_steps - before.decode_steps <= 4


# --- 3. seeds -------------------------------------------------------------------------


async def test_same_seed_same_choices_and_choices_are_independent(engine: Engine) -> None:
    params = GenerationParams(messages=HAIKU, n=4, max_tokens=48, temperature=1.0, seed=42)
    first, second = await engine.run(params), await engine.run(params)
    assert texts(first) == texts(second)
    assert len(set(texts(first))) > 1


async def test_choice_i_equals_n1_with_seed_plus_i(engine: Engine) -> None:
    batched = await engine.run(GenerationParams(messages=FRUITS, n=3, max_tokens=16, seed=100))
    for i in range(3):
        single = await engine.run(
            GenerationParams(messages=FRUITS, n=1, max_tokens=16, seed=100 + i)
        )
        assert single.choices[0].text == batched.choices[i].text


# --- 4. usage -------------------------------------------------------------------------


async def test_usage_counts_prompt_once_and_sums_choice_tokens(engine: Engine) -> None:
    params = GenerationParams(
        messages=FRUITS, n=3, max_tokens=12, seed=3, logprobs=True, top_logprobs=2
    )
    done = await engine.run(params)
    assert done.prompt_tokens == len(engine.prompt_tokens(params))
    per_choice = [len(c.logprobs or []) for c in done.choices]
    assert per_choice == [c.tokens for c in done.choices]
    assert done.completion_tokens == sum(per_choice)
    for c in done.choices:
        for entry in c.logprobs or []:
            assert entry.logprob <= 0.0
            assert len(entry.top) == 2
            assert entry.top[0].logprob >= entry.top[1].logprob
            assert entry.top[0].logprob >= entry.logprob


# --- 5. finish reasons ----------------------------------------------------------------


async def test_mixed_finish_reasons_and_stop_string_never_emitted(engine: Engine) -> None:
    params = GenerationParams(messages=FRUITS, n=4, max_tokens=12, seed=0, stop=("Apple",))
    done = await engine.run(params)
    reasons = [c.finish_reason for c in done.choices]
    assert set(reasons) == {"stop", "length"}, reasons
    for c in done.choices:
        assert "Apple" not in c.text
        if c.finish_reason == "length":
            assert c.tokens == 12
        else:
            assert c.tokens < 12


# --- 6. streaming ---------------------------------------------------------------------


async def sse_chunks(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    body = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_stream_demultiplexed_by_index_equals_non_streamed(server: TestServer) -> None:
    body = {"model": "smollm2", "messages": list(HAIKU), "n": 3, "max_tokens": 20, "seed": 9}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.make_url("/v1/chat/completions"), json=body) as resp:
            assert resp.status == 200
            whole = await resp.json()
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(server.make_url("/v1/chat/completions"), json=stream_body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            chunks = await sse_chunks(resp)
    content: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks[:-1]:
        assert chunk["object"] == "chat.completion.chunk"
        (choice,) = chunk["choices"]
        i = choice["index"]
        if i not in content:
            assert choice["delta"] == {"role": "assistant", "content": ""}
        content[i] = content.get(i, "") + (choice["delta"].get("content") or "")
        if choice["finish_reason"]:
            finish[i] = choice["finish_reason"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == whole["usage"]
    for c in whole["choices"]:
        assert content[c["index"]] == c["message"]["content"]
        assert finish[c["index"]] == c["finish_reason"]


# --- 7. json_schema -------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "likes_tea": {"type": "boolean"},
    },
    "required": ["name", "mood", "likes_tea"],
    "additionalProperties": False,
}


async def test_json_schema_constrains_every_choice(engine: Engine) -> None:
    body = {
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "n": 3,
        "max_tokens": 48,
        "seed": 5,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    }
    done = await engine.run(chat_params(body))
    assert len({c.text for c in done.choices}) > 1
    for c in done.choices:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)


async def test_json_object_mode(engine: Engine) -> None:
    params = GenerationParams(messages=FRUITS, n=2, max_tokens=48, seed=2, json=JsonGrammar())
    for c in (await engine.run(params)).choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


# --- 8. continuous batching -----------------------------------------------------------


async def test_second_request_starts_before_the_first_finishes(engine: Engine) -> None:
    long = GenerationParams(messages=HAIKU, n=1, max_tokens=48, seed=1, temperature=0.0)
    short = GenerationParams(messages=FRUITS, n=1, max_tokens=4, seed=1)
    first_token: dict[str, float] = {}
    finished: dict[str, float] = {}

    async def consume(name: str, params: GenerationParams, start: asyncio.Event | None) -> None:
        async with engine.open(params) as stream:
            async for _events in stream:
                first_token.setdefault(name, time.monotonic())
                if start is not None:
                    start.set()
        finished[name] = time.monotonic()

    started = asyncio.Event()
    a = asyncio.create_task(consume("a", long, started))
    await started.wait()
    await consume("b", short, None)
    await a
    assert first_token["a"] < first_token["b"] < finished["a"]
    assert finished["b"] < finished["a"]


# --- 9. best_of -----------------------------------------------------------------------


async def test_best_of_returns_n_and_bills_every_candidate(
    engine: Engine, server: TestServer
) -> None:
    prompt = "The three primary colours are"
    body = {"model": "smollm2", "prompt": prompt, "n": 2, "best_of": 4, "max_tokens": 8}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(server.make_url("/v1/completions"), json={**body, "seed": 11})
        assert resp.status == 200
        got = await resp.json()
    all4 = await engine.run(GenerationParams(prompt=prompt, n=4, max_tokens=8, seed=11, score=True))
    assert got["object"] == "text_completion"
    assert [c["index"] for c in got["choices"]] == [0, 1]
    assert got["usage"]["completion_tokens"] == all4.completion_tokens
    best = sorted(all4.choices, key=lambda c: c.mean_logprob, reverse=True)[:2]
    assert [c["text"] for c in got["choices"]] == [c.text for c in best]


# --- errors ---------------------------------------------------------------------------


async def test_context_overflow_is_400_context_length_exceeded(
    engine: Engine, server: TestServer
) -> None:
    with pytest.raises(ContextLengthExceeded):
        await engine.run(GenerationParams(messages=HAIKU, max_tokens=5000))
    body = {"model": "smollm2", "messages": list(HAIKU), "max_tokens": 5000}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(server.make_url("/v1/chat/completions"), json=body)
        error = (await resp.json())["error"]
    assert resp.status == 400
    assert (error["code"], error["param"], error["type"]) == (
        "context_length_exceeded",
        "messages",
        "invalid_request_error",
    )


async def test_queue_full_is_503_server_is_overloaded() -> None:
    from ncap.engine.server import create_engine_app

    small = await asyncio.to_thread(
        Engine.load, EngineSettings(n_ctx=512, max_sequences=2, max_queue=1, threads=2)
    )
    busy = GenerationParams(messages=HAIKU, n=2, max_tokens=64, seed=1)
    srv = TestServer(create_engine_app(small))
    await srv.start_server()
    try:
        async with small.open(busy):
            await until(lambda: small.stats().running_requests == 1)
            async with small.open(busy):  # waits: no free sequence ids
                assert small.stats().queue_depth == 1
                with pytest.raises(Overloaded):
                    async with small.open(busy):
                        pass
                body = {"model": "smollm2", "messages": list(HAIKU), "max_tokens": 4}
                async with aiohttp.ClientSession() as http:
                    resp = await http.post(srv.make_url("/v1/chat/completions"), json=body)
                    error = (await resp.json())["error"]
                assert resp.status == 503
                assert (error["code"], error["type"]) == ("server_is_overloaded", "server_error")
        await until(lambda: small.stats().running_requests == 0)
        assert small.stats().live_sequences == 0
    finally:
        await srv.close()
        await asyncio.to_thread(small.close)


# --- 1. the openai SDK against the engine's own server --------------------------------


async def test_openai_sdk_gets_n_choices(server: TestServer) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["smollm2"]
        resp = await client.chat.completions.create(
            model="smollm2",
            messages=list(HAIKU),
            n=4,
            max_tokens=8,
            seed=3,  # type: ignore[arg-type]
        )
        assert [c.index for c in resp.choices] == [0, 1, 2, 3]
        assert resp.usage is not None
        assert resp.usage.completion_tokens <= 4 * 8
        stream = await client.chat.completions.create(
            model="smollm2",
            messages=list(HAIKU),  # type: ignore[arg-type]
            n=2,
            max_tokens=8,
            seed=3,
            stream=True,
        )
        seen: dict[int, str] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                seen[choice.index] = seen.get(choice.index, "") + (choice.delta.content or "")
        assert seen == {0: resp.choices[0].message.content, 1: resp.choices[1].message.content}
    finally:
        await client.close()


# --- cancellation ---------------------------------------------------------------------


async def test_leaving_a_stream_early_frees_its_sequences(engine: Engine) -> None:
    params = GenerationParams(messages=HAIKU, n=4, max_tokens=200, seed=1)
    async with engine.open(params) as stream:
        async for _events in stream:
            break
    await until(lambda: engine.stats().running_requests == 0)
    assert engine.stats().live_sequences == 0


async def test_client_disconnect_cancels_the_request(engine: Engine, server: TestServer) -> None:
    body = {"model": "smollm2", "messages": list(HAIKU), "n": 2, "max_tokens": 200, "stream": True}
    before = engine.stats().tokens_generated
    async with aiohttp.ClientSession() as http:
        resp = await http.post(server.make_url("/v1/chat/completions"), json=body)
        await resp.content.readuntil(b"\n\n")
        resp.close()
    await until(lambda: engine.stats().running_requests == 0)
    assert engine.stats().tokens_generated - before < 2 * 200


async def test_request_larger_than_the_kv_cache_runs_alone_and_ends_with_length() -> None:
    tiny = await asyncio.to_thread(
        Engine.load, EngineSettings(n_ctx=256, max_sequences=8, max_queue=4, threads=2)
    )
    try:
        params = GenerationParams(messages=HAIKU, n=8, max_tokens=64, seed=1, temperature=1.5)
        done = await tiny.run(params)  # 38 + 8 × 64 cells > 256
        assert "length" in {c.finish_reason for c in done.choices}
        assert all(c.tokens < 64 for c in done.choices)  # cut short when the cache filled
        again = await tiny.run(GenerationParams(messages=HAIKU, n=2, max_tokens=4, seed=1))
        assert [c.tokens for c in again.choices] == [4, 4]
    finally:
        await asyncio.to_thread(tiny.close)
