"""The candidate-count policy, rule by rule: decide() with an injected clock, table-driven."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ncap.config import ExceptionGrant, Limits, Workload
from ncap.domain.policy import Decision, active_exceptions, decide
from ncap.errors import (
    CandidateCountExceedsPolicy,
    CandidatesWithGreedySampling,
    OutputCeilingExceedsPolicy,
    PolicyDenied,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
EXPIRES = datetime(2026, 12, 31, tzinfo=UTC)


def grant(gid: str = "eval-q4", **kw: Any) -> ExceptionGrant:
    base: dict[str, Any] = {
        "id": gid,
        "workload": "support-eval",
        "owner": "finops@example.com",
        "max_candidates": 4,
        "output_ceiling": 512,
        "budget_usd": 25.0,
        "expires": EXPIRES,
        "reason": "self-consistency evaluation",
    }
    return ExceptionGrant(**(base | kw))


def run(**kw: Any) -> Decision:
    args: dict[str, Any] = {
        "workload_id": "support-eval",
        "workload": Workload(),
        "exceptions": [],
        "limits": Limits(),
        "requested": None,
        "temperature": None,
        "max_completion_tokens": None,
        "max_tokens": None,
        "now": NOW,
    }
    return decide(**(args | kw))


# --- rule 1: requested vs effective --------------------------------------------------


@pytest.mark.parametrize(("requested", "effective"), [(None, 1), (1, 1)])
def test_requested_is_kept_apart_from_effective(requested: int | None, effective: int) -> None:
    d = run(requested=requested)
    assert (d.requested, d.effective) == (requested, effective)
    assert d.policy_result == "allow" and d.policy_reason == "within_default"
    assert d.error is None and d.exception_id is None and d.allowed


# --- rules 2 and 3: approved maximum, exceptions, hard cap --------------------------


@pytest.mark.parametrize(
    ("case", "kw", "result", "reason", "max_allowed", "exception_id"),
    [
        ("default max is 1", {"requested": 2}, "deny", "candidate_count_exceeds_policy", 1, None),
        (
            "workload raises its own max",
            {"requested": 3, "workload": Workload(max_candidates=3)},
            "allow",
            "within_default",
            3,
            None,
        ),
        (
            "active exception raises it",
            {"requested": 4, "exceptions": [grant()]},
            "allow",
            "within_exception",
            4,
            "eval-q4",
        ),
        (
            "above the exception",
            {"requested": 5, "exceptions": [grant()]},
            "deny",
            "candidate_count_exceeds_policy",
            4,
            "eval-q4",
        ),
        (
            "exception of another workload is ignored",
            {"requested": 4, "exceptions": [grant(workload="other")]},
            "deny",
            "candidate_count_exceeds_policy",
            1,
            None,
        ),
        (
            "expired exception is ignored",
            {"requested": 4, "exceptions": [grant(expires=NOW - timedelta(seconds=1))]},
            "deny",
            "candidate_count_exceeds_policy",
            1,
            None,
        ),
        (
            "expiry instant itself is expired",
            {"requested": 4, "exceptions": [grant(expires=NOW)]},
            "deny",
            "candidate_count_exceeds_policy",
            1,
            None,
        ),
        (
            "within the default an exception is not engaged",
            {"requested": 2, "workload": Workload(max_candidates=2), "exceptions": [grant()]},
            "allow",
            "within_default",
            4,
            None,
        ),
        (
            "an exception never lowers the workload's max",
            {"requested": 6, "workload": Workload(max_candidates=6), "exceptions": [grant()]},
            "allow",
            "within_default",
            6,
            None,
        ),
        (
            "hard cap bounds an exception",
            {"requested": 17, "exceptions": [grant(max_candidates=32)]},
            "deny",
            "candidate_count_exceeds_policy",
            16,
            "eval-q4",
        ),
        (
            "hard cap allows up to itself",
            {"requested": 16, "exceptions": [grant(max_candidates=32)]},
            "allow",
            "within_exception",
            16,
            "eval-q4",
        ),
        (
            "hard cap bounds a workload",
            {
                "requested": 9,
                "workload": Workload(max_candidates=32),
                "limits": Limits(max_candidates_absolute=8),
            },
            "deny",
            "candidate_count_exceeds_policy",
            8,
            None,
        ),
    ],
)
def test_approved_maximum(
    case: str,
    kw: dict[str, Any],
    result: str,
    reason: str,
    max_allowed: int,
    exception_id: str | None,
) -> None:
    d = run(**kw)
    assert (d.policy_result, d.policy_reason, d.max_allowed, d.exception_id) == (
        result,
        reason,
        max_allowed,
        exception_id,
    ), case


def test_exception_that_expires_between_two_requests() -> None:
    exceptions = [grant(expires=NOW + timedelta(minutes=5))]
    before = run(requested=4, exceptions=exceptions, now=NOW)
    after = run(requested=4, exceptions=exceptions, now=NOW + timedelta(minutes=5, seconds=1))
    assert before.allowed and before.exception_id == "eval-q4"
    assert not after.allowed and after.max_allowed == 1 and after.exception_id is None
    assert isinstance(after.error, CandidateCountExceedsPolicy)


def test_most_permissive_active_exception_wins_deterministically() -> None:
    exceptions = [
        grant("small", max_candidates=3),
        grant("big-early", max_candidates=8, expires=EXPIRES - timedelta(days=1)),
        grant("big-late", max_candidates=8),
        grant("bigger-expired", max_candidates=12, expires=NOW - timedelta(days=1)),
    ]
    for order in (exceptions, exceptions[::-1]):
        d = run(requested=5, exceptions=order)
        assert (d.exception_id, d.max_allowed) == ("big-late", 8)
    assert [e.id for e in active_exceptions("support-eval", exceptions, NOW)] == [
        "big-late",
        "big-early",
        "small",
    ]


def test_count_denial_says_the_maximum_and_how_to_get_an_exception() -> None:
    d = run(requested=4)
    err = d.error
    assert isinstance(err, CandidateCountExceedsPolicy)
    assert err.param == "n" and err.status == 400 and err.code == "candidate_count_exceeds_policy"
    assert "maximum of 1" in err.message and "exception" in err.message
    assert err.should_retry is False


def test_count_denial_above_hard_cap_says_no_exception_can_help() -> None:
    d = run(requested=20, exceptions=[grant(max_candidates=64)])
    assert d.error is not None and "hard cap is 16" in d.error.message


# --- rule 4: greedy sampling --------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "temperature", "greedy", "result"),
    [
        (2, 0, "reject", "deny"),
        (2, 0.0, "reject", "deny"),
        (2, 0, "allow", "allow"),
        (1, 0, "reject", "allow"),
        (None, 0, "reject", "allow"),
        (2, None, "reject", "allow"),
        (2, 0.7, "reject", "allow"),
    ],
)
def test_greedy_candidates(
    n: int | None, temperature: float | None, greedy: str, result: str
) -> None:
    workload = Workload(max_candidates=4, greedy_candidates=greedy)  # type: ignore[arg-type]
    d = run(requested=n, temperature=temperature, workload=workload)
    assert d.policy_result == result
    if result == "deny":
        assert isinstance(d.error, CandidatesWithGreedySampling)
        assert d.error.param == "n" and d.policy_reason == "candidates_with_greedy_sampling"


# --- rule 5: output ceiling ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "result", "param", "ceiling", "from_request", "ceiling_param"),
    [
        ({}, "allow", None, 1024, False, None),
        ({"max_completion_tokens": 200}, "allow", None, 200, True, "max_completion_tokens"),
        ({"max_tokens": 300}, "allow", None, 300, True, "max_tokens"),
        ({"max_completion_tokens": 1024}, "allow", None, 1024, True, "max_completion_tokens"),
        ({"max_completion_tokens": 1025}, "deny", "max_completion_tokens", 1025, True, None),
        ({"max_tokens": 4096}, "deny", "max_tokens", 4096, True, None),
        (
            {"max_completion_tokens": 100, "max_tokens": 500},
            "allow",
            None,
            500,
            True,
            "max_completion_tokens",
        ),
        (
            {"max_completion_tokens": 100, "max_tokens": 2000},
            "deny",
            "max_tokens",
            2000,
            True,
            None,
        ),
    ],
)
def test_output_ceiling(
    kw: dict[str, Any],
    result: str,
    param: str | None,
    ceiling: int,
    from_request: bool,
    ceiling_param: str | None,
) -> None:
    d = run(**kw)
    assert d.policy_result == result
    assert d.per_candidate_ceiling == ceiling and d.ceiling_from_request is from_request
    if result == "deny":
        assert isinstance(d.error, OutputCeilingExceedsPolicy)
        assert d.error.param == param and "rejects rather than clamps" in d.error.message
    else:
        assert d.ceiling_param == ceiling_param


def test_engaged_exception_brings_its_output_ceiling() -> None:
    engaged = run(requested=4, exceptions=[grant()])
    assert engaged.per_candidate_ceiling == 512
    over = run(requested=4, exceptions=[grant()], max_completion_tokens=600)
    assert isinstance(over.error, OutputCeilingExceedsPolicy)
    not_engaged = run(requested=1, exceptions=[grant()])
    assert not_engaged.per_candidate_ceiling == 1024


def test_exception_without_output_ceiling_uses_the_workloads() -> None:
    d = run(requested=4, exceptions=[grant(output_ceiling=None)])
    assert d.allowed and d.per_candidate_ceiling == 1024


# --- ordering, purity ---------------------------------------------------------------


def test_first_failing_rule_is_the_reason() -> None:
    d = run(requested=3, temperature=0, max_completion_tokens=99_999)
    assert d.policy_reason == "candidate_count_exceeds_policy"
    d = run(requested=3, temperature=0, max_tokens=99_999, workload=Workload(max_candidates=4))
    assert d.policy_reason == "candidates_with_greedy_sampling"


def test_denial_is_returned_never_raised_and_decision_is_frozen() -> None:
    d = run(requested=128)
    assert isinstance(d.error, PolicyDenied) and d.policy_result == "deny"
    assert d.effective == 128 and d.requested == 128
    with pytest.raises(AttributeError):
        d.effective = 1  # type: ignore[misc]
