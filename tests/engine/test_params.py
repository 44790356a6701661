"""Request dict → GenerationParams, and per-choice seeds."""

from __future__ import annotations

from typing import Any

import pytest

from ncap.engine.params import JsonGrammar, chat_params, completion_params
from ncap.engine.sampling import choice_seed
from ncap.errors import InvalidType, InvalidValue

MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_params_keep_what_generation_needs() -> None:
    p = chat_params(
        {
            "model": "m",
            "messages": MESSAGES,
            "n": 3,
            "max_completion_tokens": 20,
            "max_tokens": 99,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 7,
            "stop": "END",
            "logit_bias": {"42": -100},
            "logprobs": True,
            "top_logprobs": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
        }
    )
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.seed) == (3, 20, 0.5, 0.9, 7)
    assert p.stop == ("END",)
    assert p.logit_bias == {42: -100.0}
    assert (p.logprobs, p.top_logprobs) == (True, 2)
    assert p.json == JsonGrammar({})


def test_chat_defaults() -> None:
    p = chat_params({"messages": MESSAGES, "temperature": None})
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.seed, p.json) == (
        1,
        None,
        1.0,
        1.0,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("body", "error", "param"),
    [
        ({"messages": []}, InvalidValue, "messages"),
        ({"messages": MESSAGES, "n": "2"}, InvalidType, "n"),
        ({"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, InvalidValue, "stop"),
        (
            {"messages": MESSAGES, "response_format": {"type": "xml"}},
            InvalidValue,
            "response_format",
        ),
        (
            {"messages": MESSAGES, "tools": [{"type": "function"}]},
            InvalidValue,
            "tools.[0].function.name",
        ),
        ({"messages": MESSAGES, "max_tokens": 0}, InvalidValue, "max_tokens"),
    ],
)
def test_chat_params_refuse_what_the_engine_cannot_do(
    body: dict[str, Any], error: type[Exception], param: str
) -> None:
    with pytest.raises(error) as info:
        chat_params(body)
    assert getattr(info.value, "param", None) == param


def test_best_of_generates_best_of_and_returns_n() -> None:
    legacy = completion_params({"prompt": "x", "n": 2, "best_of": 4, "max_tokens": 5})
    assert (legacy.params.n, legacy.n, legacy.params.score) == (4, 2, True)
    with pytest.raises(InvalidValue):
        completion_params({"prompt": "x", "n": 3, "best_of": 2})
    with pytest.raises(InvalidValue):
        completion_params({"prompt": "x", "n": 1, "best_of": 2, "stream": True})


def test_choice_seeds_are_consecutive_and_never_the_random_sentinel() -> None:
    assert [choice_seed(10, i) for i in range(3)] == [10, 11, 12]
    assert choice_seed(0xFFFFFFFE, 1) != 0xFFFFFFFF
    assert choice_seed(0xFFFFFFFE, 2) == 0
    assert choice_seed(-1, 0) != 0xFFFFFFFF
