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

from ncap.config import Contract, ExceptionGrant, Fingerprint, Limits, Pricing, Workload
from ncap.domain.budget import Amounts, Buckets, BudgetWindows, Usage, admit
from ncap.domain.contracts import candidates_mode, check_route
from ncap.domain.events import LedgerEvent, ReconciliationRow, reconcile, settle
from ncap.domain.money import cost_micros, format_usd
from ncap.domain.policy import decide
from ncap.domain.probe import (
    ProbeInconclusive,
    ProbeReply,
    StreamReply,
    derive_contract,
    probe_requests,
    stated_maximum,
)
from ncap.domain.reservation import estimate_input_tokens, reservation_for
from ncap.errors import (
    BudgetExhausted,
    ConcurrencyLimitExceeded,
    PolicyDenied,
    RateLimited,
    RateLimitExceeded,
    Refusal,
    RouteDoesNotSupportCandidates,
)

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


# -- every denial word for word, with its retry delay and its Refusal ----------------------
# NOW is 12:00:00 UTC: the next minute is 60 s away, the next day 12 h.

_HINT = " Lower n or max_completion_tokens, or wait for the budget period to reset."
# an exception's budget is for its whole life: it never resets
_LIFE_HINT = (
    " An exception's budget covers its whole life and never resets: lower n or"
    " max_completion_tokens, or ask the exception's owner for a new one."
)


def _refused(
    windows: BudgetWindows, usage: Usage, amounts: Amounts, exception_id: str | None = None
) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        admit("w", exception_id, usage, windows, amounts, Buckets.at(NOW))
    return info.value


@pytest.mark.parametrize(
    ("windows", "usage", "exception_id", "message", "retry_after", "refusal"),
    [
        (
            BudgetWindows(exception_budget_micros=5),
            Usage(cost_exception=2),
            "x1",
            "Workload 'w': the exception 'x1' budget of $0.000005 cannot cover this request's "
            "reservation of $0.000004 ($0.000002 already spent or held).",
            None,
            Refusal("exception", 5, 4),
        ),
        (
            BudgetWindows(usd_per_month_micros=5),
            Usage(cost_month=2),
            None,
            "Workload 'w': the monthly USD budget of $0.000005 cannot cover this request's "
            "reservation of $0.000004 ($0.000002 already spent or held).",
            None,
            Refusal("usd_micros_month", 5, 4),
        ),
        (
            BudgetWindows(usd_per_day_micros=5),
            Usage(cost_day=2),
            None,
            "Workload 'w': the daily USD budget of $0.000005 cannot cover this request's "
            "reservation of $0.000004 ($0.000002 already spent or held).",
            12 * 3600.0,
            Refusal("usd_micros_day", 5, 4),
        ),
        (
            BudgetWindows(tokens_per_day=10),
            Usage(tokens_day=4),
            None,
            "Workload 'w': the daily token budget of 10 cannot cover this request's "
            "reservation of 7 tokens (4 already used or held).",
            12 * 3600.0,
            Refusal("tokens_day", 10, 7),
        ),
    ],
)
def test_budget_denials_word_for_word(
    windows: BudgetWindows,
    usage: Usage,
    exception_id: str | None,
    message: str,
    retry_after: float | None,
    refusal: Refusal,
) -> None:
    error = _refused(windows, usage, Amounts(tokens=7, cost_micros=4), exception_id)
    assert type(error) is BudgetExhausted
    assert error.message == message + (_LIFE_HINT if refusal.limit == "exception" else _HINT)
    assert error.retry_after == retry_after
    assert error.refusal == refusal


def test_an_exception_budget_counts_only_with_an_engaged_exception() -> None:
    windows = BudgetWindows(exception_budget_micros=1)
    admit("w", None, Usage(cost_exception=9), windows, Amounts(1, 4), Buckets.at(NOW))


def test_rate_denials_word_for_word() -> None:
    never = _refused(BudgetWindows(tokens_per_minute=6), Usage(), Amounts(7, 0))
    assert type(never) is BudgetExhausted
    assert never.message == (
        "Workload 'w': this request reserves 7 tokens, more than its whole per-minute limit "
        "of 6; it can never be admitted. Lower n or max_completion_tokens."
    )
    assert (never.retry_after, never.refusal) == (None, Refusal("tokens_minute", 6, 7))

    tpm = _refused(BudgetWindows(tokens_per_minute=10), Usage(tokens_minute=4), Amounts(7, 0))
    assert type(tpm) is RateLimitExceeded
    assert tpm.message == (
        "Workload 'w': the tokens-per-minute limit of 10 is reached (4 used or held, 7 requested)."
    )
    assert (tpm.retry_after, tpm.refusal) == (60.0, Refusal("tokens_minute", 10, 7))

    rpm = _refused(BudgetWindows(requests_per_minute=3), Usage(requests_minute=3), Amounts(7, 0))
    assert type(rpm) is RateLimitExceeded
    assert rpm.message == "Workload 'w': the requests-per-minute limit of 3 is reached."
    assert (rpm.retry_after, rpm.refusal) == (60.0, Refusal("requests_minute", 3, 1))


