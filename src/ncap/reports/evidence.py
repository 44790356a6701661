"""The report's candidate evidence: how different the candidates of each workload and
exception were, what the duplicates cost, and what other candidate counts would have.

One read of the window's allowed rows of multi-candidate requests, summed per request
here (an emulated fan-out has a row per branch; its evidence is on the first). Per
(workload, exception), over the requests that carry evidence:

- ``distinct_share_mean``: the mean of distinct / compared; ``agreement_mean`` and
  ``agreement``: the majority share (largest identical group / compared), its mean and
  its distribution in four bins; ``tool_call_share_mean`` likewise;
- ``duplicate_output_share``: of the output tokens of requests whose usage is known,
  the share spent on duplicates, estimated as output × (compared − distinct) /
  compared per request (each duplicate costs the request's mean candidate; identical
  candidates are the same length, so the estimate errs only by how far the duplicated
  answer's length is from the mean);
- ``what_if``: cost(n) for n = 1 … the most candidates seen, from each request's
  measured prompt P and mean completion C at its route's prices: P·rate_in + n·C·rate_out,
  and n·P·rate_in + n·C·rate_out on an emulated route (each branch pays its prompt).
  Summed over the requests whose usage and prices are known, in micro-USD, against
  ``spent_micros``, what they cost (cached-input discounts are in what they cost, not in
  the what-if). ``saving_at_one_micros`` is spent − cost(1);
- ``native_equivalent_micros``: what the emulated requests would have cost on a native
  route (one prompt each), beside ``emulated_spent_micros``.

``duplicate_alerts`` turns a group whose mean distinct share is below
``reports.thresholds.candidates_distinct_share`` over at least
``candidates_min_requests`` requests into a "candidates mostly duplicate" alert naming
the workload, the exception and what to do.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ncap.config import Pricing, Thresholds
from ncap.domain.money import format_usd
from ncap.errors import ConfigError
from ncap.reports.model import Alert, CandidateEvidence, Window
from ncap.reports.source import LedgerSource

__all__ = ["AGREEMENT_BINS", "candidate_evidence", "duplicate_alerts"]

_SQL = (
    "SELECT request_id, workload_id, exception_id, route_id, returned_candidate_count,"
    " input_tokens, output_tokens_total, cost_micros, state, candidates_compared,"
    " candidates_distinct, candidates_majority, candidates_tool_calls FROM {scan}"
    " WHERE timestamp >= ? AND timestamp < ? AND effective_candidate_count > 1"
    " AND policy_result = 'allow'"
)
# the majority share's bins, as their labels: all the same, most, half or more, split
AGREEMENT_BINS = ("1.0", "0.75-1.0", "0.5-0.75", "<0.5")
_BILLED = ("settled", "reconciled")


@dataclass(slots=True)
class _Request:
    workload_id: str = ""
    exception_id: str | None = None
    route_id: str | None = None
    answered_rows: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_micros: int = 0
    usage_known: bool = True
    evidence: tuple[int, int, int, int] | None = None  # compared, distinct, majority, tools

    @property
    def emulated(self) -> bool:
        return self.answered_rows > 1  # a branch per candidate, each its own answer


@dataclass(slots=True)
class _Group:
    requests: list[_Request] = field(default_factory=list)


def candidate_evidence(
    source: LedgerSource, window: Window, pricing: Mapping[str, Pricing] | None = None
) -> list[CandidateEvidence]:
    """One row per (workload, exception) with evidence in ``window``, sorted."""
    span = (source.stamp(window.start), source.stamp(window.end))
    try:
        rows = source.query(_SQL.format(scan=source.scan(*span)), span)
    except ConfigError:
        return []  # a ledger from before the evidence columns
    groups: dict[tuple[str, str | None], _Group] = defaultdict(_Group)
    for request in _requests(rows).values():
        if request.evidence is not None:
            groups[(request.workload_id, request.exception_id)].requests.append(request)
    prices = pricing or {}
    return [
        _row(workload, exception, group.requests, prices)
        for (workload, exception), group in sorted(groups.items(), key=lambda kv: _key(kv[0]))
    ]


def _key(key: tuple[str, str | None]) -> tuple[str, str]:
    return key[0], key[1] or ""


def _requests(rows: Iterable[Sequence[Any]]) -> dict[str, _Request]:
    found: dict[str, _Request] = defaultdict(_Request)
    for row in rows:
        (rid, workload, exception, route, returned, inp, out, cost, state, *evidence) = row
        r = found[str(rid)]
        r.workload_id, r.exception_id = str(workload), exception
        if returned:
            r.answered_rows += 1
        if state in _BILLED and inp is not None and out is not None and cost is not None:
            r.input_tokens += int(inp)
            r.output_tokens += int(out)
            r.cost_micros += int(cost)
        elif returned:
            r.usage_known = False  # an answered row without usage: the sums are partial
        if evidence[0] is not None:
            r.evidence = (int(evidence[0]), int(evidence[1]), int(evidence[2]), int(evidence[3]))
            r.route_id = route
    return found


def _row(
    workload: str,
    exception: str | None,
    requests: list[_Request],
    prices: Mapping[str, Pricing],
) -> CandidateEvidence:
    shares = [(d / k, m / k, t / k) for k, d, m, t in (r.evidence for r in requests if r.evidence)]
    count = len(requests)
    billed = [r for r in requests if r.usage_known and r.output_tokens + r.input_tokens > 0]
    output = sum(r.output_tokens for r in billed)
    duplicate = sum(_duplicate_tokens(r) for r in billed)
    priced = [
        (r, prices[r.route_id]) for r in billed if r.route_id is not None and r.route_id in prices
    ]
    most = max(r.evidence[0] for r in requests if r.evidence)
    what_if = {n: round(sum(_cost(r, p, n) for r, p in priced)) for n in range(1, most + 1)}
    spent = sum(r.cost_micros for r, _ in priced)
    emulated = [(r, p) for r, p in priced if r.emulated]
    return CandidateEvidence(
        workload_id=workload,
        exception_id=exception,
        requests=count,
        candidates=sum(r.evidence[0] for r in requests if r.evidence),
        distinct_share_mean=round(sum(s[0] for s in shares) / count, 4),
        agreement_mean=round(sum(s[1] for s in shares) / count, 4),
        agreement=_bins(s[1] for s in shares),
        tool_call_share_mean=round(sum(s[2] for s in shares) / count, 4),
        duplicate_output_share=round(duplicate / output, 4) if output else None,
        priced_requests=len(priced),
        spent_micros=spent,
        what_if=what_if,
        saving_at_one_micros=spent - what_if[1] if priced else None,
        emulated_requests=len(emulated),
        emulated_spent_micros=sum(r.cost_micros for r, _ in emulated) if emulated else None,
        native_equivalent_micros=(
            round(sum(_native(r, p) for r, p in emulated)) if emulated else None
        ),
    )


def _duplicate_tokens(r: _Request) -> float:
    assert r.evidence is not None
    compared, distinct = r.evidence[0], r.evidence[1]
    return r.output_tokens * (compared - distinct) / compared


def _prompt_and_completion(r: _Request) -> tuple[float, float]:
    """P, the prompt of one request (an emulated request paid it once per branch), and
    C, its mean completion per candidate."""
    assert r.evidence is not None
    compared = r.evidence[0]
    prompt = r.input_tokens / (r.answered_rows if r.emulated else 1)
    return prompt, r.output_tokens / compared


def _cost(r: _Request, price: Pricing, n: int) -> float:
    """This request at n candidates on its own kind of route, in micro-USD (a price per
    million tokens in USD is micro-USD per token)."""
    prompt, completion = _prompt_and_completion(r)
    prompts = n if r.emulated else 1
    return prompts * prompt * price.input_per_mtok + n * completion * price.output_per_mtok


def _native(r: _Request, price: Pricing) -> float:
    """An emulated request's candidates from one native request (one prompt)."""
    assert r.evidence is not None
    prompt, completion = _prompt_and_completion(r)
    return prompt * price.input_per_mtok + r.evidence[0] * completion * price.output_per_mtok


