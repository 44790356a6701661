"""``cost_micros`` in integer arithmetic equals the exact Decimal price rounded up, for
any route prices a config can hold and any token counts."""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from ncap.config import Pricing
from ncap.domain.money import Prices, cost_micros

_price = st.decimals(min_value=0, max_value=1000, places=6, allow_nan=False).map(float)
_tokens = st.integers(min_value=0, max_value=2**40)


def _reference(inp: int, cached: int, out: int, pricing: Pricing) -> int:
    prices = Prices.of(pricing)
    cached = min(cached, inp)
    exact = (inp - cached) * prices.input + cached * prices.cached_input + out * prices.output
    return int(exact.to_integral_value(rounding=ROUND_CEILING))


@settings(max_examples=400, deadline=None)
@given(_price, st.none() | _price, _price, _tokens, _tokens, _tokens)
def test_integer_cost_equals_the_decimal_reference(
    pin: float, pcached: float | None, pout: float, inp: int, cached: int, out: int
) -> None:
    pricing = Pricing(input_per_mtok=pin, cached_input_per_mtok=pcached, output_per_mtok=pout)
    expected = _reference(inp, cached, out, pricing)
    assert cost_micros(inp, cached, out, pricing) == expected
    # the same object again (cached by identity) and ready Prices give the same answer
    assert cost_micros(inp, cached, out, pricing) == expected
    assert cost_micros(inp, cached, out, Prices.of(pricing)) == expected


def test_a_cost_is_rounded_up_once_on_the_total() -> None:
    pricing = Pricing(input_per_mtok=0.15, output_per_mtok=0.6)
    assert cost_micros(1, 0, 0, pricing) == 1  # 0.15 micro-USD rounds up to 1
    assert cost_micros(10, 0, 0, pricing) == 2  # 1.5 → 2
    assert cost_micros(20, 0, 0, pricing) == 3  # exactly 3
    assert Decimal("0.15") * 20 == 3
