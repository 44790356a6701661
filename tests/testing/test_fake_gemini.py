"""The fake Gemini upstream behaves like the Gemini API where the gemini provider relies on
it (candidates by index, usage, SSE framing, errors, API key) and injects every fault
profile; its answers are read back through the real translator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from ncap.protocol.responses import ChatCompletion
from ncap.providers.gemini_errors import GeminiError, translate_error
from ncap.providers.gemini_response import decode_response, to_chat_completion
from ncap.providers.gemini_stream import GeminiStream, decode_stream_event
from ncap.testing.fake_gemini import FakeGemini, parse_gemini_faults, running_fake_gemini

KEY = "gk-test"
CONTENTS = [{"role": "user", "parts": [{"text": "Write a haiku about harbours."}]}]


@pytest.fixture
async def fake() -> AsyncIterator[FakeGemini]:
    async with running_fake_gemini(api_key=KEY) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _request(**config: Any) -> dict[str, Any]:
    return {"contents": CONTENTS, "generationConfig": config}


async def _post(
    http: aiohttp.ClientSession,
    fake: FakeGemini,
    body: dict[str, Any],
    *,
    stream: bool = False,
    headers: dict[str, str] | None = None,
    key_in_query: bool = False,
) -> tuple[int, bytes]:
    method = "streamGenerateContent" if stream else "generateContent"
    params = {"alt": "sse"} if stream else {}
    sent = {"x-goog-api-key": KEY, **(headers or {})}
    if key_in_query:
        params["key"] = sent.pop("x-goog-api-key")
    url = f"{fake.base_url}/models/gemini-2.5-flash:{method}"
    async with http.post(url, json=body, params=params, headers=sent) as reply:
        return reply.status, await reply.read()


def _completion(raw: bytes) -> ChatCompletion:
    return to_chat_completion(decode_response(raw), completion_id="c", created=0, model="m")


def _sse(raw: bytes) -> list[bytes]:
    assert b"[DONE]" not in raw
    events = raw.split(b"\r\n\r\n")
    assert events[-1] == b""  # every event is CRLF-terminated
    return [e.removeprefix(b"data: ") for e in events[:-1]]


def _streamed(raw: bytes) -> tuple[dict[int, str], dict[int, str], dict[str, Any] | None]:
    stream = GeminiStream(completion_id="c", created=0, model="m")
    chunks = [c for e in _sse(raw) for c in stream.feed(decode_stream_event(e))] + stream.close()
    contents: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in map(msgspec.to_builtins, chunks):
        usage = chunk.get("usage", usage)
        for choice in chunk["choices"]:
            i = choice["index"]
            contents[i] = contents.get(i, "") + (choice["delta"].get("content") or "")
            if choice["finish_reason"]:
                finishes[i] = choice["finish_reason"]
    return contents, finishes, usage


# --- shapes ---


async def test_candidate_count_gives_candidates_by_index_and_summed_usage(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    status, raw = await _post(http, fake, _request(candidateCount=3))
    assert status == 200
    body = msgspec.json.decode(raw)
    assert [c.get("index") for c in body["candidates"]] == [None, 1, 2]  # proto3 omits 0
    words = sum(len(c["content"]["parts"][0]["text"].split()) for c in body["candidates"])
    usage = body["usageMetadata"]
    assert usage["candidatesTokenCount"] == words
    assert usage["totalTokenCount"] == usage["promptTokenCount"] + words
    completion = _completion(raw)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert len({c.message.content for c in completion.choices}) == 3


async def test_max_output_tokens_is_per_candidate(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    status, raw = await _post(http, fake, _request(candidateCount=2, maxOutputTokens=3))
    body = msgspec.json.decode(raw)
    assert status == 200
    assert [c["finishReason"] for c in body["candidates"]] == ["MAX_TOKENS", "MAX_TOKENS"]
    assert body["usageMetadata"]["candidatesTokenCount"] == 6


async def test_stream_is_crlf_sse_and_demultiplexes_into_the_whole_answer(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    _, whole = await _post(http, fake, _request(candidateCount=3))
    status, raw = await _post(http, fake, _request(candidateCount=3), stream=True)
    assert status == 200
    contents, finishes, usage = _streamed(raw)
    completion = _completion(whole)
    assert contents == {c.index: c.message.content for c in completion.choices}
    assert finishes == {c.index: c.finish_reason for c in completion.choices}
    assert usage is not None and usage == msgspec.to_builtins(completion.usage)


async def test_api_key_by_header_or_query_and_refusals(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    assert (await _post(http, fake, _request()))[0] == 200
    assert (await _post(http, fake, _request(), key_in_query=True))[0] == 200
    missing_status, missing = await _post(http, fake, _request(), headers={"x-goog-api-key": ""})
    assert missing_status == 403
    wrong_status, wrong = await _post(http, fake, _request(), headers={"x-goog-api-key": "nope"})
    assert wrong_status == 400
    assert translate_error(wrong_status, wrong).kind == "auth"
    assert translate_error(missing_status, missing).kind == "auth"
    assert fake.stats()["key_sources"] == ["header", "query", "none", "header"]


async def test_unknown_fields_are_refused_like_gemini(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    status, raw = await _post(http, fake, {"contents": CONTENTS, "n": 2})
    assert status == 400
    assert msgspec.json.decode(raw)["error"]["message"].endswith(
        'Unknown name "n": Cannot find field.'
    )
    status, raw = await _post(http, fake, _request(candidate_count=2))
    assert status == 400 and b"generation_config.candidate_count" in raw


# --- candidate profiles ---


async def test_shuffled_candidates_come_highest_index_first(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    headers = {"x-fake-fault": "shuffled_candidates"}
    _, raw = await _post(http, fake, _request(candidateCount=3), headers=headers)
    assert [c.get("index") for c in msgspec.json.decode(raw)["candidates"]] == [2, 1, None]
    _, plain = await _post(http, fake, _request(candidateCount=3))
    assert msgspec.to_builtins(_completion(raw).choices) == msgspec.to_builtins(
        _completion(plain).choices
    )
    _, streamed = await _post(http, fake, _request(candidateCount=3), stream=True, headers=headers)
    first = msgspec.json.decode(_sse(streamed)[0])
    assert [c.get("index") for c in first["candidates"]] == [2, 1, None]
    assert _streamed(streamed)[0] == {
        c.index: c.message.content for c in _completion(plain).choices
    }


@pytest.mark.parametrize(
    ("fault", "n", "message", "maximum"),
    [
        ("refuse_candidates", 2, b"Multiple candidates is not enabled for this model", 1),
        ("refuse_candidates=4", 6, b"to 5 (exclusive)", 4),
        ("none", 9, b"from 1 (inclusive) to 9 (exclusive)", 8),
    ],
)
async def test_candidate_count_refusals(
    fake: FakeGemini, http: aiohttp.ClientSession, fault: str, n: int, message: bytes, maximum: int
) -> None:
    headers = {"x-fake-fault": fault}
    status, raw = await _post(http, fake, _request(candidateCount=n), headers=headers)
    assert status == 400 and message in raw
    error = translate_error(status, raw)
    assert (error.kind, error.code, error.param, error.max_candidates) == (
        "candidates",
        "route_does_not_support_candidates",
        "n",
        maximum,
    )
    assert (await _post(http, fake, _request(candidateCount=maximum), headers=headers))[0] == 200


async def test_ignore_candidates_answers_one(fake: FakeGemini, http: aiohttp.ClientSession) -> None:
    headers = {"x-fake-fault": "ignore_candidates"}
    _, raw = await _post(http, fake, _request(candidateCount=3), headers=headers)
    assert len(_completion(raw).choices) == 1


async def test_safety_candidate_has_no_content(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    headers = {"x-fake-fault": "safety_candidate"}
    _, raw = await _post(http, fake, _request(candidateCount=2), headers=headers)
    last = msgspec.json.decode(raw)["candidates"][-1]
    assert last == {"finishReason": "SAFETY", "index": 1}
    choices = _completion(raw).choices
    assert [(c.finish_reason, c.message.content is None) for c in choices] == [
        ("stop", False),
        ("content_filter", True),
    ]
    _, streamed = await _post(http, fake, _request(candidateCount=2), stream=True, headers=headers)
    contents, finishes, _ = _streamed(streamed)
    assert finishes == {0: "stop", 1: "content_filter"} and contents[1] == ""


async def test_thoughts_and_cached_tokens_in_usage(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    headers = {"x-fake-reasoning-tokens": "40", "x-fake-cached-tokens": "3"}
    _, raw = await _post(http, fake, _request(candidateCount=2), headers=headers)
    meta = msgspec.json.decode(raw)["usageMetadata"]
    assert (meta["thoughtsTokenCount"], meta["cachedContentTokenCount"]) == (40, 3)
    usage = _completion(raw).usage
    assert not isinstance(usage, msgspec.UnsetType)
    assert usage.completion_tokens == meta["candidatesTokenCount"] + 40
    assert msgspec.to_builtins(usage.completion_tokens_details) == {"reasoning_tokens": 40}
    assert msgspec.to_builtins(usage.prompt_tokens_details) == {"cached_tokens": 3}


@pytest.mark.parametrize(("fault", "returned"), [("extra_choices", 3), ("fewer_choices", 1)])
async def test_extra_and_fewer_choices(
    fake: FakeGemini, http: aiohttp.ClientSession, fault: str, returned: int
) -> None:
    _, raw = await _post(http, fake, _request(candidateCount=2), headers={"x-fake-fault": fault})
    assert len(_completion(raw).choices) == returned


# --- fault profiles, read back through the translator ---


@pytest.mark.parametrize(
    ("fault", "status", "kind", "retry_after"),
    [
        ("rate_limit=7", 429, "rate_limit", 7.0),
        ("rate_limit_exceeded", 429, "rate_limit", 1.0),
        ("overloaded", 503, "overloaded", None),
        ("error_500", 500, "upstream", None),
        ("bad_gateway_html", 502, "upstream", None),
        ("server_error_400", 400, "invalid", None),
    ],
)
async def test_error_profiles_speak_googles_envelope(
    fake: FakeGemini,
    http: aiohttp.ClientSession,
    fault: str,
    status: int,
    kind: str,
    retry_after: float | None,
) -> None:
    got, raw = await _post(http, fake, _request(), headers={"x-fake-fault": fault})
    assert got == status
    error = translate_error(got, raw)
    assert (error.kind, error.retry_after) == (kind, retry_after)


async def test_timeout_hangs_then_deadline_exceeded(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    headers = {"x-fake-fault": "timeout", "x-fake-timeout-s": "0.2"}
    status, raw = await _post(http, fake, _request(), headers=headers)
    assert status == 504 and translate_error(status, raw).kind == "timeout"


async def test_fail_times_applies_to_the_first_k_requests_of_a_key(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    headers = {"x-fake-fault": "overloaded", "x-fake-fail-times": "2", "x-fake-fail-key": "k1"}
    statuses = [(await _post(http, fake, _request(), headers=headers))[0] for _ in range(3)]
    assert statuses == [503, 503, 200]


async def test_missing_usage_and_stream_without_usage(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    _, raw = await _post(http, fake, _request(), headers={"x-fake-fault": "missing_usage"})
    assert isinstance(_completion(raw).usage, msgspec.UnsetType)
    headers = {"x-fake-fault": "stream_no_usage"}
    _, streamed = await _post(http, fake, _request(candidateCount=2), stream=True, headers=headers)
    _, finishes, usage = _streamed(streamed)
    assert usage is None and set(finishes) == {0, 1}


async def test_malformed_json_is_a_protocol_failure(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    _, raw = await _post(http, fake, _request(), headers={"x-fake-fault": "malformed_json"})
    with pytest.raises(GeminiError) as caught:
        _completion(raw)
    assert caught.value.kind == "protocol"


async def test_truncated_stream_ends_without_finish(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    headers = {"x-fake-fault": "truncated_stream=2"}
    _, streamed = await _post(http, fake, _request(candidateCount=2), stream=True, headers=headers)
    assert len(_sse(streamed)) == 2
    _, finishes, _ = _streamed(streamed)
    assert finishes == {}


async def test_reset_mid_stream_cuts_the_connection(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    headers = {"x-fake-fault": "reset_mid_stream=1"}
    with pytest.raises(aiohttp.ClientPayloadError):
        await _post(http, fake, _request(candidateCount=2), stream=True, headers=headers)


async def test_fragmented_stream_still_parses(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    _, whole = await _post(http, fake, _request(candidateCount=2))
    headers = {"x-fake-fault": "fragmented_stream=5"}
    _, streamed = await _post(http, fake, _request(candidateCount=2), stream=True, headers=headers)
    assert _streamed(streamed)[0] == {
        c.index: c.message.content for c in _completion(whole).choices
    }


def test_unknown_profile_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fake fault profile"):
        parse_gemini_faults("refuse_candidates,no_such_fault")
    faults = parse_gemini_faults("refuse_candidates=3,latency=5")
    assert faults.names == {"refuse_candidates", "latency"}
    assert dict(faults.values) == {"refuse_candidates": "3", "latency": "5"}


async def test_latency_and_slow_chunks_pace_the_answer(
    fake: FakeGemini, http: aiohttp.ClientSession
) -> None:
    """Lower bounds only: a loaded machine can be slower, never faster."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    await _post(http, fake, _request(), headers={"x-fake-latency-ms": "150"})
    assert loop.time() - start >= 0.14
    headers = {"x-fake-fault": "slow_chunks=20"}
    start = loop.time()
    _, streamed = await _post(http, fake, _request(), stream=True, headers=headers)
    events = len(_sse(streamed))
    assert events >= 5 and loop.time() - start >= 0.019 * events
