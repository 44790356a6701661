"""Pins found by mutation testing (``make mutation``, docs/mutation.md): the exact texts
clients and operators read, the edges the broader tests stepped over, and the input
estimate's formula on hand-counted values (not recomputed from the module's constants).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from ncap.config import Contract, ExceptionGrant, Limits, Pricing, Workload
from ncap.domain.budget import Amounts, Buckets, BudgetWindows, Usage, admit
from ncap.domain.contracts import candidates_mode, check_route
from ncap.domain.events import LedgerEvent, ReconciliationRow, reconcile, settle
from ncap.domain.money import cost_micros, format_usd
from ncap.domain.policy import decide
from ncap.domain.reservation import estimate_input_tokens, reservation_for
from ncap.errors import PolicyDenied, RateLimited

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def _decide(**kw: Any) -> Any:
    args: dict[str, Any] = {
        "workload_id": "support-draft",
        "workload": Workload(max_candidates=2),
        "exceptions": [],
        "limits": Limits(max_candidates_absolute=16),
        "requested": 1,
        "temperature": None,
        "max_completion_tokens": None,
        "max_tokens": None,
        "now": NOW,
    }
    return decide(**(args | kw))


def _message(fn: Any, *args: Any, **kw: Any) -> str:
    with pytest.raises((PolicyDenied, RateLimited)) as info:
        fn(*args, **kw)
    return info.value.message


# -- messages clients read ------------------------------------------------------------------


def test_count_message_below_the_hard_cap() -> None:
    error = _decide(requested=16).error  # exactly the hard cap: no hard-cap sentence
    assert error.message == (
        "n=16 exceeds the approved maximum of 2 candidate(s) for workload 'support-draft'. "
        "Send n <= 2, or ask the gateway operator for a reviewed candidate-count exception "
        "for this workload (owner, maximum, output ceiling, budget and expiry). Do not retry "
        "this request unchanged."
    )


def test_count_message_above_the_hard_cap() -> None:
    error = _decide(requested=17).error
    assert error.message.endswith(
        "(owner, maximum, output ceiling, budget and expiry). The gateway's hard cap is 16; "
        "no exception can exceed it. Do not retry this request unchanged."
    )


def test_greedy_message() -> None:
    error = _decide(requested=2, temperature=0.0).error
    assert error.message == (
        "n=2 with temperature 0 asks for 2 copies of the same greedy answer at 2 times the "
        "output cost; workload 'support-draft' rejects this. Use n=1, or a temperature above 0."
    )


def test_ceiling_message_names_the_workload() -> None:
    error = _decide(max_tokens=5000).error
    assert "for workload 'support-draft'" in error.message


def test_an_exception_no_more_permissive_than_the_workload_is_never_engaged() -> None:
    same = ExceptionGrant(
        id="same", workload="support-draft", owner="o", max_candidates=2, expires=NOW + timedelta(1)
    )
    denied = _decide(requested=3, exceptions=[same])
    assert denied.error is not None and denied.exception_id is None
    assert denied.max_allowed == 2


def _contract(**kw: Any) -> Contract:
    return Contract(**({"candidates": "native", "max_candidates": 8} | kw))


def test_route_contract_messages() -> None:
    assert _message(check_route, Contract(), "r1", 2, now=NOW) == (
        "Route 'r1' has no verified contract for n > 1, so the gateway refuses rather than "
        "silently returning fewer candidates. Send n=1."
    )
    assert _message(check_route, _contract(max_age="30d"), "r1", 2, now=NOW) == (
        "Route 'r1' requires a contract verified within 30d, but it has never been verified; "
        "n > 1 is refused until `ncap probe` runs."
    )
    old = _contract(max_age="30d", verified_at="2026-01-01T00:00:00Z")
    assert _message(check_route, old, "r1", 2, now=NOW) == (
        "Route 'r1' was last verified at 2026-01-01T00:00:00+00:00, older than its max_age of "
        "30d; n > 1 is refused until the route is probed again. Send n=1."
    )


def test_two_candidates_are_emulated_on_an_emulating_route() -> None:
    assert candidates_mode(_contract(candidates="emulate"), 2) == "emulate"
    assert candidates_mode(_contract(candidates="emulate"), 1) == "native"


def test_budget_and_rate_message_endings() -> None:
    usage, amounts, buckets = Usage(), Amounts(10, 10), Buckets.at(NOW)
    exhausted = _message(admit, "w", None, usage, BudgetWindows(tokens_per_day=1), amounts, buckets)
    assert exhausted.endswith(
        "already used or held). Lower n or max_completion_tokens, or wait for the budget "
        "period to reset."
    )
    never = _message(admit, "w", None, usage, BudgetWindows(tokens_per_minute=1), amounts, buckets)
    assert never.endswith("it can never be admitted. Lower n or max_completion_tokens.")


# -- ValueErrors with their messages -----------------------------------------------------------


def test_value_error_messages() -> None:
    with pytest.raises(ValueError, match=r"^reserved amounts cannot be negative$"):
        Amounts(-1, 0)
    with pytest.raises(ValueError, match=r"^budget clocks must be timezone-aware$"):
        Buckets.at(datetime(2026, 1, 1))
    with pytest.raises(ValueError, match=r"^token counts cannot be negative$"):
        cost_micros(1, 0, -1, Pricing())
    with pytest.raises(ValueError, match=r"^token counts cannot be negative$"):
        cost_micros(1, -1, 1, Pricing())
    with pytest.raises(ValueError, match=r"^token counts cannot be negative$"):
        cost_micros(-1, 0, 1, Pricing())
    message = r"^a reservation needs input >= 0, n >= 1 and a ceiling >= 1$"
    with pytest.raises(ValueError, match=message):
        reservation_for(
            estimated_input_tokens=-1,
            effective_n=1,
            per_candidate_ceiling=1,
            output_cap="shared",
            candidates_mode="native",
            pricing=Pricing(),
        )


# -- money and clocks ---------------------------------------------------------------------------


def test_format_usd_of_zero_and_one_micro_has_no_sign() -> None:
    assert format_usd(0) == "$0.000000"
    assert format_usd(1) == "$0.000001"
    assert format_usd(-1) == "-$0.000001"


def test_reservations_assume_no_cache_discount() -> None:
    # cached input free, fresh input dear: one token priced as cached would show
    pricing = Pricing(input_per_mtok=1000, cached_input_per_mtok=0, output_per_mtok=0)
    r = reservation_for(
        estimated_input_tokens=10,
        effective_n=1,
        per_candidate_ceiling=1,
        output_cap="shared",
        candidates_mode="native",
        pricing=pricing,
    )
    assert r.cost_micros == 10_000


def test_seconds_to_the_next_window_are_exact() -> None:
    b = Buckets.at(datetime(2026, 11, 29, 23, 59, 30, 250_000, tzinfo=UTC))
    assert b.seconds_to_next_minute() == 29.75
    assert b.seconds_to_next_day() == 29.75


@pytest.fixture
def tokyo_local_time() -> Iterator[None]:
    """The process's local zone is not UTC (buckets must not depend on it)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    yield
    mp.undo()
    time.tzset()


