"""What one ``n``-request costs, and what it saves over n separate requests (seed ``000``).

    cost(n)   = P × rate_in + n × C × rate_out
    saving(n) = n × cost(1) − cost(n) = (n − 1) × P × rate_in

P is the prompt tokens (billed once: one prefill), C the average completion length
(billed n times). Amounts are integer micro-USD, computed exactly in ``Decimal`` with
the gateway's own money rules (``ncap.domain.money``): a cost rounds up, a saving
rounds down, so neither is ever flattering. Cached-input discounts are not modelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

from ncap.config import Pricing
from ncap.domain.money import Prices, to_decimal

__all__ = ["PriceSpec", "cost", "saving"]

PriceSpec = Pricing | Prices | Mapping[str, Any]
Number = int | float | Decimal


def cost(prompt_tokens: int, completion_tokens_avg: Number, n: int, prices: PriceSpec) -> int:
    """Micro-USD for one request with ``n`` candidates (prices in USD per million tokens)."""
    p = _prices(prices)
    completion = _check(prompt_tokens, completion_tokens_avg, n)
    exact = prompt_tokens * p.input + n * completion * p.output
    return int(exact.to_integral_value(rounding=ROUND_CEILING))


def saving(prompt_tokens: int, completion_tokens_avg: Number, n: int, prices: PriceSpec) -> int:
    """Micro-USD saved by one ``n``-request over n single ones: n − 1 prompts not paid."""
    p = _prices(prices)
    _check(prompt_tokens, completion_tokens_avg, n)
    exact = (n - 1) * prompt_tokens * p.input
    return int(exact.to_integral_value(rounding=ROUND_FLOOR))


def _prices(prices: PriceSpec) -> Prices:
    """A route's ``Pricing``, ready ``Prices``, or a mapping with the same field names."""
    if isinstance(prices, Prices):
        return prices
    if isinstance(prices, Pricing):
        return Prices.of(prices)
    if isinstance(prices, Mapping):
        return Prices.of(Pricing.model_validate(dict(prices)))
    raise TypeError(f"prices must be Pricing, Prices or a mapping, not {type(prices).__name__}")


def _check(prompt_tokens: int, completion_tokens_avg: Number, n: int) -> Decimal:
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    completion = to_decimal(completion_tokens_avg)
    if prompt_tokens < 0 or completion < 0:
        raise ValueError("token counts cannot be negative")
    return completion
