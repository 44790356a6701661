"""The fake Anthropic upstream is read by the official ``anthropic`` SDK: if the SDK
cannot parse an answer, a stream or an error, the fake is wrong. Non-stream, stream,
tools, errors, and prompt caching with a TTL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from ncap.testing.fake_anthropic import (
    MIN_CACHE_TOKENS,
    FakeAnthropic,
    parse_anthropic_faults,
    running_fake_anthropic,
)

KEY = "sk-ant-test"
MODEL = "claude-fake"
MESSAGES: list[Any] = [{"role": "user", "content": "Write a haiku about harbours."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    },
}


@pytest.fixture
async def fake() -> AsyncIterator[FakeAnthropic]:
    async with running_fake_anthropic(api_key=KEY, cache_ttl_s=0.5) as running:
        yield running


def _client(fake: FakeAnthropic, **headers: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        api_key=KEY,
        base_url=fake.base_url.removesuffix("/v1"),
        max_retries=0,
        default_headers=headers or None,
    )


async def test_message_is_parsed_by_the_sdk(fake: FakeAnthropic) -> None:
    msg = await _client(fake).messages.create(model=MODEL, max_tokens=64, messages=MESSAGES)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    (block,) = msg.content
    assert block.type == "text" and block.text.startswith("choice 0:")
    assert msg.stop_reason == "end_turn"
    assert msg.usage.output_tokens == len(block.text.split())
    assert msg.usage.input_tokens > 0


async def test_max_tokens_stops_with_max_tokens(fake: FakeAnthropic) -> None:
    msg = await _client(fake).messages.create(model=MODEL, max_tokens=3, messages=MESSAGES)
    assert msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 3


async def test_stream_is_parsed_by_the_sdk(fake: FakeAnthropic) -> None:
    client = _client(fake)
    whole = await client.messages.create(model=MODEL, max_tokens=64, messages=MESSAGES)
    async with client.messages.stream(model=MODEL, max_tokens=64, messages=MESSAGES) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "message_delta"} <= set(kinds)
    assert final.content[0].type == "text"
    assert whole.content[0].type == "text"
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_tool_call_is_parsed_by_the_sdk(fake: FakeAnthropic, stream: bool) -> None:
    client = _client(fake)
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": MESSAGES,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    if stream:
        async with client.messages.stream(**kwargs) as events:
            msg = await events.get_final_message()
    else:
        msg = await client.messages.create(**kwargs)
    (call,) = msg.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input == {"city": "fake", "days": 1}
    assert msg.stop_reason == "tool_use"


async def test_tool_every_calls_on_every_kth_request(fake: FakeAnthropic) -> None:
    client = _client(fake, **{"x-fake-fault": "tool_every=2"})
    stops = []
    for _ in range(4):
        msg = await client.messages.create(
            model=MODEL, max_tokens=64, messages=MESSAGES, tools=[WEATHER]
        )
        stops.append(msg.stop_reason)
    assert sorted(stops) == ["end_turn", "end_turn", "tool_use", "tool_use"]


async def test_tool_result_round_trip(fake: FakeAnthropic) -> None:
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Oslo", "days": 1},
                }
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"}],
        },
    ]
    msg = await _client(fake).messages.create(
        model=MODEL,
        max_tokens=64,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "none"},
    )
    assert msg.content[0].type == "text" and msg.stop_reason == "end_turn"


@pytest.mark.parametrize(
    ("fault", "error", "status"),
    [
        ("rate_limit_exceeded=2", anthropic.RateLimitError, 429),
        ("overloaded", anthropic.InternalServerError, 529),
        ("error_500", anthropic.InternalServerError, 500),
        ("server_error_400", anthropic.BadRequestError, 400),
    ],
)
async def test_errors_are_parsed_by_the_sdk(
    fake: FakeAnthropic, fault: str, error: type[anthropic.APIStatusError], status: int
) -> None:
    with pytest.raises(error) as info:
        await _client(fake, **{"x-fake-fault": fault}).messages.create(
            model=MODEL, max_tokens=64, messages=MESSAGES
        )
    assert info.value.status_code == status
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    expected = {
        429: "rate_limit_error",
        529: "overloaded_error",
        500: "api_error",
        400: "invalid_request_error",
    }
    assert body["error"]["type"] == expected[status]
    if status == 429:
        assert info.value.response.headers["retry-after"] == "2"
    assert info.value.request_id is not None


async def test_refusals_before_generation(fake: FakeAnthropic) -> None:
    wrong = anthropic.AsyncAnthropic(
        api_key="wrong", base_url=fake.base_url.removesuffix("/v1"), max_retries=0
    )
    with pytest.raises(anthropic.AuthenticationError):
        await wrong.messages.create(model=MODEL, max_tokens=64, messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError) as info:
        await _client(fake).messages.create(
            model=MODEL, max_tokens=64, messages=MESSAGES, extra_body={"temperature": 1.5}
        )
    assert "temperature" in info.value.message


async def test_stream_error_event_is_raised_by_the_sdk(fake: FakeAnthropic) -> None:
    client = _client(fake, **{"x-fake-fault": "stream_overloaded"})
    with pytest.raises(anthropic.APIStatusError) as info:
        async with client.messages.stream(model=MODEL, max_tokens=64, messages=MESSAGES) as s:
            async for _ in s:
                pass
    assert "Overloaded" in str(info.value)


def _long_prompt(cache: bool) -> list[Any]:
    text = "The harbour wall is old. " * (MIN_CACHE_TOKENS // 5 * 5)
    block: dict[str, Any] = {"type": "text", "text": text}
    if cache:
        block["cache_control"] = {"type": "ephemeral"}
    return [{"role": "user", "content": [block]}]


async def test_prompt_cache_writes_then_reads_within_the_ttl(fake: FakeAnthropic) -> None:
    client = _client(fake)

    async def usage(cache: bool = True) -> Any:
        msg = await client.messages.create(model=MODEL, max_tokens=8, messages=_long_prompt(cache))
        return msg.usage

    first, second = await usage(), await usage()
    assert first.cache_creation_input_tokens >= MIN_CACHE_TOKENS
    assert first.cache_read_input_tokens == 0
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens == 0
    total = first.input_tokens + first.cache_creation_input_tokens
    assert second.input_tokens + second.cache_read_input_tokens == total
    unmarked = await usage(cache=False)
    assert (unmarked.cache_read_input_tokens, unmarked.input_tokens) == (0, total)
    await asyncio.sleep(0.6)  # past the TTL: written again
    assert (await usage()).cache_creation_input_tokens == first.cache_creation_input_tokens


async def test_short_prompts_are_not_cached(fake: FakeAnthropic) -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
        }
    ]
    for _ in range(2):
        msg = await _client(fake).messages.create(model=MODEL, max_tokens=8, messages=messages)
        assert msg.usage.cache_read_input_tokens == msg.usage.cache_creation_input_tokens == 0


def test_profiles_extend_the_openai_fakes() -> None:
    faults = parse_anthropic_faults("tool_every=3,overloaded")
    assert faults.names == {"tool_every", "overloaded"}
    assert faults.values["tool_every"] == "3"
    with pytest.raises(ValueError):
        parse_anthropic_faults("no_such_fault")
