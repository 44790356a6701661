"""The ledger as FOCUS 1.2 (the FinOps Foundation's open cost and usage format):
``ncap ledger export --format focus``.

One row per attempt and charge: ``input`` (prompt tokens not served from the cache),
``cached_input`` and ``output`` tokens, each a ``Usage`` charge priced in USD. The
ledger's cost of the attempt (integer micro-USD) is split over its charges in
proportion to the route's configured prices, largest remainder first, so the charges
of an attempt add up to its ledger cost exactly (the ledger is the truth; prices may
have changed since, or a reconciliation file set the cost). An attempt whose cost is
known but whose tokens are not (a reconciliation file that gave only a cost) is one
``usage`` charge.

Attempts whose usage is not known yet (``pending``, ``usage_reconciliation_required``,
or still ``reserved``) are never priced at zero: they are left out unless
``--include-pending`` asks for them, and then their cost columns are empty (FOCUS
requires a cost, so such a file is not conformant until they are reconciled) and
``x_ncap_ReconciliationState`` says why. Denials generated nothing and have no row.

ncap's own dimensions are ``x_ncap_*`` columns (FOCUS's prefix for custom columns) and
the workload, environment and route are also in ``Tags``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

from ncap.config import Config, Pricing, Route
from ncap.domain.events import LedgerEvent

__all__ = ["FOCUS_COLUMNS", "FOCUS_VERSION", "focus_rows"]

FOCUS_VERSION = "1.2"

# FOCUS 1.2 columns, then ncap's own (x_ prefix)
_FOCUS = (
    "AvailabilityZone",
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingAccountType",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "CapacityReservationId",
    "CapacityReservationStatus",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "CommitmentDiscountCategory",
    "CommitmentDiscountId",
    "CommitmentDiscountName",
    "CommitmentDiscountQuantity",
    "CommitmentDiscountStatus",
    "CommitmentDiscountType",
    "CommitmentDiscountUnit",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "InvoiceId",
    "InvoiceIssuerName",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingCurrency",
    "PricingCurrencyContractedUnitPrice",
    "PricingCurrencyEffectiveCost",
    "PricingCurrencyListUnitPrice",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "RegionId",
    "RegionName",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "ServiceCategory",
    "ServiceName",
    "ServiceSubcategory",
    "SkuId",
    "SkuMeter",
    "SkuPriceDetails",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "SubAccountType",
    "Tags",
)
_NCAP = (
    "x_ncap_RequestId",
    "x_ncap_Attempt",
    "x_ncap_Charge",
    "x_ncap_Workload",
    "x_ncap_Environment",
    "x_ncap_Route",
    "x_ncap_ModelAlias",
    "x_ncap_UpstreamModel",
    "x_ncap_ProviderRequestId",
    "x_ncap_CandidatesRequested",
    "x_ncap_CandidatesEffective",
    "x_ncap_CandidatesReturned",
    "x_ncap_PolicyResult",
    "x_ncap_PolicyReason",
    "x_ncap_ExceptionId",
    "x_ncap_ReconciliationState",
    "x_ncap_ReconciliationReason",
    "x_ncap_CostMicros",
)
FOCUS_COLUMNS: tuple[str, ...] = _FOCUS + _NCAP

_PRICED_STATES = ("settled", "reconciled")
_UNKNOWN_STATES = ("reserved", "pending", "usage_reconciliation_required")
_PROVIDERS = {
    "openai": "OpenAI",
    "azure": "Microsoft",
    "anthropic": "Anthropic",
    "gemini": "Google",
    "local": "Self-hosted",
}
_SERVICES = {
    "openai": "OpenAI API",
    "azure": "Azure OpenAI",
    "anthropic": "Anthropic API",
    "gemini": "Gemini API",
    "local": "ncap local engine",
}
_METERS = {
    "input": "Input Tokens",
    "cached_input": "Cached Input Tokens",
    "output": "Output Tokens",
    "usage": "Tokens",
}
_MTOK = 1_000_000


@dataclass(frozen=True, slots=True)
class _Charge:
    kind: str  # input | cached_input | output | usage
    tokens: int | None
    price_per_mtok: float | None  # the configured list price, USD per million tokens
    micros: int | None  # None: not known yet (never zero for unknown)


def focus_rows(
    events: Iterator[LedgerEvent] | list[LedgerEvent],
    config: Config,
    *,
    include_pending: bool = False,
) -> Iterator[dict[str, str]]:
    """The FOCUS rows of ``events`` (empty strings for null cells)."""
    for event in events:
        if event.policy_result == "deny" or event.state == "denied":
            continue
        priced = event.state in _PRICED_STATES and event.cost_micros is not None
        if not priced and not (include_pending and event.state in _UNKNOWN_STATES):
            continue
        route = config.routes.get(event.route_id or "")
        for charge in _charges(event, route):
            yield _row(event, route, charge)


def _charges(event: LedgerEvent, route: Route | None) -> list[_Charge]:
    """The attempt's charges, their micro-USD adding up to the ledger's cost exactly."""
    if event.cost_micros is None:
        return [_Charge("usage", None, None, None)]
    inputs, output = event.input_tokens, event.output_tokens_total
    if inputs is None or output is None:
        return [_Charge("usage", event.total_tokens, None, event.cost_micros)]
    cached = min(event.cached_input_tokens or 0, inputs)
    pricing = route.pricing if route is not None else None
    prices = (
        (pricing.input_per_mtok, _cached_price(pricing), pricing.output_per_mtok)
        if pricing is not None
        else (None, None, None)
    )
    parts = [
        ("input", inputs - cached, prices[0]),
        ("cached_input", cached, prices[1]),
        ("output", output, prices[2]),
    ]
    parts = [p for p in parts if p[1] > 0 or p[0] != "cached_input"]
    weights = [tokens * (price if price is not None else 1.0) for _, tokens, price in parts]
    shares = _split(event.cost_micros, weights)
    return [
        _Charge(kind, tokens, price, share)
        for (kind, tokens, price), share in zip(parts, shares, strict=True)
    ]


def _cached_price(pricing: Pricing) -> float:
    cached = pricing.cached_input_per_mtok
    return cached if cached is not None else pricing.input_per_mtok


def _split(total: int, weights: list[float]) -> list[int]:
    """``total`` micro-USD in whole micros proportional to ``weights`` (largest
    remainder), summing to ``total`` exactly; all on the last part when no weight."""
    if not weights:
        return []
    whole = sum(weights)
    if whole <= 0:
        return [0] * (len(weights) - 1) + [total]
    exact = [total * w / whole for w in weights]
    shares = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True)
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    return shares


def _row(event: LedgerEvent, route: Route | None, charge: _Charge) -> dict[str, str]:
    provider = _provider_name(route)
    route_id = event.route_id or ""
    model = event.upstream_model or event.model_alias or ""
    cost = _usd(charge.micros)
    start = event.timestamp.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    month = start.replace(day=1, hour=0)
    tokens = charge.tokens
    row: dict[str, str | None] = {
        "BilledCost": cost,
        "BillingAccountId": "ncap",
        "BillingAccountName": "ncap",
        "BillingCurrency": "USD",
        "BillingPeriodStart": _stamp(month),
        "BillingPeriodEnd": _stamp(_next_month(month)),
        "ChargeCategory": "Usage",
        "ChargeDescription": f"{_METERS[charge.kind]} of {model} on route {route_id}",
        "ChargeFrequency": "Usage-Based",
        "ChargePeriodStart": _stamp(start),
        "ChargePeriodEnd": _stamp(start + timedelta(hours=1)),
        "ConsumedQuantity": _decimal(tokens),
        "ConsumedUnit": "Tokens" if tokens is not None else None,
        "ContractedCost": cost,
        "ContractedUnitPrice": _price(charge.price_per_mtok),
        "EffectiveCost": cost,
        "InvoiceIssuerName": provider,
        "ListCost": cost,
        "ListUnitPrice": _price(charge.price_per_mtok),
        "PricingCategory": "Standard",
        "PricingCurrency": "USD",
        "PricingCurrencyContractedUnitPrice": _price(charge.price_per_mtok),
        "PricingCurrencyEffectiveCost": cost,
        "PricingCurrencyListUnitPrice": _price(charge.price_per_mtok),
        "PricingQuantity": _mtok(tokens),
        "PricingUnit": "1M Tokens" if tokens is not None else None,
        "ProviderName": provider,
        "PublisherName": provider,
        "ResourceId": f"ncap:route/{route_id}" if route_id else None,
        "ResourceName": route_id or None,
        "ResourceType": "Model Route",
        "ServiceCategory": "AI and Machine Learning",
        "ServiceName": _SERVICES.get(route.provider, "Model API") if route else "Model API",
        "ServiceSubcategory": "Generative AI",
        "SkuId": f"{model}/{charge.kind}",
        "SkuMeter": _METERS[charge.kind],
        "SkuPriceId": f"{route_id}/{model}/{charge.kind}",
        "SubAccountId": event.workload_id,
        "SubAccountName": event.workload_id,
        "SubAccountType": "Workload",
        "Tags": json.dumps(
            {
                "ncap:workload": event.workload_id,
                "ncap:environment": event.environment,
                "ncap:route": route_id,
            },
            sort_keys=True,
        ),
        **_ncap_columns(event, charge),
    }
    return {name: row.get(name) or "" for name in FOCUS_COLUMNS}


def _ncap_columns(event: LedgerEvent, charge: _Charge) -> Mapping[str, str | None]:
    return {
        "x_ncap_RequestId": event.request_id,
        "x_ncap_Attempt": str(event.attempt),
        "x_ncap_Charge": charge.kind,
        "x_ncap_Workload": event.workload_id,
        "x_ncap_Environment": event.environment,
        "x_ncap_Route": event.route_id,
        "x_ncap_ModelAlias": event.model_alias,
        "x_ncap_UpstreamModel": event.upstream_model,
        "x_ncap_ProviderRequestId": event.provider_request_id,
        "x_ncap_CandidatesRequested": _text(event.requested_candidate_count),
        "x_ncap_CandidatesEffective": str(event.effective_candidate_count),
        "x_ncap_CandidatesReturned": _text(event.returned_candidate_count),
        "x_ncap_PolicyResult": event.policy_result,
        "x_ncap_PolicyReason": event.policy_reason,
        "x_ncap_ExceptionId": event.exception_id,
        "x_ncap_ReconciliationState": event.state,
        "x_ncap_ReconciliationReason": event.reconciliation_reason,
        "x_ncap_CostMicros": _text(charge.micros),
    }


def _provider_name(route: Route | None) -> str:
    """Who provides (and invoices) the tokens: the provider behind the route's kind; an
    OpenAI-compatible route elsewhere than OpenAI's API is named by its host."""
    if route is None:
        return "Unknown"
    if route.provider == "openai" and route.base_url:
        host = urlsplit(route.base_url).hostname or ""
        if host and not host.endswith("openai.com"):
            return host
    return _PROVIDERS.get(route.provider, route.provider)


def _usd(micros: int | None) -> str | None:
    if micros is None:
        return None
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), 1_000_000)
    return f"{sign}{whole}.{frac:06d}"


def _price(per_mtok: float | None) -> str | None:
    return None if per_mtok is None else f"{per_mtok:.6f}"


def _decimal(tokens: int | None) -> str | None:
    """A token count as a decimal (``12.0``: FOCUS quantities are decimals, and the
    validator reads a column of bare integers as integers, not decimals)."""
    return None if tokens is None else f"{tokens}.0"


def _mtok(tokens: int | None) -> str | None:
    if tokens is None:
        return None
    whole, frac = divmod(tokens, _MTOK)
    return f"{whole}.{frac:06d}"


def _text(value: int | None) -> str | None:
    return None if value is None else str(value)


def _stamp(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _next_month(month: datetime) -> datetime:
    return month.replace(year=month.year + month.month // 12, month=month.month % 12 + 1)