def _bins(agreements: Iterable[float]) -> dict[str, int]:
    out = dict.fromkeys(AGREEMENT_BINS, 0)
    for a in agreements:
        if a >= 1.0:
            out["1.0"] += 1
        elif a >= 0.75:
            out["0.75-1.0"] += 1
        elif a >= 0.5:
            out["0.5-0.75"] += 1
        else:
            out["<0.5"] += 1
    return out


def duplicate_alerts(rows: Sequence[CandidateEvidence], thresholds: Thresholds) -> list[Alert]:
    """ "Candidates mostly duplicate": a group's mean distinct share strictly below the
    threshold, over at least the minimum number of requests."""
    limit = thresholds.candidates_distinct_share
    if limit is None:
        return []
    out = []
    for row in rows:
        if row.requests < thresholds.candidates_min_requests or row.distinct_share_mean >= limit:
            continue
        out.append(
            Alert(
                source="candidates",
                severity="warning",
                code="candidates_mostly_duplicate",
                message=_message(row, limit),
                value=row.distinct_share_mean,
                threshold=limit,
            )
        )
    return out


def _message(row: CandidateEvidence, limit: float) -> str:
    who = f"workload {row.workload_id}"
    who += f", exception {row.exception_id}" if row.exception_id else " (no exception)"
    action = "lower n, raise the temperature"
    action += ", or revoke the exception" if row.exception_id else ""
    saving = ""
    if row.saving_at_one_micros is not None and row.saving_at_one_micros > 0:
        saving = f"; at n=1 it would have cost {format_usd(row.saving_at_one_micros)} less"
    return (
        f"candidates mostly duplicate: {who}: {row.distinct_share_mean:.2f} distinct per "
        f"returned candidate on average (below {limit:.2f}) over {row.requests} requests"
        f"{saving}: {action}"
    )
