"""Does a route's verified contract accept this candidate count?

Fail closed: a route serves ``n > 1`` only when its contract record says so
(``native`` or ``emulate``), up to its own ``max_candidates``, and the record is
current — not older than ``max_age`` and verified for the provider, upstream model
and gateway version in use. ``n == 1`` needs no contract: every route serves it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from ncap.config import Contract, Fingerprint
from ncap.errors import PolicyDenied, Refusal, RouteContractStale, RouteDoesNotSupportCandidates

__all__ = ["CandidatesMode", "candidates_mode", "check_route", "fallback_allowed"]

CandidatesMode = Literal["native", "emulate"]


def check_route(
    contract: Contract | None,
    route_id: str,
    effective_n: int,
    *,
    now: datetime,
    expected_fingerprint: Fingerprint | None = None,
) -> None:
    """Raise ``RouteDoesNotSupportCandidates`` or ``RouteContractStale`` for ``n > 1``."""
    if effective_n <= 1:
        return
    supported = _supporting(contract, route_id, effective_n)
    _check_age(supported, route_id, now)
    _check_fingerprint(supported, route_id, expected_fingerprint)


def fallback_allowed(
    contract: Contract | None,
    route_id: str,
    effective_n: int,
    *,
    now: datetime,
    expected_fingerprint: Fingerprint | None = None,
) -> bool:
    """A fallback may serve the request only if its own contract approves the count."""
    try:
        check_route(
            contract, route_id, effective_n, now=now, expected_fingerprint=expected_fingerprint
        )
    except PolicyDenied:
        return False
    return True


def candidates_mode(contract: Contract | None, effective_n: int) -> CandidatesMode:
    """How the route produces ``n`` candidates: ``emulate`` fans out k single requests."""
    if effective_n > 1 and contract is not None and contract.candidates == "emulate":
        return "emulate"
    return "native"


def _supporting(contract: Contract | None, route_id: str, n: int) -> Contract:
    if contract is None or contract.candidates in (None, "unsupported"):
        raise RouteDoesNotSupportCandidates(
            f"Route '{route_id}' has no verified contract for n > 1, so the gateway "
            "refuses rather than silently returning fewer candidates. Send n=1.",
            param="n",
            refusal=Refusal("route_max_candidates", 1, n),
        )
    if n > contract.max_candidates:
        raise RouteDoesNotSupportCandidates(
            f"Route '{route_id}' is verified for at most {contract.max_candidates} "
            f"candidate(s); n={n} was requested. Send n <= {contract.max_candidates}.",
            param="n",
            refusal=Refusal("route_max_candidates", contract.max_candidates, n),
        )
    return contract


def _check_age(contract: Contract, route_id: str, now: datetime) -> None:
    max_age = contract.max_age_delta
    if max_age is None:
        return
    if contract.verified_at is None:
        raise RouteContractStale(
            f"Route '{route_id}' requires a contract verified within {contract.max_age}, "
            "but it has never been verified; n > 1 is refused until `ncap probe` runs.",
            param="n",
        )
    if now - contract.verified_at > max_age:
        raise RouteContractStale(
            f"Route '{route_id}' was last verified at {contract.verified_at.isoformat()}, "
            f"older than its max_age of {contract.max_age}; n > 1 is refused until the "
            "route is probed again. Send n=1.",
            param="n",
        )


def _check_fingerprint(contract: Contract, route_id: str, expected: Fingerprint | None) -> None:
    recorded = contract.fingerprint
    if recorded is None or expected is None:
        return
    for name in ("provider", "upstream_model", "gateway_version"):
        was, now_is = getattr(recorded, name), getattr(expected, name)
        if was is not None and now_is is not None and was != now_is:
            raise RouteContractStale(
                f"Route '{route_id}' was verified for {name} {was!r}, but it now runs "
                f"{now_is!r}; n > 1 is refused until the route is probed again. Send n=1.",
                param="n",
            )