def test_rate_windows_at_their_edges() -> None:
    buckets = Buckets.at(NOW)
    # a reservation exactly the per-minute limit fits an empty minute, and exactly fills
    # a partly used one
    admit("w", None, Usage(), BudgetWindows(tokens_per_minute=7), Amounts(7, 0), buckets)
    admit("w", None, Usage(tokens_minute=3), BudgetWindows(tokens_per_minute=10), Amounts(7, 0),
          buckets)  # fmt: skip
    # the last request of the minute fits; the tokens window does not count requests
    admit("w", None, Usage(requests_minute=2), BudgetWindows(requests_per_minute=3),
          Amounts(7, 0), buckets)  # fmt: skip
    # one token over a partly used minute is a retry, not a wall
    over = _refused(BudgetWindows(tokens_per_minute=10), Usage(tokens_minute=4), Amounts(7, 0))
    assert type(over) is RateLimitExceeded


def test_a_budget_wins_over_a_rate_limit_and_is_named() -> None:
    windows = BudgetWindows(tokens_per_day=1, tokens_per_minute=1, requests_per_minute=1)
    error = _refused(windows, Usage(requests_minute=1), Amounts(7, 0))
    assert error.refusal == Refusal("tokens_day", 1, 7)


def test_concurrency_denial_word_for_word() -> None:
    windows = BudgetWindows(max_concurrency=2)
    admit("w", None, Usage(in_flight=1), windows, Amounts(7, 0), Buckets.at(NOW))
    error = _refused(windows, Usage(in_flight=2), Amounts(7, 0))
    assert type(error) is ConcurrencyLimitExceeded
    assert error.message == (
        "Workload 'w' already has 2 request(s) in flight, its limit is 2. Retry shortly."
    )
    assert (error.retry_after, error.refusal) == (1.0, Refusal("concurrency", 2, 1))


# -- a route's contract refusals, with their Refusal ----------------------------------------


@pytest.mark.parametrize("candidates", [None, "unsupported"])
def test_a_route_without_n_refuses_naming_its_limit(candidates: str | None) -> None:
    with pytest.raises(RouteDoesNotSupportCandidates) as info:
        check_route(Contract(candidates=candidates, max_candidates=8), "r1", 3, now=NOW)
    assert (info.value.param, info.value.refusal) == ("n", Refusal("route_max_candidates", 1, 3))
    with pytest.raises(RouteDoesNotSupportCandidates):
        check_route(None, "r1", 3, now=NOW)


@pytest.mark.parametrize("candidates", ["native", "emulate"])
def test_a_route_above_its_maximum_word_for_word(candidates: str) -> None:
    contract = _contract(candidates=candidates, max_candidates=4)
    check_route(contract, "r1", 4, now=NOW)  # exactly the maximum is served
    with pytest.raises(RouteDoesNotSupportCandidates) as info:
        check_route(contract, "r1", 5, now=NOW)
    assert info.value.message == (
        "Route 'r1' is verified for at most 4 candidate(s); n=5 was requested. Send n <= 4."
    )
    assert (info.value.param, info.value.refusal) == ("n", Refusal("route_max_candidates", 4, 5))


# -- the probe: the output cap where usage reveals it, whatever the previous record said ----

_CEILING = 8
_PRINT = Fingerprint(provider="openai", upstream_model="m", gateway_version="0.1.0")


def _answer(finishes: list[str], usage: Any) -> dict[str, Any]:
    choices = [
        {"index": i, "finish_reason": f, "message": {"role": "assistant", "content": "x"}}
        for i, f in enumerate(finishes)
    ]
    return {"model": "m", "choices": choices, "usage": usage}


_STREAM = StreamReply(200, [{"choices": [{"index": 0}, {"index": 1}]}])


