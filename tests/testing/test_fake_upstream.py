"""The fake upstream does what the gateway's tests rely on: OpenAI shapes, n, streaming
interleaved by index, every fault profile, fail-K-times per key, stats and reset."""

from __future__ import annotations

import asyncio
import importlib
import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from ncap.testing.fake_process import fake_upstream_process
from ncap.testing.fake_upstream import FakeUpstream, running_fake_upstream

SYSTEM, USER = "You are terse.", "Write a haiku about harbours."
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": USER},
]


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with running_fake_upstream() as fake:
        yield fake


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": MESSAGES, **extra}


async def _post(
    http: aiohttp.ClientSession,
    fake: FakeUpstream,
    headers: dict[str, str] | None = None,
    /,
    **extra: Any,
) -> tuple[int, Mapping[str, str], bytes]:
    url = fake.base_url + "/chat/completions"
    async with http.post(url, json=_body(**extra), headers=headers or {}) as reply:
        return reply.status, reply.headers, await reply.read()


def _events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.startswith("data: ")]


def _demux(chunks: list[dict[str, Any]]) -> tuple[dict[int, str], dict[int, str]]:
    contents: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            index = choice["index"]
            contents[index] = contents.get(index, "") + (choice["delta"].get("content") or "")
            if choice["finish_reason"] is not None:
                finishes[index] = choice["finish_reason"]
    return contents, finishes


# --- shapes, n, usage ---


async def test_n3_gives_distinct_choices_and_one_summed_usage(upstream: FakeUpstream) -> None:
    client = AsyncOpenAI(base_url=upstream.base_url, api_key="sk-test", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="fake-model",
        messages=MESSAGES,
        n=3,
    )
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-fake-")
    assert completion.model == "fake-model"
    assert [c.index for c in completion.choices] == [0, 1, 2]
    contents = [c.message.content or "" for c in completion.choices]
    assert len(set(contents)) == 3
    assert all(c.startswith(f"choice {i}: ") for i, c in enumerate(contents))
    assert all(c.finish_reason == "stop" for c in completion.choices)
    assert completion.usage is not None
    assert completion.usage.completion_tokens == sum(len(c.split()) for c in contents)
    prompt_chars = len(SYSTEM) + len(USER)
    assert completion.usage.prompt_tokens == prompt_chars // 4 + len(MESSAGES)
    assert raw.headers["x-request-id"].startswith("req_fake_")
    await client.close()


