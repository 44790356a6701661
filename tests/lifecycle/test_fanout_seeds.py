"""Fan-out branches draw independently: the client's seed s is s + i on branch i."""

from __future__ import annotations

from typing import Any

import pytest

from ncap.lifecycle.fanout import branch_body, cache_breakpoint

BODY: dict[str, Any] = {"model": "m", "messages": [], "seed": 7}


def test_branch_seeds_are_consecutive() -> None:
    assert [branch_body(BODY, i)["seed"] for i in range(4)] == [7, 8, 9, 10]
    assert BODY["seed"] == 7  # the request's own body is not changed


def test_branch_zero_and_seedless_bodies_are_the_same_object() -> None:
    assert branch_body(BODY, 0) is BODY
    seedless = {"model": "m", "messages": []}
    assert branch_body(seedless, 3) is seedless


@pytest.mark.parametrize(
    ("seed", "index", "sent"),
    [(2**63 - 1, 1, -(2**63)), (2**63 - 2, 3, -(2**63) + 1), (-5, 2, -3)],
)
def test_branch_seed_wraps_within_64_bits(seed: int, index: int, sent: int) -> None:
    assert branch_body({"seed": seed}, index)["seed"] == sent


MARK = {"mode": "explicit"}


def _text(text: str, marked: bool = False) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "text", "text": text}
    if marked:
        part["prompt_cache_breakpoint"] = MARK
    return part


@pytest.mark.parametrize(
    ("last", "marked"),
    [
        ({"role": "user", "content": "hi"}, {"role": "user", "content": [_text("hi", True)]}),
        (
            {"role": "user", "content": [_text("a"), _text("b")]},
            {"role": "user", "content": [_text("a"), _text("b", True)]},
        ),
        (
            {"role": "tool", "tool_call_id": "c", "content": "rain"},
            {"role": "tool", "tool_call_id": "c", "content": [_text("rain", True)]},
        ),
    ],
)
def test_the_prompts_last_part_gets_a_cache_breakpoint(last: Any, marked: Any) -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, last]}
    out = cache_breakpoint(body)
    assert out["messages"] == [{"role": "system", "content": "s"}, marked]
    assert body["messages"][1] == last  # the request's own body is not changed


def test_a_message_without_a_markable_part_is_left_alone() -> None:
    calls = {"role": "assistant", "content": None, "tool_calls": []}
    body = {"model": "m", "messages": [calls]}
    assert cache_breakpoint(body) is body
