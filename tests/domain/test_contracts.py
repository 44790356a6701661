"""A route serves n > 1 only on a current contract that approves the count."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ncap.config import Contract, Fingerprint
from ncap.domain.contracts import candidates_mode, check_route, fallback_allowed
from ncap.errors import PolicyDenied, RouteContractStale, RouteDoesNotSupportCandidates

NOW = datetime(2026, 11, 29, tzinfo=UTC)
FP = Fingerprint(provider="openai", upstream_model="gpt-4o-mini", gateway_version="0.1.0")


def contract(**kw: Any) -> Contract:
    base: dict[str, Any] = {
        "candidates": "native",
        "max_candidates": 8,
        "verified_at": NOW - timedelta(days=1),
        "max_age": "30d",
        "fingerprint": FP,
    }
    return Contract(**(base | kw))


OK = None
CASES: list[tuple[str, Contract | None, int, Fingerprint | None, type[PolicyDenied] | None]] = [
    ("native within its max", contract(), 8, FP, OK),
    ("emulate within its max", contract(candidates="emulate"), 4, FP, OK),
    ("native above its max", contract(max_candidates=2), 3, FP, RouteDoesNotSupportCandidates),
    ("unsupported", contract(candidates="unsupported"), 2, FP, RouteDoesNotSupportCandidates),
    ("no candidates entry", Contract(max_candidates=8), 2, None, RouteDoesNotSupportCandidates),
    ("no contract at all", None, 2, None, RouteDoesNotSupportCandidates),
    ("stale by age", contract(verified_at=NOW - timedelta(days=31)), 2, FP, RouteContractStale),
    ("exactly max_age is current", contract(verified_at=NOW - timedelta(days=30)), 2, FP, OK),
    ("max_age but never verified", contract(verified_at=None), 2, FP, RouteContractStale),
    ("no max_age: age not checked", contract(verified_at=None, max_age=None), 2, FP, OK),
    (
        "stale by upstream model",
        contract(),
        2,
        FP.model_copy(update={"upstream_model": "gpt-4.1-mini"}),
        RouteContractStale,
    ),
    (
        "stale by gateway version",
        contract(),
        2,
        FP.model_copy(update={"gateway_version": "0.2.0"}),
        RouteContractStale,
    ),
    ("no fingerprint recorded", contract(fingerprint=None), 2, FP, OK),
    ("no expected fingerprint", contract(), 2, None, OK),
    (
        "recorded field unset is not compared",
        contract(fingerprint=Fingerprint(provider="openai")),
        2,
        FP,
        OK,
    ),
    # n == 1 always passes, whatever the record says
    ("n=1 unsupported", contract(candidates="unsupported"), 1, FP, OK),
    ("n=1 no contract", None, 1, None, OK),
    ("n=1 stale", contract(verified_at=NOW - timedelta(days=400)), 1, FP, OK),
]


@pytest.mark.parametrize(
    ("case", "record", "n", "expected_fp", "error"), CASES, ids=[c[0] for c in CASES]
)
def test_check_route(
    case: str,
    record: Contract | None,
    n: int,
    expected_fp: Fingerprint | None,
    error: type[PolicyDenied] | None,
) -> None:
    def call() -> None:
        check_route(record, "primary-chat", n, now=NOW, expected_fingerprint=expected_fp)

    if error is None:
        call()
        assert fallback_allowed(record, "r", n, now=NOW, expected_fingerprint=expected_fp)
        return
    with pytest.raises(error) as info:
        call()
    assert info.value.param == "n" and info.value.status == 400
    assert "primary-chat" in info.value.message
    assert not fallback_allowed(record, "r", n, now=NOW, expected_fingerprint=expected_fp)


def test_fallback_needs_its_own_approval_of_the_same_count() -> None:
    primary, fallback = contract(max_candidates=8), contract(max_candidates=2)
    assert fallback_allowed(primary, "primary", 4, now=NOW)
    assert not fallback_allowed(fallback, "secondary", 4, now=NOW)
    assert fallback_allowed(fallback, "secondary", 2, now=NOW)
    assert fallback_allowed(contract(candidates="unsupported"), "secondary", 1, now=NOW)


@pytest.mark.parametrize(
    ("record", "n", "mode"),
    [
        (contract(candidates="emulate"), 3, "emulate"),
        (contract(candidates="emulate"), 1, "native"),
        (contract(), 3, "native"),
        (None, 1, "native"),
    ],
)
def test_candidates_mode(record: Contract | None, n: int, mode: str) -> None:
    assert candidates_mode(record, n) == mode