async def test_answers_are_deterministic_with_unique_ids(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    first = await _post(http, upstream, n=2)
    second = await _post(http, upstream, n=2)
    one, two = json.loads(first[2]), json.loads(second[2])
    assert one["choices"] == two["choices"] and one["usage"] == two["usage"]
    assert one["id"] != two["id"]  # the second answer comes from the template cache
    assert abs(two["created"] - time.time()) < 5
    assert first[1]["x-request-id"] != second[1]["x-request-id"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_output_ceiling_caps_each_choice(
    upstream: FakeUpstream, http: aiohttp.ClientSession, field: str
) -> None:
    _, _, raw = await _post(http, upstream, n=2, **{field: 4})
    body = json.loads(raw)
    assert [len(c["message"]["content"].split()) for c in body["choices"]] == [4, 4]
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    assert body["usage"]["completion_tokens"] == 8


async def test_forced_length_and_token_details(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    headers = {
        "x-fake-completion-tokens": "40",
        "x-fake-cached-tokens": "2",
        "x-fake-reasoning-tokens": "5",
    }
    _, _, raw = await _post(http, upstream, headers, max_tokens=100)
    body = json.loads(raw)
    assert len(body["choices"][0]["message"]["content"].split()) == 40
    usage = body["usage"]
    assert usage["completion_tokens"] == 45
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 5
    assert usage["prompt_tokens_details"]["cached_tokens"] == 2


# --- streaming ---


async def test_stream_interleaves_choices_and_demuxes_to_the_plain_answer(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    plain = json.loads((await _post(http, upstream, n=3, max_tokens=12))[2])
    _, headers, raw = await _post(
        http, upstream, n=3, max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    assert headers["Content-Type"].startswith("text/event-stream")
    events = _events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:3]] == ["assistant"] * 3
    body_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in body_chunks)
    content_indexes = [c["choices"][0]["index"] for c in body_chunks[3:6]]
    assert content_indexes == [0, 1, 2]  # round-robin, not choice by choice
    contents, finishes = _demux(body_chunks)
    assert contents == {c["index"]: c["message"]["content"] for c in plain["choices"]}
    assert finishes == {c["index"]: c["finish_reason"] for c in plain["choices"]}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == plain["usage"]


async def test_stream_without_include_usage_has_no_usage(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    _, _, raw = await _post(http, upstream, n=2, stream=True)
    chunks = [json.loads(e) for e in _events(raw)[:-1]]
    assert all("usage" not in c and len(c["choices"]) == 1 for c in chunks)


async def test_openai_sdk_reads_the_stream(upstream: FakeUpstream) -> None:
    client = AsyncOpenAI(base_url=upstream.base_url, api_key="sk-test", max_retries=0)
    stream = await client.chat.completions.create(
        model="fake-model",
        messages=MESSAGES,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    contents: dict[int, str] = {0: "", 1: ""}
    usage = None
    async for chunk in stream:
        for choice in chunk.choices:
            contents[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert contents[0].startswith("choice 0: ") and contents[1].startswith("choice 1: ")
    assert usage is not None
    assert usage.completion_tokens == sum(len(c.split()) for c in contents.values())
    await client.close()


# --- faults that answer with an error ---

ERROR_CASES = [
    ("rate_limit", {}, 429, "slow_down", "1"),
    ("slow_down", {"x-fake-retry-after": "3"}, 429, "slow_down", "3"),
    ("rate_limit_exceeded", {}, 429, "rate_limit_exceeded", "1"),
    ("rate_limit=2", {}, 429, "slow_down", "2"),
    ("overloaded", {}, 503, "server_is_overloaded", None),
    ("error_500", {}, 500, None, None),
    ("server_error_400", {}, 400, "invalid_value", None),
]


@pytest.mark.parametrize(("fault", "extra", "status", "code", "retry_after"), ERROR_CASES)
async def test_error_faults_answer_with_an_openai_envelope(
    upstream: FakeUpstream,
    http: aiohttp.ClientSession,
    fault: str,
    extra: dict[str, str],
    status: int,
    code: str | None,
    retry_after: str | None,
) -> None:
    got_status, headers, raw = await _post(http, upstream, {"x-fake-fault": fault, **extra})
    error = json.loads(raw)["error"]
    assert got_status == status
    assert error["code"] == code
    assert set(error) == {"message", "type", "param", "code"}
    assert headers.get("Retry-After") == retry_after
    if fault == "server_error_400":
        assert error["type"] == "invalid_request_error" and error["param"] == "n"


async def test_bad_gateway_html_is_not_json(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    status, headers, raw = await _post(http, upstream, {"x-fake-fault": "bad_gateway_html"})
    assert status == 502 and headers["Content-Type"].startswith("text/html")
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)


async def test_timeout_hangs_until_the_client_gives_up(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await http.post(
            upstream.base_url + "/chat/completions",
            json=_body(),
            headers={"x-fake-fault": "timeout"},
            timeout=aiohttp.ClientTimeout(total=0.3),
        )
    await _eventually(lambda: upstream.stats()["in_flight"] == 0)
    assert upstream.stats()["disconnects"] == 1
    assert (await _post(http, upstream))[0] == 200


async def test_latency_delays_the_answer(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    started = time.perf_counter()
    status, _, _ = await _post(http, upstream, {"x-fake-latency-ms": "250"})
    assert status == 200 and time.perf_counter() - started >= 0.25


async def test_unknown_fault_is_a_400(upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    status, _, raw = await _post(http, upstream, {"x-fake-fault": "no_such_fault"})
    assert status == 400 and "no_such_fault" in json.loads(raw)["error"]["message"]


# --- faults in the body or the stream ---


async def test_malformed_json(upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    headers = {"x-fake-fault": "malformed_json"}
    status, _, raw = await _post(http, upstream, headers)
    assert status == 200
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)
    _, _, streamed = await _post(http, upstream, headers, stream=True)
    events = _events(streamed)
    invalid = [e for e in events[:-1] if not _is_json(e)]
    assert len(invalid) == 1 and events[-1] == "[DONE]"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@pytest.mark.parametrize(
    ("fault", "n", "returned"),
    [("extra_choices", 2, 3), ("fewer_choices", 2, 1), ("fewer_choices", 1, 0)],
)
async def test_choice_count_faults(
    upstream: FakeUpstream, http: aiohttp.ClientSession, fault: str, n: int, returned: int
) -> None:
    headers = {"x-fake-fault": fault}
    body = json.loads((await _post(http, upstream, headers, n=n))[2])
    assert len(body["choices"]) == returned
    _, _, raw = await _post(http, upstream, headers, n=n, stream=True)
    contents, _ = _demux([json.loads(e) for e in _events(raw)[:-1]])
    assert len(contents) == returned


async def test_missing_usage_faults(upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    body = json.loads((await _post(http, upstream, {"x-fake-fault": "missing_usage"}))[2])
    assert "usage" not in body
    options = {"stream": True, "stream_options": {"include_usage": True}}
    _, _, raw = await _post(http, upstream, {"x-fake-fault": "stream_no_usage"}, **options)
    chunks = [json.loads(e) for e in _events(raw)[:-1]]
    assert all(c["choices"] and "usage" not in c for c in chunks)


async def test_usage_with_choices_rides_on_the_last_chunk(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    options = {"stream": True, "stream_options": {"include_usage": True}}
    _, _, raw = await _post(http, upstream, {"x-fake-fault": "usage_with_choices"}, n=2, **options)
    chunks = [json.loads(e) for e in _events(raw)[:-1]]
    assert chunks[-1]["choices"] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_reset_mid_stream_is_a_client_side_error(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(
            upstream.base_url + "/chat/completions",
            json=_body(n=2, stream=True),
            headers={"x-fake-fault": "reset_mid_stream", "x-fake-after-chunks": "3"},
        ) as reply:
            assert reply.status == 200
            async for piece in reply.content.iter_any():
                received += piece
    assert len(_events(received)) == 3
    with pytest.raises(aiohttp.ClientPayloadError):
        await _post(http, upstream, {"x-fake-fault": "reset_mid_stream"})


async def test_truncated_stream_ends_cleanly_without_finish_usage_or_done(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    options = {"stream": True, "stream_options": {"include_usage": True}}
    status, _, raw = await _post(http, upstream, {"x-fake-fault": "truncated_stream"}, **options)
    events = _events(raw)
    assert status == 200 and events and "[DONE]" not in events
    chunks = [json.loads(e) for e in events]
    assert all(c["choices"] and c["choices"][0]["finish_reason"] is None for c in chunks)


async def test_first_chunk_then_pause(upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    # timed from before the request is sent: the pause starts on the server after that,
    # so the rest can never arrive sooner than the pause (causality, not machine speed);
    # the first event must come well before the rest (half the pause of slack for load)
    pause = 0.8
    headers = {"x-fake-fault": "first_chunk_then_pause", "x-fake-pause-ms": str(pause * 1000)}
    started = time.perf_counter()
    async with http.post(
        upstream.base_url + "/chat/completions", json=_body(stream=True), headers=headers
    ) as reply:
        first = await reply.content.readuntil(b"\n\n")
        first_at = time.perf_counter() - started
        rest = await reply.read()
        rest_at = time.perf_counter() - started
    assert json.loads(first.decode().removeprefix("data: "))["choices"][0]["delta"]["role"]
    assert rest_at >= pause, rest_at
    assert rest_at - first_at > pause / 2, (first_at, rest_at)
    assert _events(rest)[-1] == "[DONE]"


async def test_slow_and_fragmented_streams_carry_the_same_content(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    plain = json.loads((await _post(http, upstream, n=2))[2])
    expected = {c["index"]: c["message"]["content"] for c in plain["choices"]}
    for headers in (
        {"x-fake-fault": "slow_chunks", "x-fake-chunk-delay-ms": "1"},
        {"x-fake-fault": "fragmented_stream", "x-fake-fragment-bytes": "5"},
    ):
        _, _, raw = await _post(http, upstream, headers, n=2, stream=True)
        assert _demux([json.loads(e) for e in _events(raw)[:-1]])[0] == expected


async def test_client_disconnect_mid_stream_is_counted_and_harmless(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    headers = {"x-fake-fault": "slow_chunks", "x-fake-chunk-delay-ms": "50"}
    async with http.post(
        upstream.base_url + "/chat/completions", json=_body(stream=True), headers=headers
    ) as reply:
        await reply.content.readuntil(b"\n\n")
        reply.close()
    await _eventually(lambda: upstream.stats()["in_flight"] == 0)
    assert upstream.stats()["disconnects"] == 1
    assert (await _post(http, upstream))[0] == 200


# --- fail K times, stats, reset, process profile ---


async def test_fail_times_applies_per_key(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    def headers(key: str) -> dict[str, str]:
        return {"x-fake-fault": "overloaded", "x-fake-fail-times": "2", "x-fake-fail-key": key}

    statuses = [(await _post(http, upstream, headers("a")))[0] for _ in range(3)]
    assert statuses == [503, 503, 200]
    assert (await _post(http, upstream, headers("b")))[0] == 503
    assert upstream.stats()["by_key"] == {"a": 3, "b": 1}


async def test_timeout_then_success(upstream: FakeUpstream, http: aiohttp.ClientSession) -> None:
    headers = {"x-fake-fault": "timeout", "x-fake-fail-times": "1", "x-fake-fail-key": "t"}
    url = upstream.base_url + "/chat/completions"
    with pytest.raises(asyncio.TimeoutError):
        await http.post(
            url, json=_body(), headers=headers, timeout=aiohttp.ClientTimeout(total=0.2)
        )
    assert (await _post(http, upstream, headers))[0] == 200


async def test_stats_show_what_was_received_and_reset_clears_them(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    await _post(http, upstream, {"Authorization": "Bearer first"})
    await _post(http, upstream, {"Authorization": "Bearer sk-route"}, n=2, max_tokens=7)
    async with http.get(upstream.base_url.removesuffix("/v1") + "/_fake/stats") as reply:
        stats = await reply.json()
    assert stats["requests"] == 2
    assert stats["last_headers_seen"]["Authorization"] == "Bearer sk-route"
    assert stats["last_body"] == _body(n=2, max_tokens=7)
    assert len(stats["recent_bodies"]) == 2
    async with http.post(upstream.base_url.removesuffix("/v1") + "/_fake/reset") as reply:
        assert reply.status == 200
    stats = upstream.stats()
    assert stats["requests"] == 0 and stats["last_body"] is None and stats["by_key"] == {}
    assert stats["last_headers_seen"]["Authorization"] is None


async def test_process_profile_applies_unless_the_request_overrides_it(
    http: aiohttp.ClientSession,
) -> None:
    async with running_fake_upstream("overloaded") as fake:
        assert (await _post(http, fake))[0] == 503
        assert (await _post(http, fake, {"x-fake-fault": "none"}))[0] == 200


async def test_models_and_legacy_completions(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async with http.get(upstream.base_url + "/models") as reply:
        models = await reply.json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    body = {"model": "fake-model", "prompt": "Once upon a time", "n": 2, "best_of": 3}
    async with http.post(upstream.base_url + "/completions", json=body) as reply:
        completion = await reply.json()
    assert completion["object"] == "text_completion"
    texts = [c["text"] for c in completion["choices"]]
    assert len(texts) == 2 and texts[0] != texts[1]
    visible = sum(len(t.split()) for t in texts)
    assert completion["usage"]["completion_tokens"] > visible  # the unreturned best_of one
    assert upstream.stats()["by_endpoint"] == {"completions": 1}


async def test_legacy_stream_demuxes_to_the_plain_answer(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    body: dict[str, Any] = {"model": "fake-model", "prompt": "Once upon a time", "n": 2}
    async with http.post(upstream.base_url + "/completions", json=body) as reply:
        plain = await reply.json()
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with http.post(upstream.base_url + "/completions", json=body) as reply:
        events = _events(await reply.read())
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in plain["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]


def test_runs_as_a_separate_process() -> None:
    with fake_upstream_process("rate_limit") as process:
        assert process.base_url.startswith("http://127.0.0.1:")
        stats = process.stats()
        assert stats["requests"] == 0
        process.reset()


async def test_responses_validate_against_the_openai_schema(
    upstream: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    wire = _wire_helpers()
    if wire is None:
        pytest.skip("tests/wire.py (OpenAI schema validation) is not available")
    wire.validate_response(json.loads((await _post(http, upstream, n=2, max_tokens=5))[2]))
    _, _, raw = await _post(
        http, upstream, n=2, stream=True, stream_options={"include_usage": True}
    )
    for event in _events(raw)[:-1]:
        wire.validate_chunk(json.loads(event))
    body = {"model": "fake-model", "prompt": "Once upon a time", "n": 2}
    async with http.post(upstream.base_url + "/completions", json=body) as reply:
        wire.validate_completion_response(await reply.json())


def _wire_helpers() -> Any:
    try:
        return importlib.import_module("tests.wire")
    except ModuleNotFoundError:
        return None


async def _eventually(condition: Any, timeout: float = 3.0) -> None:
    deadline = time.perf_counter() + timeout
    while not condition():
        assert time.perf_counter() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_candidates_pattern_duplicates_at_set_rates(upstream: FakeUpstream) -> None:
    """``x-fake-candidates``: the same label, the same candidate (whole and streamed
    alike); ``tool:NAME`` a tool call; n single-candidate requests share the pattern."""
    pattern = {"x-fake-candidates": "a,a,a,b,tool:lookup"}
    client = AsyncOpenAI(base_url=upstream.base_url, api_key="x", default_headers=pattern)
    whole = await client.chat.completions.create(model="m", messages=MESSAGES, n=5)
    texts = [c.message.content for c in whole.choices]
    assert texts[0] == texts[1] == texts[2] != texts[3]
    assert texts[4] is None and whole.choices[4].finish_reason == "tool_calls"
    call = whole.choices[4].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "lookup"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"query": "lookup now", "limit": 3}  # type: ignore[union-attr]
    streamed: dict[int, str] = {}
    arguments: dict[int, str] = {}
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, n=5, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
            for tc in choice.delta.tool_calls or []:
                fragment = tc.function.arguments if tc.function else ""
                arguments[choice.index] = arguments.get(choice.index, "") + (fragment or "")
    assert [streamed[i] for i in range(4)] == texts[:4]
    assert arguments == {4: call.function.arguments}  # type: ignore[union-attr]
    singles = [
        (await client.chat.completions.create(model="m", messages=MESSAGES)).choices[0]
        for _ in range(5)
    ]
    assert [s.message.content for s in singles] == texts