def _cap(finishes: list[str], usage: Any, previous: str) -> str:
    findings = derive_contract(
        ProbeReply(200, _answer(finishes, usage)),
        _STREAM,
        requested_n=len(finishes),
        ceiling=_CEILING,
        previous=Contract(output_cap=previous),  # type: ignore[arg-type]
        fingerprint=_PRINT,
        now=NOW,
    )
    assert findings.candidates == "native"
    return findings.contract.output_cap


def _details(completion: Any, reasoning: Any = None) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": 5, "completion_tokens": completion}
    if reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


LENGTH2 = ["length", "length"]


@pytest.mark.parametrize(
    ("finishes", "usage", "revealed"),
    [
        # every choice at the ceiling, one token above one ceiling: per candidate
        (LENGTH2, _details(9), "per_candidate"),
        (LENGTH2, _details(9, 0), "per_candidate"),
        # exactly one ceiling of visible output, every choice cut: shared
        (LENGTH2, _details(8), "shared"),
        # one choice cut, the output fits one ceiling: shared
        (["length", "stop"], _details(8), "shared"),
        (["stop", "length"], _details(1, 0), "shared"),
        # one choice cut with output above one ceiling: nothing proven
        (["length", "stop"], _details(9), None),
        # reasoning is not visible output: 16 - 7 = 9 visible, above one ceiling
        (LENGTH2, _details(16, 7), "per_candidate"),
        # 16 - 8 = 8 visible, but reasoning may have spent the budget: nothing proven
        (LENGTH2, _details(16, 8), None),
        (["length", "stop"], _details(2, 1), None),
        # reasoning that is not a count counts as none
        (LENGTH2, _details(8, "7"), "shared"),
        (LENGTH2, {"completion_tokens": 8, "completion_tokens_details": [7]}, "shared"),
        # no choice cut: nothing proven
        (["stop", "stop"], _details(1), None),
        (["stop", "content_filter"], _details(20), None),
        # usage that does not say how much was generated proves nothing
        (LENGTH2, None, None),
        (LENGTH2, [9], None),
        (LENGTH2, {"prompt_tokens": 5}, None),
        (LENGTH2, {"completion_tokens": "9"}, None),
    ],
)
@pytest.mark.parametrize("previous", ["per_candidate", "shared"])
def test_the_output_cap_is_revealed_only_by_usage(
    finishes: list[str], usage: Any, revealed: str | None, previous: str
) -> None:
    assert _cap(finishes, usage, previous) == (revealed or previous)


def test_a_probe_that_is_not_native_keeps_the_previous_output_cap() -> None:
    # one choice (n ignored), cut at the ceiling with little output: would say "shared"
    findings = derive_contract(
        ProbeReply(200, _answer(["length"], _details(5))),
        _STREAM,
        requested_n=2,
        ceiling=_CEILING,
        previous=Contract(output_cap="per_candidate"),
        fingerprint=_PRINT,
        now=NOW,
    )
    assert (findings.candidates, findings.contract.output_cap) == ("ignored", "per_candidate")
    assert (findings.returned, findings.reported_model, findings.stream_indexes) == (1, "m", 2)


def _derive(reply: ProbeReply, n: int = 2, previous: Contract | None = None,
            stream: StreamReply = _STREAM) -> Any:  # fmt: skip
    return derive_contract(
        reply,
        stream,
        requested_n=n,
        ceiling=_CEILING,
        previous=previous or Contract(),
        fingerprint=_PRINT,
        now=NOW,
    )


def test_the_probe_needs_two_candidates_word_for_word() -> None:
    with pytest.raises(ValueError, match=r"^the probe needs n >= 2 to tell native from ignored$"):
        _derive(ProbeReply(200, _answer(LENGTH2, _details(9))), n=1)


def test_a_stream_that_disagrees_is_noted_word_for_word() -> None:
    one = StreamReply(200, [{"choices": [{"index": 0}]}])
    findings = _derive(ProbeReply(200, _answer(LENGTH2, _details(9))), stream=one)
    assert findings.candidates == "stream_mismatched"
    assert findings.notes == [
        "the stream carried 1 choice index(es) for n=2; n > 1 is not trusted on this route"
    ]
    assert (findings.stream_indexes, findings.contract.max_candidates) == (1, 1)


def test_an_answer_without_a_choices_list_or_a_model_string() -> None:
    findings = _derive(ProbeReply(200, {"choices": None, "model": 5}))
    assert (findings.candidates, findings.returned, findings.reported_model) == (
        "mismatched", 0, None,
    )  # fmt: skip


