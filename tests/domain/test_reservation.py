"""Reservation arithmetic, integer money, and the conservative input estimate."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ncap.config import Pricing
from ncap.domain.money import Prices, cost_micros, format_usd, micros_from_usd, to_decimal
from ncap.domain.reservation import (
    IMAGE_PART_TOKENS,
    Reservation,
    estimate_input_tokens,
    reservation_for,
)

PRICING = Pricing(input_per_mtok=0.15, cached_input_per_mtok=0.075, output_per_mtok=0.60)
FREE = Pricing()


def plan(**kw: Any) -> Reservation:
    args: dict[str, Any] = {
        "estimated_input_tokens": 100,
        "effective_n": 4,
        "per_candidate_ceiling": 512,
        "output_cap": "per_candidate",
        "candidates_mode": "native",
        "pricing": PRICING,
    }
    return reservation_for(**(args | kw))


@pytest.mark.parametrize(
    ("kw", "input_tokens", "output_tokens"),
    [
        ({}, 100, 4 * 512),
        ({"output_cap": "shared"}, 100, 512),
        ({"effective_n": 1}, 100, 512),
        ({"candidates_mode": "emulate"}, 4 * 100, 4 * 512),
        # an emulated fan-out is k single-candidate requests: shared does not apply
        ({"candidates_mode": "emulate", "output_cap": "shared"}, 4 * 100, 4 * 512),
        ({"estimated_input_tokens": 0, "effective_n": 16, "per_candidate_ceiling": 1}, 0, 16),
    ],
)
def test_reserved_tokens(kw: dict[str, Any], input_tokens: int, output_tokens: int) -> None:
    r = plan(**kw)
    assert (r.input_tokens, r.output_tokens) == (input_tokens, output_tokens)
    assert r.total_tokens == input_tokens + output_tokens


def test_reserved_cost_uses_route_prices_without_cache_discount() -> None:
    # 100 × 0.15 + 2048 × 0.60 = 15 + 1228.8 = 1243.8 micro-USD -> 1244
    assert plan().cost_micros == 1244
    assert plan(pricing=FREE).cost_micros == 0


@pytest.mark.parametrize(
    "kw",
    [{"effective_n": 0}, {"per_candidate_ceiling": 0}, {"estimated_input_tokens": -1}],
)
def test_reservation_rejects_nonsense(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        plan(**kw)


def test_reservation_is_frozen() -> None:
    with pytest.raises(AttributeError):
        plan().output_tokens = 1  # type: ignore[misc]


@given(
    n=st.integers(1, 16),
    ceiling=st.integers(1, 4096),
    estimate=st.integers(0, 50_000),
    mode=st.sampled_from(["native", "emulate"]),
    cap=st.sampled_from(["per_candidate", "shared"]),
    data=st.data(),
)
def test_any_usage_within_the_ceilings_costs_at_most_the_reservation(
    n: int, ceiling: int, estimate: int, mode: str, cap: str, data: st.DataObject
) -> None:
    """The reservation is the worst case: actual usage inside its bounds never exceeds it."""
    r = plan(
        estimated_input_tokens=estimate,
        effective_n=n,
        per_candidate_ceiling=ceiling,
        candidates_mode=mode,
        output_cap=cap,
    )
    used_in = data.draw(st.integers(0, r.input_tokens))
    cached = data.draw(st.integers(0, used_in))
    used_out = data.draw(st.integers(0, r.output_tokens))
    assert cost_micros(used_in, cached, used_out, PRICING) <= r.cost_micros


@given(n=st.integers(1, 15), ceiling=st.integers(1, 4095))
def test_reservation_grows_with_n_and_ceiling(n: int, ceiling: int) -> None:
    base = plan(effective_n=n, per_candidate_ceiling=ceiling)
    assert plan(effective_n=n + 1, per_candidate_ceiling=ceiling).cost_micros >= base.cost_micros
    assert plan(effective_n=n, per_candidate_ceiling=ceiling + 1).cost_micros >= base.cost_micros


# --- money ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "pricing", "expected"),
    [
        ((1, 0, 0), PRICING, 1),  # 0.15 rounds up, never down to 0
        ((1_000_000, 0, 0), PRICING, 150_000),  # exactly $0.15 per Mtok
        ((0, 0, 10), Pricing(output_per_mtok=0.7), 7),  # float 0.7 * 10 = 7.000000000000001
        ((1000, 400, 0), PRICING, 120),  # 600 × 0.15 + 400 × 0.075 = 90 + 30
        ((1000, 400, 0), Pricing(input_per_mtok=0.15), 150),  # no cached price: input price
        ((100, 500, 0), PRICING, 8),  # cached beyond input is clamped: 100 × 0.075 = 7.5 -> 8
        ((0, 0, 0), PRICING, 0),
        ((3, 0, 3), Pricing(input_per_mtok=0.1, output_per_mtok=0.2), 1),  # 0.9 -> 1
    ],
)
def test_cost_micros_is_exact_then_rounded_up(
    args: tuple[int, int, int], pricing: Pricing, expected: int
) -> None:
    assert cost_micros(*args, pricing) == expected
    assert cost_micros(*args, Prices.of(pricing)) == expected


def test_cost_micros_rejects_negative_counts() -> None:
    with pytest.raises(ValueError):
        cost_micros(-1, 0, 0, PRICING)


def test_money_conversions() -> None:
    assert to_decimal(0.1) == Decimal("0.1")
    assert Prices.of(PRICING) == Prices(Decimal("0.15"), Decimal("0.075"), Decimal("0.6"))
    assert micros_from_usd(25.0) == 25_000_000
    assert micros_from_usd(0.45) == 450_000
    assert micros_from_usd(0.0000019) == 1  # limits round down
    assert micros_from_usd(None) is None
    assert format_usd(12_345) == "$0.012345" and format_usd(-25_000_000) == "-$25.000000"
    assert isinstance(cost_micros(10, 0, 10, PRICING), int)


# --- input estimate --------------------------------------------------------------------


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def test_estimate_counts_utf8_bytes_plus_overheads() -> None:
    # hand-counted: 16 per request, 8 per message, the message's compact JSON bytes
    assert estimate_input_tokens([]) == 16
    # {"role":"user","content":"hello"} is 33 bytes
    assert estimate_input_tokens([user("hello")]) == 16 + 8 + 33
    # non-ASCII counts its UTF-8 bytes (3 per CJK character), not characters
    cjk = estimate_input_tokens([user("日本語")]) - estimate_input_tokens([user("")])
    assert cjk == 9


def test_estimate_grows_with_tools_and_response_format() -> None:
    base = estimate_input_tokens([user("hi")])
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    assert estimate_input_tokens([user("hi")], tools=[tool]) > base
    assert estimate_input_tokens([user("hi")], functions=[tool["function"]]) > base
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert estimate_input_tokens([user("hi")], response_format=fmt) > base


def test_estimate_counts_an_image_at_least_the_image_allowance() -> None:
    parts = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    ]
    text_only = estimate_input_tokens([user(parts[:1])])
    with_image = estimate_input_tokens([user(parts)])
    assert with_image - text_only >= IMAGE_PART_TOKENS


# the estimate against the real SmolLM2 tokenizer and chat template: tests/engine/
# test_input_estimate.py


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"])},
        optional={"content": _json_values, "name": st.text(max_size=10)},
    ),
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(_messages)
def test_estimate_is_each_message_counted_on_its_own(messages: list[dict[str, Any]]) -> None:
    # the messages are measured in one encode of the list; the count must be the sum
    # of each message's own compact JSON, image parts topped up, as the estimate says
    expected = 16
    for message in messages:
        expected += 8 + len(json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode())
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    size = len(json.dumps(part, separators=(",", ":"), ensure_ascii=False).encode())
                    expected += max(0, IMAGE_PART_TOKENS - size)
    assert estimate_input_tokens(messages) == expected


def test_estimate_tops_up_image_parts_among_several_messages() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    one = estimate_input_tokens([user("a"), user([image])])
    two = estimate_input_tokens([user([image]), user("a"), user([image])])
    assert two - one >= IMAGE_PART_TOKENS
