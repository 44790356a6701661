"""Forced and ``auto`` tool calls on the real SmolLM2: the grammar, token by token, and
a few seeded requests of the sweep (``make bench-engine-tools`` runs all 200) through
the gateway with the official SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from ncap.config import Stores, Workload, default_config
from ncap.engine import Engine, EngineSettings, chat_params
from ncap.engine.sampling import GrammarDraw
from ncap.engine.tools import tool_grammar
from tests.engine._require import require_engine
from tests.engine.tool_checks import MESSAGES, TOOLS, Tally, request
from tests.support import ServerThread, gateway

require_engine()
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine.load(EngineSettings(n_ctx=1024, max_sequences=4, max_queue=4, threads=2))
    yield eng
    eng.close()


def walk(engine: Engine, body: dict[str, Any], text: str) -> tuple[bool, bool]:
    """(every token of ``text`` taken by the request's grammar, the end allowed after)."""
    params = chat_params({"messages": MESSAGES, "tools": TOOLS, **body})
    assert params.tools is not None
    m = engine.model
    draw = GrammarDraw(
        m.lib, m.vocab, m.n_vocab, params, seed=1, grammar=tool_grammar(params.tools)
    )
    try:
        for token in m.tokenize(text):
            if not draw.allows(token):
                return False, False
            draw.accept(token)
        return True, draw.allows(m.lib.llama_vocab_eos(m.vocab))
    finally:
        draw.close()


REQUIRED = {"tool_choice": "required"}
NAMED = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
SINGLE = {"tool_choice": "required", "parallel_tool_calls": False}


@pytest.mark.parametrize(
    ("body", "text", "taken", "may_end"),
    [
        (REQUIRED, CALL, True, True),
        (REQUIRED, CALL[:-4], True, False),  # a call cannot end before its closing tag
        (REQUIRED, CALL + " Even so", False, False),  # nothing after the last call
        (REQUIRED, CALL + "\n" + CALL, True, True),
        (SINGLE, CALL + "\n" + CALL, False, False),  # parallel_tool_calls false: one
        (REQUIRED, CALL.replace("Asia/Tokyo", "Asia\nTokyo"), False, False),  # raw newline
        (REQUIRED, CALL.replace("Asia/Tokyo", 'Asia\\"Tokyo\\u00e9'), True, True),  # escapes
        (REQUIRED, CALL.replace('"}}', "}}"), False, False),  # the string must close
        (REQUIRED, "Sure, it is noon.", False, False),  # forced: no prose
        (NAMED, CALL, False, False),  # named get_weather: get_time refused
        (NAMED, CALL.replace("get_time", "get_weather").replace('"tz"', '"city"'), True, True),
        ({}, "It is noon in Tokyo.", True, True),  # auto: prose
        ({}, CALL, True, True),  # auto: a call
        ({}, "Let me check. <tool_call>", False, False),  # prose never opens a call
        ({}, " <tool_call>", False, False),
        ({}, "1 < 2 and <b>bold</b>", True, True),  # a "<" elsewhere is prose
    ],
)
def test_the_grammar_token_by_token(
    engine: Engine, body: dict[str, Any], text: str, taken: bool, may_end: bool
) -> None:
    assert walk(engine, body, text) == (taken, may_end)


async def test_forced_choices_are_calls_and_cut_ones_partial_calls(engine: Engine) -> None:
    """Engine level, 16 tokens: too few for a whole call, so every choice is cut."""
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "n": 4}
    done = await engine.run(chat_params({**body, "max_tokens": 12, "seed": 3}))
    for choice in done.choices:
        assert choice.finish_reason == "length" and choice.text == ""
        (call,) = choice.tool_calls
        assert any(name.startswith(call.name) for name in ("get_time", "get_weather"))


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tmp = tmp_path_factory.mktemp("tool-sweep")
    base = default_config()
    route = base.routes["local-smollm2"].model_copy(
        update={"threads": 2, "n_ctx": 2048, "max_sequences": 20}
    )
    config = base.model_copy(
        update={
            "stores": Stores(
                ledger=f"sqlite:///{tmp}/ledger.db", budgets=f"sqlite:///{tmp}/budgets.db"
            ),
            "workloads": {"default": Workload(max_candidates=8)},
            "routes": {"local-smollm2": route},
        }
    )
    with gateway(config) as server:
        yield server


# one seed per (tool_choice kind, parallel_tool_calls), both temperatures and the 16 and
# 64 token ceilings among them: the sweep's cases but its slowest ceiling (256)
SEEDS = (0, 4, 8, 21, 25, 29)


def test_seeded_requests_of_the_sweep(gw: ServerThread) -> None:
    bodies = [request(s) for s in SEEDS]
    assert {b["temperature"] for b in bodies} == {1.0, 1.5}
    assert {b["max_tokens"] for b in bodies} == {16, 64}
    assert {(json.dumps(b["tool_choice"]), b["parallel_tool_calls"]) for b in bodies} == {
        (json.dumps(request(k)["tool_choice"]), p) for k in range(3) for p in (False, True)
    }
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", timeout=900)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda b: client.chat.completions.create(**b), bodies))
    tally = Tally()
    for body, completion in zip(bodies, answers, strict=True):
        tally.add(body, completion)
    assert tally.failures == []
    assert tally.requests == 6 and sum(tally.choices.values()) == 30
    forced = sum(v for (kind, _), v in tally.choices.items() if kind != "auto")
    calls = sum(v for (kind, out), v in tally.choices.items() if kind != "auto" and out != "prose")
    assert forced == calls == 20
    assert tally.single_call_choices > 0 and tally.calls_validated > 0
