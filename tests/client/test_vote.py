from __future__ import annotations

from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice

from ncap.client import Vote, answer_text, demux, tool_call_agreement, vote
from tests.client.chunks import INTERLEAVED


def prose(index: int, content: str | None) -> dict[str, Any]:
    message = {"role": "assistant", "content": content}
    return {"index": index, "message": message, "finish_reason": "stop"}


def calls(index: int, *names: str) -> dict[str, Any]:
    tool_calls = [
        {"id": f"call_{index}_{i}", "type": "function", "function": {"name": n, "arguments": "{}"}}
        for i, n in enumerate(names)
    ]
    message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
    return {"index": index, "message": message, "finish_reason": "tool_calls"}


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        (["42", " 42\n", "41", "42", "40"], Vote("42", 3, 5, 0.6, (0, 1, 3))),
        # a tie goes to the answer the lowest index gave
        (["b", "a", "a", "b"], Vote("b", 2, 4, 0.5, (0, 3))),
        (["x", "y", "z"], Vote("x", 1, 3, 1 / 3, (0,))),
        # no answer abstains but still counts in the total
        ([None, "", "7", None], Vote("7", 1, 4, 0.25, (2,))),
        ([None, "  "], Vote(None, 0, 2, 0.0)),
        ([], Vote(None, 0, 0, 0.0)),
    ],
)
def test_vote_on_dicts(answers: list[str | None], expected: Vote) -> None:
    assert vote([prose(i, a) for i, a in enumerate(answers)]) == expected


def test_tie_break_uses_the_choice_index_not_the_list_position() -> None:
    choices = [prose(3, "b"), prose(2, "a"), prose(0, "b"), prose(1, "a")]
    assert vote(choices) == Vote("b", 2, 4, 0.5, (0, 3))
    assert vote(list(reversed(choices))).winner == "b"


def test_vote_on_sdk_choices_and_buffers() -> None:
    sdk = [Choice.model_validate(prose(i, a)) for i, a in enumerate(["no", "yes", "yes"])]
    assert vote(sdk) == Vote("yes", 2, 3, 2 / 3, (1, 2))
    buffers = demux(INTERLEAVED).to_choices()  # prose, a tool call, prose
    assert vote(buffers) == Vote("Rain falls.", 1, 3, 1 / 3, (0,))


def test_vote_with_a_custom_key() -> None:
    choices = [prose(i, a) for i, a in enumerate(["Answer: 4", "answer: 4", "Answer: 5"])]

    def final_answer(choice: Any) -> str | None:
        text = answer_text(choice)
        return text.rsplit(":", 1)[-1].strip() if text else None

    result = vote(choices, key=final_answer)
    assert (result.winner, result.count, result.agreement) == ("4", 2, 2 / 3)


def test_answer_text_of_each_shape() -> None:
    assert answer_text(prose(0, "  hi ")) == "hi"
    assert answer_text({"index": 0, "text": " legacy "}) == "legacy"
    assert answer_text(calls(0, "f")) is None
    assert answer_text(Choice.model_validate(prose(0, "sdk"))) == "sdk"


def test_tool_call_agreement() -> None:
    choices = [
        calls(0, "get_weather"),
        calls(1, "get_weather", "get_weather"),  # one choice counts once per name
        calls(2, "get_time", "get_weather"),
        calls(3, "get_weather"),
        prose(4, "It is sunny."),
    ]
    assert tool_call_agreement(choices) == {"get_weather": 0.8, "get_time": 0.2, None: 0.2}
    assert list(tool_call_agreement(choices)) == ["get_weather", "get_time", None]


def test_tool_call_agreement_on_sdk_choices_buffers_and_nothing() -> None:
    sdk = [Choice.model_validate(c) for c in (calls(0, "f"), prose(1, "no"))]
    assert tool_call_agreement(sdk) == {"f": 0.5, None: 0.5}
    buffers = demux(INTERLEAVED).to_choices()
    assert tool_call_agreement(buffers) == {"get_weather": 1 / 3, "get_time": 1 / 3, None: 2 / 3}
    assert tool_call_agreement([prose(0, "a")]) == {None: 1.0}
    assert tool_call_agreement([]) == {}


def test_legacy_function_call_counts_as_a_tool_call() -> None:
    legacy = {"index": 0, "message": {"content": None, "function_call": {"name": "f"}}}
    assert tool_call_agreement([legacy, prose(1, "x")]) == {"f": 0.5, None: 0.5}