def test_buckets_ignore_the_local_time_zone(tokyo_local_time: None) -> None:
    b = Buckets.at(datetime(2026, 11, 29, 23, 30, tzinfo=timezone(timedelta(hours=-5))))
    assert (b.minute, b.day, b.month) == ("2026-11-30T04:30", "2026-11-30", "2026-11")


# -- settlement and reconciliation ------------------------------------------------------------


def test_settle_defaults_to_a_completed_attempt() -> None:
    result = settle(effective_n=2, returned_n=2, usage_present=True, stream=False)
    assert (result.state, result.reconciliation_reason) == ("settled", None)


def test_reconcile_keeps_the_reasoning_tokens() -> None:
    event = LedgerEvent(
        timestamp=NOW, request_id="r", attempt=1, workload_id="w", environment="e",
        state="pending", reconciliation_reason="stream_cut",
    )  # fmt: skip
    row = ReconciliationRow("req_1", input_tokens=10, output_tokens=20, reasoning_tokens=7)
    outcome, updated = reconcile(event, row, Pricing(input_per_mtok=1, output_per_mtok=1))
    assert outcome == "reconciled"
    assert updated.reasoning_tokens == 7


# -- the input estimate on hand-counted values --------------------------------------------------
# formula (reservation.py): 16 per request + per message (8 + its compact UTF-8 JSON bytes,
# each image part topped up to 3000) + the compact JSON bytes of tools/functions/format


class Opaque:
    """Not JSON-serializable: the estimate falls back to ``str()`` for it."""

    def __str__(self) -> str:
        return "ö"


@pytest.mark.parametrize(
    ("messages", "extras", "expected"),
    [
        ([], {}, 16),
        # {"role":"user","content":"Hi"} is 30 bytes
        ([{"role": "user", "content": "Hi"}], {}, 16 + 8 + 30),
        # two messages: each pays its own overhead
        ([{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi"}], {}, 16 + 2 * 38),
        # {"role":"user","content":"é"} is 30 bytes (é is two)
        ([{"role": "user", "content": "é"}], {}, 16 + 8 + 30),
        # tools=[{"type":"x"}] is 14 bytes
        ([], {"tools": [{"type": "x"}]}, 16 + 14),
        ([], {"functions": [{"type": "x"}]}, 16 + 14),
        # {"type":"json_object"} is 22 bytes
        ([], {"response_format": {"type": "json_object"}}, 16 + 22),
        # text parts are not images: no top-up
        # {"role":"user","content":[{"type":"text","text":"a"}]} is 54 bytes
        ([{"role": "user", "content": [{"type": "text", "text": "a"}]}], {}, 16 + 8 + 54),
        # an image part: {"type":"image_url","image_url":{"url":"u"}} is 44 bytes;
        # the message {"role":"user","content":[<part>]} is 72 bytes
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], {},
         16 + 8 + 72 + (3000 - 44)),
        # an image part larger than the allowance counts its bytes only
        ([{"role": "user",
           "content": [{"type": "image_url", "image_url": {"url": "u" * 3000}}]}], {},
         16 + 8 + 72 + 2999),
        # the str() fallback, compact and UTF-8: {"role":"user","content":{"a":"ö","b":1}}
        # is 42 bytes
        ([{"role": "user", "content": {"a": Opaque(), "b": 1}}], {}, 16 + 8 + 42),
    ],
)  # fmt: skip
def test_estimate_hand_counted(
    messages: list[dict[str, Any]], extras: dict[str, Any], expected: int
) -> None:
    assert estimate_input_tokens(messages, **extras) == expected
