from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk
from openai.types.chat.chat_completion import Choice

from ncap.client import ChoiceBuffer, Demuxed, StreamError, ademux, demux
from tests.client.chunks import INTERLEAVED, USAGE, chunk, delta

try:  # openai >= 3 ships its own fork of httpx; earlier versions use httpx itself
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx  # type: ignore[no-redef]


def sdk_chunks(chunks: Iterable[dict[str, Any]]) -> list[ChatCompletionChunk]:
    return [ChatCompletionChunk.model_validate(c) for c in chunks]


def check_interleaved(result: Demuxed) -> None:
    first, second, third = result.to_choices()
    assert [c.index for c in result.to_choices()] == [0, 1, 2]
    assert (first.content, first.finish_reason, first.role) == ("Rain falls.", "stop", "assistant")
    assert [e["token"] if isinstance(e, dict) else e.token for e in first.logprobs] == [
        "Rain ",
        "falls.",
    ]
    assert second.content is None and second.finish_reason == "tool_calls"
    calls = second.ordered_tool_calls()
    assert [(c.index, c.id, c.type, c.name) for c in calls] == [
        (0, "call_a", "function", "get_weather"),
        (1, "call_b", "function", "get_time"),
    ]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Oslo"}, {"tz": "CET"}]
    assert (third.content, third.finish_reason, third.tool_calls) == (
        "The harbour lights",
        "length",
        {},
    )
    assert result.unfinished == []
    assert (result.id, result.model) == ("chatcmpl-1", "m")


def usage_dict(usage: Any) -> dict[str, Any]:
    return usage if isinstance(usage, dict) else usage.model_dump(exclude_none=True)


def test_demux_of_inline_dicts() -> None:
    result = demux(INTERLEAVED)
    check_interleaved(result)
    assert result.usage == USAGE


def test_demux_of_sdk_chunk_objects() -> None:
    result = demux(sdk_chunks(INTERLEAVED))
    check_interleaved(result)
    assert usage_dict(result.usage) == USAGE


async def test_ademux_of_an_async_stream() -> None:
    async def stream() -> AsyncIterator[ChatCompletionChunk]:
        for c in sdk_chunks(INTERLEAVED):
            yield c

    check_interleaved(await ademux(stream()))


@pytest.mark.parametrize("order", [[2, 0, 1], [1, 2, 0], [0, 1, 2]])
def test_choices_finishing_in_any_order_are_ordered_by_index(order: list[int]) -> None:
    """Arrival order of the first delta and of each finish says nothing about the result."""
    chunks = [chunk(delta(i, role="assistant", content=f"answer {i}")) for i in order]
    chunks += [chunk(delta(i, finish="stop" if i else "length")) for i in reversed(order)]
    result = demux(chunks)
    assert [(c.index, c.content) for c in result.to_choices()] == [
        (0, "answer 0"),
        (1, "answer 1"),
        (2, "answer 2"),
    ]
    assert [c.finish_reason for c in result.to_choices()] == ["length", "stop", "stop"]
    assert result.usage is None


def test_one_chunk_may_carry_several_choices() -> None:
    result = demux([chunk(delta(1, content="b"), delta(0, content="a", finish="stop"))])
    assert [(c.index, c.content, c.finish_reason) for c in result.to_choices()] == [
        (0, "a", "stop"),
        (1, "b", None),
    ]
    assert result.unfinished == [1]


def test_refusal_and_legacy_function_call_deltas() -> None:
    result = demux(
        [
            chunk(delta(0, refusal="I can't "), delta(1, function_call={"name": "f"})),
            chunk(delta(0, refusal="help."), delta(1, function_call={"arguments": '{"a"'})),
            chunk(delta(1, function_call={"arguments": ": 1}"})),
        ]
    )
    refused, called = result.to_choices()
    assert (refused.refusal, refused.content) == ("I can't help.", None)
    assert called.function_call is not None
    assert (called.function_call.name, called.function_call.arguments) == ("f", '{"a": 1}')


def test_to_dict_is_a_valid_sdk_choice() -> None:
    for buffer in demux(INTERLEAVED).to_choices():
        choice = Choice.model_validate(buffer.to_dict())
        assert choice.index == buffer.index
        assert choice.finish_reason == buffer.finish_reason
        assert choice.message.content == buffer.content
    weather = Choice.model_validate(demux(INTERLEAVED).choices[1].to_dict())
    assert weather.message.tool_calls is not None
    assert weather.message.tool_calls[0].id == "call_a"
    prose = Choice.model_validate(demux(sdk_chunks(INTERLEAVED)).choices[0].to_dict())
    assert prose.logprobs is not None and prose.logprobs.content is not None
    assert [e.token for e in prose.logprobs.content] == ["Rain ", "falls."]


def test_an_error_event_raises() -> None:
    error = {"error": {"message": "The upstream stream failed mid-way.", "type": "api_error"}}
    with pytest.raises(StreamError, match="failed mid-way") as caught:
        demux([INTERLEAVED[0], error])
    assert caught.value.error["type"] == "api_error"


def test_a_cut_stream_leaves_choices_unfinished() -> None:
    result = demux(INTERLEAVED[:6])
    assert result.unfinished == [0, 1]
    assert result.usage is None
    assert isinstance(result.choices[2], ChoiceBuffer)


def test_demux_of_the_sdks_own_stream_over_sse() -> None:
    """End to end through ``openai.OpenAI(...).chat.completions.create(stream=True)``."""
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in INTERLEAVED) + "data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["n"] == 3 and sent["stream"] is True
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=sse.encode()
        )

    client = openai.OpenAI(
        api_key="k",
        base_url="http://ncap.test/v1",
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    result = demux(stream)
    check_interleaved(result)
    assert usage_dict(result.usage) == USAGE
