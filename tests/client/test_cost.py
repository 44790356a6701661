from __future__ import annotations

from decimal import Decimal

import pytest

from ncap.client import cost, saving
from ncap.config import Pricing
from ncap.domain.money import Prices

# seed 000's worked example: a 1,200-token prompt, 400-token completions, n = 5
P, C, N = 1200, 400, 5
GPT_4O_MINI = Pricing(input_per_mtok=0.15, output_per_mtok=0.60)  # micro-USD per token


@pytest.mark.parametrize(
    "prices",
    [
        GPT_4O_MINI,
        {"input_per_mtok": 0.15, "output_per_mtok": 0.60},
        Prices.of(GPT_4O_MINI),
    ],
)
def test_worked_example(prices: Pricing | Prices | dict[str, float]) -> None:
    # billed 1,200 in and 2,000 out: 1200 × 0.15 + 5 × 400 × 0.60 micro-USD
    assert cost(P, C, N, prices) == 180 + 1200
    assert cost(P, C, 1, prices) == 180 + 240
    # the saving is exactly the 4 × 1,200 = 4,800 input tokens not paid again
    assert saving(P, C, N, prices) == 4 * 1200 * Decimal("0.15") == 720
    assert saving(P, C, N, prices) == N * cost(P, C, 1, prices) - cost(P, C, N, prices)


def test_n_of_one_saves_nothing_and_output_is_linear_in_n() -> None:
    assert saving(P, C, 1, GPT_4O_MINI) == 0
    steps = [cost(P, C, n, GPT_4O_MINI) - cost(P, C, n - 1, GPT_4O_MINI) for n in range(2, 9)]
    assert set(steps) == {240}


def test_amounts_are_exact_integers_rounded_against_flattery() -> None:
    prices = {"input_per_mtok": "0.1", "output_per_mtok": 0.3}  # exact decimals, not floats
    assert cost(1, 1, 1, prices) == 1  # 0.4 µ$ rounds up
    assert saving(3, 1, 2, prices) == 0  # 0.3 µ$ rounds down
    assert cost(10, 0.5, 3, prices) == 2  # 1.0 + 0.45 µ$, a fractional average allowed
    assert isinstance(cost(P, C, N, GPT_4O_MINI), int)


def test_cached_input_price_is_not_applied() -> None:
    cached = Pricing(input_per_mtok=2.5, cached_input_per_mtok=1.25, output_per_mtok=10)
    assert cost(1000, 100, 2, cached) == 2500 + 2000


@pytest.mark.parametrize(("p", "c", "n"), [(-1, 1, 1), (1, -0.5, 1), (1, 1, 0)])
def test_invalid_inputs(p: int, c: float, n: int) -> None:
    with pytest.raises(ValueError):
        cost(p, c, n, GPT_4O_MINI)
    with pytest.raises(ValueError):
        saving(p, c, n, GPT_4O_MINI)


def test_invalid_prices() -> None:
    with pytest.raises(ValueError):
        cost(1, 1, 1, {"input_per_mtok": -1, "output_per_mtok": 1})
    with pytest.raises(ValueError):
        cost(1, 1, 1, {"input_usd": 1})
    with pytest.raises(TypeError):
        cost(1, 1, 1, 0.15)  # type: ignore[arg-type]
