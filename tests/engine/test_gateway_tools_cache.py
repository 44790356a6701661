"""Tools and the prefix cache through the gateway, on the real SmolLM2, with the SDK.

One gateway, two local routes: ``smollm2`` (native n) and ``smollm2-fanout``
(``candidates: emulate``, so n becomes k single-candidate requests to the same engine).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from ncap.client import demux, tool_call_agreement
from ncap.config import Contract, Pricing, Stores, Workload, default_config
from ncap.domain.money import cost_micros
from tests.http.test_accounting import settled_rows
from tests.support import ServerThread, gateway
from tests.wire import validate_chunk, validate_response

pytest.importorskip("llama_cpp")
# a few seconds each on a quiet machine; the bound is for a shared, loaded one
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current local time in a timezone",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
                "required": ["timezone"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
PRICING = Pricing(input_per_mtok=1.0, cached_input_per_mtok=0.1, output_per_mtok=2.0)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Path]]:
    tmp = tmp_path_factory.mktemp("tools")
    base = default_config()
    native = base.routes["local-smollm2"].model_copy(
        update={"threads": 2, "n_ctx": 2048, "max_sequences": 8, "pricing": PRICING}
    )
    fanout = native.model_copy(
        update={"contract": Contract(candidates="emulate", max_candidates=8)}
    )
    config = base.model_copy(
        update={
            "stores": Stores(ledger=f"sqlite:///{tmp}/ledger.db", budgets=f"sqlite:///{tmp}/b.db"),
            "workloads": {"default": Workload(max_candidates=8)},
            "models": {"smollm2": ["local-smollm2"], "smollm2-fanout": ["local-fanout"]},
            "routes": {"local-smollm2": native, "local-fanout": fanout},
        }
    )
    with gateway(config) as server:
        yield server, tmp


def sdk(gw: tuple[ServerThread, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw[0].url + "/v1", api_key="unused", timeout=600)


def assert_valid_call(call: Any) -> str:
    """A call names one of the tools and its arguments match that tool's schema."""
    name, arguments = call.function.name, call.function.arguments
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert call.id and call.type == "function"
    return str(name)


def assert_calls(choice: Any) -> list[str]:
    """A call choice: whole calls (``tool_calls``), or the calls so far with the last one
    cut by the token limit (``length``, as OpenAI returns it); never text beside them."""
    calls = choice.message.tool_calls or []
    assert calls and not choice.message.content
    if choice.finish_reason == "tool_calls":
        return [assert_valid_call(c) for c in calls]
    assert choice.finish_reason == "length"
    cut = calls[-1].function.name
    assert any(name.startswith(cut) for name in SCHEMAS)
    return [*(assert_valid_call(c) for c in calls[:-1]), cut]


def summary(choice: Any) -> tuple[Any, ...]:
    """What a choice said, without the (random) call ids; SDK choice or demux buffer."""
    if hasattr(choice, "message"):
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.index, choice.message.content, tuple(calls), choice.finish_reason
    calls = [(c.name, c.arguments) for c in choice.ordered_tool_calls()]
    return choice.index, choice.content or None, tuple(calls), choice.finish_reason


def test_auto_n5_every_choice_is_prose_or_a_valid_call_and_the_stream_agrees(
    gw: tuple[ServerThread, Path],
) -> None:
    client = sdk(gw)
    args: dict[str, Any] = {
        "model": "smollm2",
        "messages": ASK,
        "n": 5,
        "max_tokens": 48,
        "seed": 3,
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
    }
    raw = client.chat.completions.with_raw_response.create(**args)
    validate_response(raw.http_response.json())
    completion = raw.parse()
    assert [c.index for c in completion.choices] == [0, 1, 2, 3, 4]
    called: list[str | None] = []
    for choice in completion.choices:
        calls = choice.message.tool_calls or []
        if calls:
            assert len(calls) == 1  # parallel_tool_calls false
            called.append(assert_calls(choice)[0])
        else:
            assert choice.message.content and choice.finish_reason in ("stop", "length")
            assert not choice.message.content.lstrip().startswith("<")
            called.append(None)
    shares = tool_call_agreement(completion.choices)
    assert sum(shares.values()) == pytest.approx(1.0)
    for name in {*called}:
        assert shares[name] == pytest.approx(called.count(name) / 5)

    chunks = list(client.chat.completions.create(**args, stream=True))
    for chunk in chunks:
        validate_chunk(chunk.model_dump(exclude_unset=True))
    streamed = demux(chunks).to_choices()
    assert [summary(c) for c in streamed] == [summary(c) for c in completion.choices]


def test_required_and_named_tool_choice_give_five_calls(gw: tuple[ServerThread, Path]) -> None:
    client = sdk(gw)
    base: dict[str, Any] = {"model": "smollm2", "n": 5, "max_tokens": 48, "seed": 5}
    required = client.chat.completions.create(
        **base, messages=ASK, tools=TOOLS, tool_choice="required"
    )
    for choice in required.choices:
        assert assert_calls(choice)

    # a history with an earlier call and its result (role: tool) is accepted
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "rain", "c": 11}'},
        {"role": "user", "content": "And what time is it there?"},
    ]
    named = client.chat.completions.create(
        **base,
        messages=history,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert len(named.choices) == 5
    for choice in named.choices:
        assert {name for name in assert_calls(choice) if name} <= {"get_time"}
    assert tool_call_agreement(named.choices) == {"get_time": 1.0, None: 0.0}


def test_unknown_named_tool_is_a_400(gw: tuple[ServerThread, Path]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk(gw).chat.completions.create(
            model="smollm2",
            messages=ASK,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "nope"}},
            max_tokens=4,
        )
    assert info.value.param == "tool_choice"


def test_fan_out_branches_after_the_first_reuse_the_prompt_and_are_priced_cached(
    gw: tuple[ServerThread, Path],
) -> None:
    rubric = "Grade the answer for accuracy, tone and brevity. " * 12
    messages = [
        {"role": "system", "content": rubric},
        {"role": "user", "content": "Answer: the sea is salty because of dissolved minerals."},
    ]
    raw = sdk(gw).chat.completions.with_raw_response.create(
        model="smollm2-fanout",
        messages=messages,  # type: ignore[arg-type]
        n=3,
        max_tokens=4,
        seed=9,
    )
    completion = raw.parse()
    assert len(completion.choices) == 3
    rows = asyncio.run(settled_rows(gw[1], raw.headers["x-request-id"], count=3))
    assert len(rows) == 3 and all(r.state == "settled" for r in rows)
    prompt = rows[0].input_tokens
    assert prompt is not None and prompt > 150
    cached = sorted(r.cached_input_tokens or 0 for r in rows)
    # every branch but the first took the whole prompt but its last two tokens from the cache
    assert cached[1:] == [prompt - 2, prompt - 2]
    assert cached[0] < prompt - 2
    for row in rows:
        assert row.cost_micros == cost_micros(
            row.input_tokens or 0,
            row.cached_input_tokens or 0,
            row.output_tokens_total or 0,
            PRICING,
        )


def test_fan_out_merged_usage_reports_the_branches_cached_tokens(
    gw: tuple[ServerThread, Path],
) -> None:
    messages = [{"role": "system", "content": "Reply in one word. " * 20}, *ASK]
    raw = sdk(gw).chat.completions.with_raw_response.create(
        model="smollm2-fanout",
        messages=messages,  # type: ignore[arg-type]
        n=2,
        max_tokens=2,
        seed=4,
    )
    rows = asyncio.run(settled_rows(gw[1], raw.headers["x-request-id"], count=2))
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == sum(
        r.cached_input_tokens or 0 for r in rows
    )
