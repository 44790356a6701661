"""The report's cost-per-choice section, from ``output_tokens_per_choice``.

One read of the window's attempts that carry per-choice counts (a few: only routes that
reveal them write the column), parsed and summed here, so the SQL stays portable (the
column is plain text, "12,40,7"). A ledger file from before the column has no such
rows: the section is empty.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping

from ncap.config import Pricing
from ncap.errors import ConfigError
from ncap.reports.model import ChoiceCost, Window
from ncap.reports.source import LedgerSource

__all__ = ["choice_costs"]

_SQL = (
    "SELECT route_id, output_tokens_per_choice, cost_micros FROM {scan}"
    " WHERE timestamp >= ? AND timestamp < ? AND output_tokens_per_choice IS NOT NULL"
    " AND cost_micros IS NOT NULL AND state IN ('settled', 'reconciled')"
)


def choice_costs(
    source: LedgerSource, window: Window, pricing: Mapping[str, Pricing] | None = None
) -> list[ChoiceCost]:
    span = (source.stamp(window.start), source.stamp(window.end))
    try:
        rows = source.query(_SQL.format(scan=source.per_choice_scan(*span)), span)
    except ConfigError:
        return []  # a ledger without the column
    tokens: dict[str | None, list[int]] = defaultdict(list)
    costs: dict[str | None, list[int]] = defaultdict(lambda: [0, 0])  # cost, attempts
    for route_id, text, cost in rows:
        counts = [int(t) for t in str(text).split(",") if t != ""]
        if not counts:
            continue
        tokens[route_id].extend(counts)
        costs[route_id][0] += int(cost)
        costs[route_id][1] += 1
    prices = pricing or {}
    out = []
    for rid in sorted(tokens, key=lambda r: r or ""):
        cost, attempts = costs[rid]
        out.append(_row(rid, sorted(tokens[rid]), cost, attempts, prices.get(rid or "")))
    return out


def _row(
    route_id: str | None, ordered: list[int], cost: int, attempts: int, price: Pricing | None
) -> ChoiceCost:
    n = len(ordered)
    p95 = _rank(ordered, 0.95)
    out_cost = p95 * price.output_per_mtok if price is not None and p95 is not None else None
    return ChoiceCost(
        route_id=route_id,
        attempts=attempts,
        choices=n,
        tokens_mean=round(sum(ordered) / n, 3) if n else None,
        tokens_p50=_rank(ordered, 0.50),
        tokens_p95=p95,
        tokens_max=ordered[-1] if n else None,
        cost_per_choice_micros=round(cost / n, 3) if n else None,
        output_cost_p95_micros=round(out_cost, 3) if out_cost is not None else None,
    )


def _rank(ordered: list[int], p: float) -> int | None:
    """Nearest rank (``ceil(p·N)``), as for the per-request percentiles."""
    if not ordered:
        return None
    k = max(1, math.ceil(p * len(ordered)))
    return ordered[min(k, len(ordered)) - 1]
