"""Money as integer micro-USD; floats never carry an amount.

Route prices are configured in USD per million tokens, so a price of ``p`` USD/Mtok
is exactly ``p`` micro-USD per token. Config floats are converted through ``str()``
into ``Decimal`` (``0.15`` becomes ``Decimal("0.15")``, not the binary float
``0.1499999…``), every product is exact, and a cost is rounded **up** to the next
whole micro-USD once, on the total: a reservation or a charge is never below the
exact price, and it is at most one micro-USD above it. Budget limits go the other
way (rounded **down**), so a limit never admits more than the operator wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal

from ncap.config import Pricing

__all__ = [
    "MICROS_PER_USD",
    "Prices",
    "cost_micros",
    "format_usd",
    "micros_from_usd",
    "to_decimal",
]

MICROS_PER_USD = 1_000_000


def to_decimal(value: float | int | str | Decimal) -> Decimal:
    """The decimal a human wrote: ``str()`` first so 0.1 stays 0.1."""
    if isinstance(value, Decimal):
        return value
    return Decimal(str(value))


def micros_from_usd(usd: float | int | str | Decimal | None) -> int | None:
    """A USD limit in whole micro-USD, rounded down (None stays None: no limit)."""
    if usd is None:
        return None
    return int((to_decimal(usd) * MICROS_PER_USD).to_integral_value(rounding=ROUND_FLOOR))


def format_usd(micros: int) -> str:
    """``12_345`` -> ``$0.012345``: exact, for messages and reports."""
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), MICROS_PER_USD)
    return f"{sign}${whole}.{frac:06d}"


@dataclass(frozen=True, slots=True)
class Prices:
    """Micro-USD per token (numerically equal to USD per million tokens)."""

    input: Decimal
    cached_input: Decimal
    output: Decimal
    cache_write: Decimal | None = None  # None: the input price

    @classmethod
    def of(cls, pricing: Pricing) -> Prices:
        """Cached and cache-written tokens fall back to the input price when the route
        sets none."""
        cached = pricing.cached_input_per_mtok
        written = pricing.cache_write_input_per_mtok
        return cls(
            input=to_decimal(pricing.input_per_mtok),
            cached_input=to_decimal(cached if cached is not None else pricing.input_per_mtok),
            output=to_decimal(pricing.output_per_mtok),
            cache_write=to_decimal(written) if written is not None else None,
        )


@dataclass(frozen=True, slots=True)
class _Scaled:
    """Prices as integers over one power of ten: ``price = value / scale`` exactly, so
    a cost is integer arithmetic (and the same exact, rounded-up result as Decimal's)."""

    input: int
    cached_input: int
    output: int
    scale: int
    cache_write: int

    @classmethod
    def of(cls, prices: Prices) -> _Scaled:
        written = prices.cache_write if prices.cache_write is not None else prices.input
        values = (prices.input, prices.cached_input, prices.output, written)
        digits = max(0, *(-_exponent(p) for p in values))
        scale = 10**digits
        return cls(
            input=int(prices.input * scale),
            cached_input=int(prices.cached_input * scale),
            output=int(prices.output * scale),
            scale=scale,
            cache_write=int(written * scale),
        )


def _exponent(value: Decimal) -> int:
    exponent = value.normalize().as_tuple().exponent
    return exponent if isinstance(exponent, int) else 0


# route prices are frozen config objects that live as long as the process: keyed by
# identity (hashing a pydantic model costs more than the arithmetic), the object kept
# alive beside its entry so an id is never reused while cached
_SCALED: dict[int, tuple[Pricing | Prices, _Scaled]] = {}


def _scaled(pricing: Pricing | Prices) -> _Scaled:
    entry = _SCALED.get(id(pricing))
    if entry is not None and entry[0] is pricing:
        return entry[1]
    prices = pricing if isinstance(pricing, Prices) else Prices.of(pricing)
    scaled = _Scaled.of(prices)
    if len(_SCALED) < 1024:
        _SCALED[id(pricing)] = (pricing, scaled)
    return scaled


def cost_micros(
    input_tokens: int,
    cached_input_tokens: int,
    output_tokens: int,
    pricing: Pricing | Prices,
    cache_written_tokens: int = 0,
) -> int:
    """Exact cost rounded up to a whole micro-USD.

    ``input_tokens`` includes the cached and the cache-written ones (as OpenAI's
    ``prompt_tokens`` does); each is priced at its own rate, and counts beyond the input
    are treated as input, never as negative.
    """
    if min(input_tokens, cached_input_tokens, output_tokens, cache_written_tokens) < 0:
        raise ValueError("token counts cannot be negative")
    p = _scaled(pricing)
    cached = min(cached_input_tokens, input_tokens)
    written = min(cache_written_tokens, input_tokens - cached)
    plain = input_tokens - cached - written
    exact = (
        plain * p.input
        + cached * p.cached_input
        + written * p.cache_write
        + output_tokens * p.output
    )
    return -(-exact // p.scale)  # rounded up: never below the exact price
