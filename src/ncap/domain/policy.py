"""The candidate-count policy of a workload (docs/configuration.md), decided before dispatch.

``decide()`` is pure: the clock is a parameter, so an exception that expires between
two requests is a test with two timestamps. A denial is returned, never raised, so
the caller can write the ``policy_result=deny`` ledger event before it raises
``decision.error``.

Rules, in the order they are checked (the first failure is the reason):

1. ``requested`` is the body's ``n`` (a legacy request's ``best_of`` when it sets one;
   None when omitted); ``effective`` is it or 1. A count refusal names that field.
2. The approved maximum is the workload's ``max_candidates``, raised only by the most
   permissive exception for that workload that has not expired at ``now``; the
   global ``max_candidates_absolute`` bounds workloads and exceptions alike.
   An exception is *engaged* (its id recorded, its output ceiling and budget in
   force) only when the effective count needs more than the workload's default.
3. ``effective > maximum`` -> ``candidate_count_exceeds_policy``.
4. ``n > 1`` with ``temperature == 0`` -> ``candidates_with_greedy_sampling`` when the
   workload's ``greedy_candidates`` is ``reject``.
5. A request ceiling (``max_completion_tokens`` / ``max_tokens``) above the policy
   ceiling -> ``output_ceiling_exceeds_policy``; never clamped. With none, the policy
   ceiling is what the gateway sends upstream.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Literal

import msgspec

from ncap.config import ExceptionGrant, Limits, Workload
from ncap.errors import (
    CandidateCountExceedsPolicy,
    CandidatesWithGreedySampling,
    OutputCeilingExceedsPolicy,
    PolicyDenied,
    Refusal,
)

__all__ = ["CeilingParam", "Decision", "active_exceptions", "decide"]

CeilingParam = Literal["max_completion_tokens", "max_tokens"]


class Decision(msgspec.Struct, frozen=True):
    """Everything the lifecycle and the ledger need from the policy step."""

    requested: int | None
    effective: int
    max_allowed: int
    exception_id: str | None
    per_candidate_ceiling: int
    ceiling_from_request: bool
    # the request field that set the ceiling; None when the gateway must send one
    ceiling_param: CeilingParam | None
    policy_result: Literal["allow", "deny"]
    policy_reason: str
    error: PolicyDenied | None

    @property
    def allowed(self) -> bool:
        return self.policy_result == "allow"


def active_exceptions(
    workload_id: str, exceptions: Iterable[ExceptionGrant], now: datetime
) -> list[ExceptionGrant]:
    """The workload's exceptions still in force at ``now``, most permissive first.

    Ties are broken by the later expiry, then the id, so the choice is deterministic.
    """
    live = [e for e in exceptions if e.workload == workload_id and now < e.expires]
    return sorted(live, key=lambda e: (-e.max_candidates, -e.expires.timestamp(), e.id))


def decide(
    *,
    workload_id: str,
    workload: Workload,
    exceptions: Iterable[ExceptionGrant],
    limits: Limits,
    requested: int | None,
    temperature: float | None,
    max_completion_tokens: int | None,
    max_tokens: int | None,
    now: datetime,
    count_param: str = "n",
) -> Decision:
    """Apply the candidate-count policy to one request; see the module docstring for the rule order.

    ``count_param`` is the request field ``requested`` came from, which a count refusal
    names (``n``, or a legacy request's ``best_of``)."""
    effective = requested if requested is not None else 1
    grant = _best_grant(workload_id, workload, exceptions, now)
    cap = limits.max_candidates_absolute
    max_allowed = min(cap, max(workload.max_candidates, grant.max_candidates if grant else 0))
    engaged = grant if grant is not None and effective > workload.max_candidates else None
    policy_ceiling = _policy_ceiling(workload, engaged)
    ceiling, param = _request_ceiling(max_completion_tokens, max_tokens)
    error = (
        _count_error(workload_id, effective, max_allowed, cap, count_param)
        or _greedy_error(workload_id, workload, effective, temperature, count_param)
        or _ceiling_error(workload_id, policy_ceiling, max_completion_tokens, max_tokens)
    )
    if error is not None:
        reason = str(error.code)
    else:
        reason = "within_exception" if engaged else "within_default"
    return Decision(
        requested=requested,
        effective=effective,
        max_allowed=max_allowed,
        exception_id=engaged.id if engaged else None,
        per_candidate_ceiling=ceiling if ceiling is not None else policy_ceiling,
        ceiling_from_request=ceiling is not None,
        ceiling_param=param,
        policy_result="deny" if error else "allow",
        policy_reason=reason,
        error=error,
    )


def _best_grant(
    workload_id: str, workload: Workload, exceptions: Iterable[ExceptionGrant], now: datetime
) -> ExceptionGrant | None:
    """The most permissive live exception, if it actually raises the workload's maximum."""
    live = active_exceptions(workload_id, exceptions, now)
    if live and live[0].max_candidates > workload.max_candidates:
        return live[0]
    return None


def _policy_ceiling(workload: Workload, grant: ExceptionGrant | None) -> int:
    if grant is not None and grant.output_ceiling is not None:
        return grant.output_ceiling
    return workload.output_ceiling


def _request_ceiling(
    max_completion_tokens: int | None, max_tokens: int | None
) -> tuple[int | None, CeilingParam | None]:
    """The request's per-candidate ceiling; with both fields set, the larger one
    (an upstream may honour either, and a reservation must not be short)."""
    if max_completion_tokens is not None and max_tokens is not None:
        return max(max_completion_tokens, max_tokens), "max_completion_tokens"
    if max_completion_tokens is not None:
        return max_completion_tokens, "max_completion_tokens"
    if max_tokens is not None:
        return max_tokens, "max_tokens"
    return None, None


def _count_error(
    workload_id: str, effective: int, max_allowed: int, cap: int, param: str
) -> PolicyDenied | None:
    if effective <= max_allowed:
        return None
    hard = ""
    if effective > cap:
        hard = f" The gateway's hard cap is {cap}; no exception can exceed it."
    return CandidateCountExceedsPolicy(
        f"{param}={effective} exceeds the approved maximum of {max_allowed} candidate(s) for "
        f"workload '{workload_id}'. Send {param} <= {max_allowed}, or ask the gateway operator "
        "for a reviewed candidate-count exception for this workload (owner, maximum, "
        f"output ceiling, budget and expiry).{hard} Do not retry this request unchanged.",
        param=param,
        refusal=Refusal("max_candidates", max_allowed, effective),
    )


def _greedy_error(
    workload_id: str, workload: Workload, effective: int, temperature: float | None, param: str
) -> PolicyDenied | None:
    if effective <= 1 or temperature != 0 or workload.greedy_candidates == "allow":
        return None
    return CandidatesWithGreedySampling(
        f"{param}={effective} with temperature 0 asks for {effective} copies of the same "
        f"greedy answer at {effective} times the output cost; workload '{workload_id}' "
        f"rejects this. Use {param}=1, or a temperature above 0.",
        param=param,
    )


def _ceiling_error(
    workload_id: str,
    policy_ceiling: int,
    max_completion_tokens: int | None,
    max_tokens: int | None,
) -> PolicyDenied | None:
    fields: tuple[tuple[CeilingParam, int | None], ...] = (
        ("max_completion_tokens", max_completion_tokens),
        ("max_tokens", max_tokens),
    )
    for name, value in fields:
        if value is not None and value > policy_ceiling:
            return OutputCeilingExceedsPolicy(
                f"{name}={value} exceeds the per-candidate output ceiling of "
                f"{policy_ceiling} tokens for workload '{workload_id}'; the gateway "
                f"rejects rather than clamps. Send {name} <= {policy_ceiling}.",
                param=name,
                refusal=Refusal("output_ceiling", policy_ceiling, value),
            )
    return None