def test_a_refusal_by_code_alone_and_one_without_words() -> None:
    by_code = {"error": {"code": "route_does_not_support_candidates", "param": None,
                         "message": "at most 2"}}  # fmt: skip
    findings = _derive(ProbeReply(400, by_code), n=4)
    assert (findings.candidates, findings.stated_maximum) == ("refused", 2)
    assert findings.contract.max_candidates == 2
    bare = _derive(ProbeReply(400, {"error": {"param": "n"}}))
    assert (bare.candidates, bare.stated_maximum, bare.notes) == (
        "refused",
        None,
        ["n=2 was refused:"],
    )
    assert bare.contract.max_candidates == 1


def test_a_stated_maximum_above_the_probes_n_is_capped_below_it() -> None:
    refusal = {"error": {"param": "n", "message": "at most 5"}}
    assert _derive(ProbeReply(400, refusal), n=4).contract.max_candidates == 3


def test_a_previous_maximum_counts_only_from_a_native_record() -> None:
    honour = ProbeReply(200, _answer(LENGTH2, _details(9)))
    was_unsupported = Contract(candidates="unsupported", max_candidates=6)
    assert _derive(honour, previous=was_unsupported).contract.max_candidates == 2
    was_native = Contract(candidates="native", max_candidates=6)
    assert _derive(honour, previous=was_native).contract.max_candidates == 6


@pytest.mark.parametrize(
    ("message", "maximum"),
    [
        ("from 1 (inclusive) to 2 (exclusive)", 1),
        ("to 1 (exclusive)", 1),  # never below one
        ("to 3 (exclusive)", 2),
        ("Expected a value <= 12.", 12),
        ("maximum value of 6", 6),
        ("the maximum is 5", 5),
        ("up to 3 candidates", 3),
        ("MUST BE 2", 2),
    ],
)
def test_stated_maximum_of_each_form(message: str, maximum: int) -> None:
    assert stated_maximum(message) == maximum


@pytest.mark.parametrize(
    ("reply", "stream", "message"),
    [
        (
            ProbeReply(429, {"error": {"code": "rate_limit_exceeded", "message": "quota"}}),
            _STREAM,
            "the n=2 probe failed with HTTP 429 (rate_limit_exceeded): quota",
        ),
        (
            ProbeReply(502, {"error": "not an envelope"}),
            _STREAM,
            "the n=2 probe failed with HTTP 502 (no code): no message",
        ),
        (
            ProbeReply(400, {"error": {"param": "temperature"}}),
            _STREAM,
            "the n=2 probe failed with HTTP 400 (no code): no message",
        ),
        (
            ProbeReply(200, _answer(LENGTH2, _details(9))),
            StreamReply(503, error={"error": {"code": "overloaded", "message": "busy"}}),
            "the streamed probe failed with HTTP 503 (overloaded): busy",
        ),
        (
            ProbeReply(200, _answer(LENGTH2, _details(9))),
            StreamReply(503),
            "the streamed probe failed with HTTP 503 (no code): no message",
        ),
    ],
)
def test_inconclusive_probes_say_what_failed(
    reply: ProbeReply, stream: StreamReply, message: str
) -> None:
    with pytest.raises(ProbeInconclusive) as info:
        derive_contract(
            reply,
            stream,
            requested_n=2,
            ceiling=_CEILING,
            previous=Contract(),
            fingerprint=_PRINT,
            now=NOW,
        )
    assert str(info.value) == message


def test_a_refusal_note_quotes_the_provider() -> None:
    refusal = {"error": {"code": "invalid_value", "param": "n", "message": "at most 3"}}
    findings = derive_contract(
        ProbeReply(400, refusal),
        _STREAM,
        requested_n=4,
        ceiling=_CEILING,
        previous=Contract(),
        fingerprint=_PRINT,
        now=NOW,
    )
    assert findings.notes == ["n=4 was refused: at most 3"]
    assert (findings.candidates, findings.stated_maximum) == ("refused", 3)
    assert (findings.contract.max_candidates, findings.returned) == (3, 0)


def test_the_probe_bodies_exactly() -> None:
    plain, streamed = probe_requests("alias")
    expected = {
        "model": "alias",
        "messages": [{"role": "user", "content": "Count from 1 to 200, one number per line."}],
        "n": 2,
        "max_completion_tokens": 16,
        "temperature": 1.0,
    }
    assert plain == expected
    assert streamed == expected | {"stream": True, "stream_options": {"include_usage": True}}
    custom, custom_stream = probe_requests("alias", n=3, ceiling=4)
    assert (custom["n"], custom["max_completion_tokens"]) == (3, 4)
    assert (custom_stream["n"], custom_stream["max_completion_tokens"]) == (3, 4)
