"""The fake Gemini API read by the official ``google-genai`` SDK: if the SDK cannot
parse an answer, a stream, a function call or an error, the fake is wrong."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from google import genai
from google.genai import errors, types

from ncap.testing.fake_gemini import FakeGemini, running_fake_gemini

KEY = "gk-sdk"
MODEL = "gemini-2.5-flash"
PROMPT = "Write a haiku about harbours."
WEATHER = types.FunctionDeclaration(
    name="get_weather",
    description="The weather in a city.",
    parameters_json_schema={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    },
)


@pytest.fixture
async def fake() -> AsyncIterator[FakeGemini]:
    async with running_fake_gemini(api_key=KEY) as running:
        yield running


def _client(fake: FakeGemini, **headers: str) -> genai.Client:
    options = types.HttpOptions(
        base_url=fake.base_url.removesuffix("/v1beta"),
        api_version="v1beta",
        headers=headers or None,
        retry_options=types.HttpRetryOptions(attempts=1),
    )
    return genai.Client(api_key=KEY, http_options=options)


async def test_candidates_are_parsed_by_the_sdk(fake: FakeGemini) -> None:
    config = types.GenerateContentConfig(candidate_count=3, max_output_tokens=40)
    resp = await _client(fake).aio.models.generate_content(
        model=MODEL, contents=PROMPT, config=config
    )
    assert resp.candidates is not None and len(resp.candidates) == 3
    texts = [c.content.parts[0].text for c in resp.candidates if c.content and c.content.parts]
    assert len(set(texts)) == 3 and all(t and t.startswith("choice") for t in texts)
    assert {c.finish_reason for c in resp.candidates} == {types.FinishReason.STOP}
    usage = resp.usage_metadata
    assert usage is not None and usage.prompt_token_count and usage.candidates_token_count
    assert fake.stats()["key_sources"] == ["header"]


async def test_stream_is_parsed_by_the_sdk(fake: FakeGemini) -> None:
    client = _client(fake)
    whole = await client.aio.models.generate_content(model=MODEL, contents=PROMPT)
    pieces = []
    async for chunk in await client.aio.models.generate_content_stream(
        model=MODEL, contents=PROMPT
    ):
        pieces.append(chunk.text or "")
    assert "".join(pieces) == whole.text
    assert len(pieces) > 1


@pytest.mark.parametrize("stream", [False, True])
async def test_function_call_is_parsed_by_the_sdk(fake: FakeGemini, stream: bool) -> None:
    config = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[WEATHER])],
        tool_config=types.ToolConfig(
            function_calling_config=types.FunctionCallingConfig(
                mode=types.FunctionCallingConfigMode.ANY
            )
        ),
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    client = _client(fake)
    if stream:
        chunks = [
            c
            async for c in await client.aio.models.generate_content_stream(
                model=MODEL, contents=PROMPT, config=config
            )
        ]
        calls = [call for c in chunks for call in c.function_calls or []]
    else:
        resp = await client.aio.models.generate_content(model=MODEL, contents=PROMPT, config=config)
        calls = resp.function_calls or []
    (call,) = calls
    assert call.name == "get_weather" and call.args == {"city": "fake", "days": 1}


@pytest.mark.parametrize(
    ("fault", "error", "code"),
    [
        ("rate_limit", errors.ClientError, 429),
        ("overloaded", errors.ServerError, 503),
        ("error_500", errors.ServerError, 500),
        ("server_error_400", errors.ClientError, 400),
    ],
)
async def test_errors_are_parsed_by_the_sdk(
    fake: FakeGemini, fault: str, error: type[errors.APIError], code: int
) -> None:
    with pytest.raises(error) as info:
        await _client(fake, **{"x-fake-fault": fault}).aio.models.generate_content(
            model=MODEL, contents=PROMPT
        )
    assert info.value.code == code
    assert info.value.status in {
        "RESOURCE_EXHAUSTED",
        "UNAVAILABLE",
        "INTERNAL",
        "INVALID_ARGUMENT",
    }
    assert info.value.message


async def test_a_wrong_key_is_refused_as_gemini_does(fake: FakeGemini) -> None:
    options = types.HttpOptions(
        base_url=fake.base_url.removesuffix("/v1beta"), api_version="v1beta"
    )
    client = genai.Client(api_key="wrong", http_options=options)
    with pytest.raises(errors.ClientError) as info:
        await client.aio.models.generate_content(model=MODEL, contents=PROMPT)
    assert info.value.code == 400
