"""Every budget window and an exception, end to end: the official SDK, the gateway, the
fake upstream, the SQLite ledger and budget store.

Each window is driven to its limit and must refuse with its own code and headers
(``rate_limit_exceeded`` + Retry-After for the per-minute windows,
``concurrency_limit_exceeded`` + Retry-After 1, ``budget_exhausted`` +
``x-should-retry: false`` for day/month/exception budgets). After every scenario the
budget store's counters must equal what the ledger says was spent or is still held,
and a refused request must change no counter at all.

Limits are derived from what one request reserves and what it really costs, measured
once through an unlimited gateway (``sizes``), never from the gateway's own constants.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
from msgspec.structs import replace

from ncap.domain.budget import Usage
from ncap.domain.events import LedgerEvent
from ncap.stores import SQLiteBudgetStore
from ncap.testing.fake_upstream import FakeState
from tests.http.test_accounting import final_rows, holds, rows
from tests.support import ServerThread, gateway, gateway_config

MESSAGES = [{"role": "user", "content": "Pick a number."}]
CEILING = 20
# exact completion tokens per choice: actual usage is known and below the ceiling
ROUTE = {"headers": {"x-fake-completion-tokens": "5"}}
UNLIMITED = {"max_candidates": 1, "max_concurrency": None}
WORKLOAD = "default"
EXCEPTION = "eval-q4"
HELD_STATES = ("reserved", "pending", "usage_reconciliation_required")


@dataclass(frozen=True)
class Size:
    """One request of a given n: what it reserves and what it really spends."""

    reserved_tokens: int
    reserved_cost: int
    tokens: int
    cost: int


@dataclass
class Gw:
    server: ServerThread
    tmp: Path

    def client(self, retries: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.url + "/v1", api_key="x", max_retries=retries)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.server.url + "/v1", api_key="x", max_retries=0)


def _body(n: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "fake-model",
        "messages": MESSAGES,
        "max_completion_tokens": CEILING,
    }
    if n is not None:
        body["n"] = n
    return body


def _usd(micros: int) -> str:
    """A USD limit written as an operator would (a decimal string, not a float)."""
    return f"{micros / 1_000_000:.6f}"


def _future(days: int = 30) -> str:
    return (datetime.now(UTC) + timedelta(days=days)).isoformat()


def _grant(budget_micros: int | None, expires: str | None = None) -> dict[str, Any]:
    return {
        "id": EXCEPTION,
        "workload": WORKLOAD,
        "owner": "finops@example.com",
        "max_candidates": 4,
        "budget_usd": None if budget_micros is None else _usd(budget_micros),
        "expires": expires or _future(),
        "reason": "self-consistency evaluation",
    }


@pytest.fixture
def launch(fake: tuple[str, FakeState], tmp_path: Path) -> Iterator[Any]:
    """Start a gateway with the given workload limits (and exceptions) on fresh stores."""
    with ExitStack() as stack:

        def start(
            workload: dict[str, Any], exceptions: list[dict[str, Any]] | None = None, **kw: Any
        ) -> Gw:
            tmp = tmp_path / f"gw{len(stack._exit_callbacks)}"
            tmp.mkdir()
            route = {**ROUTE, **kw.pop("route", {})}
            cfg = gateway_config(
                fake[0],
                tmp,
                workloads={WORKLOAD: {**UNLIMITED, **workload}},
                exceptions=exceptions or [],
                routes={"fake": route},
                **kw,
            )
            return Gw(stack.enter_context(gateway(cfg)), tmp)

        yield start


@pytest.fixture(scope="module")
def sizes(fake: tuple[str, FakeState], tmp_path_factory: pytest.TempPathFactory) -> dict[int, Size]:
    """Reserved and actual tokens/cost of one request with n=1 and n=4, measured."""
    tmp = tmp_path_factory.mktemp("sizes")
    workloads = {WORKLOAD: {**UNLIMITED, "max_candidates": 4}}
    cfg = gateway_config(fake[0], tmp, workloads=workloads, routes={"fake": ROUTE})
    out: dict[int, Size] = {}
    with gateway(cfg) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        for n in (1, 4):
            raw = client.chat.completions.with_raw_response.create(**_body(n))
            (event,) = asyncio.run(_settled(tmp, raw.headers["x-request-id"]))
            assert event.state == "settled" and event.cost_micros and event.total_tokens
            reserved = event.reserved_input_tokens + event.reserved_output_tokens
            assert int(raw.headers["x-ncap-reserved-tokens"]) == reserved
            assert event.total_tokens < reserved and event.cost_micros < event.reserved_cost_micros
            out[n] = Size(
                reserved, event.reserved_cost_micros, event.total_tokens, event.cost_micros
            )
    return out


async def _settled(tmp: Path, request_id: str) -> list[LedgerEvent]:
    deadline = time.monotonic() + 10
    while True:
        found = await rows(tmp, request_id)
        if found and all(e.state != "reserved" for e in found):
            return found
        assert time.monotonic() < deadline, found
        await asyncio.sleep(0.02)


async def _usage(tmp: Path, exception_id: str | None = None) -> Usage:
    store = SQLiteBudgetStore(tmp / "budgets.db", gateway_instance="reader")
    try:
        return await store.usage(WORKLOAD, exception_id=exception_id, now=datetime.now(UTC))
    finally:
        await store.close()


def _spent(event: LedgerEvent) -> tuple[int, int]:
    """What an attempt weighs on the budget: its actuals once settled, else its hold."""
    if event.state in ("settled", "reconciled"):
        assert event.total_tokens is not None and event.cost_micros is not None
        return event.total_tokens, event.cost_micros
    assert event.state in HELD_STATES, event
    return event.reserved_input_tokens + event.reserved_output_tokens, event.reserved_cost_micros


async def assert_counters_match_ledger(gw: Gw, exception_id: str | None = None) -> Usage:
    """The store's counters are the sum of the ledger (denied rows weigh nothing)."""
    events = await final_rows(gw.tmp)
    usage = await _usage(gw.tmp, exception_id)
    now = datetime.now(UTC)
    live = [e for e in events if e.state != "denied"]
    minute = [
        e for e in live if e.timestamp.astimezone(UTC).isoformat()[:16] == now.isoformat()[:16]
    ]
    today = [e for e in live if e.timestamp.astimezone(UTC).date() == now.date()]
    month = [e for e in live if e.timestamp.astimezone(UTC).isoformat()[:7] == now.isoformat()[:7]]
    granted = [e for e in live if exception_id is not None and e.exception_id == exception_id]
    expected = Usage(
        tokens_minute=sum(_spent(e)[0] for e in minute),
        requests_minute=len(minute),
        tokens_day=sum(_spent(e)[0] for e in today),
        cost_day=sum(_spent(e)[1] for e in today),
        cost_month=sum(_spent(e)[1] for e in month),
        cost_exception=sum(_spent(e)[1] for e in granted),
        in_flight=0,
    )
    if any(_near_minute_edge(e.timestamp) for e in live) or _near_minute_edge(now):
        # a row stamped within half a second of a minute edge may have been charged to
        # the other minute (its reservation was taken a moment earlier): skip the minute
        edge = {"tokens_minute": 0, "requests_minute": 0}
        assert replace(usage, **edge) == replace(expected, **edge)
    else:
        assert usage == expected
    held = [e for e in live if e.state in HELD_STATES]
    assert sorted(h.hold_id for h in await holds(gw.tmp)) == sorted(
        f"{e.request_id}#{e.attempt}" for e in held
    )
    return usage


def _near_minute_edge(at: datetime) -> bool:
    second = at.second + at.microsecond / 1e6
    return second < 0.5 or second > 59.5


def _fresh_minute(budget_s: float = 8.0) -> None:
    """Per-minute windows are fixed buckets: start a scenario that must stay inside one
    minute early enough in it (a rollover would legitimately reset the counters)."""
    now = datetime.now(UTC)
    second = now.second + now.microsecond / 1e6
    if second > 60 - budget_s:
        time.sleep(60 - second + 1.0)  # past the edge zone of assert_counters_match_ledger


async def _ok(gw: Gw, n: int | None = None) -> str:
    """One answered request, waited for until its attempt has settled in both stores."""
    raw = gw.client().chat.completions.with_raw_response.create(**_body(n))
    assert raw.status_code == 200
    request_id = raw.headers["x-request-id"]
    await _settled(gw.tmp, request_id)
    return request_id


def _refused(
    gw: Gw, exc_type: type[openai.APIStatusError], n: int | None = None, *, retries: int = 0
) -> openai.APIStatusError:
    with pytest.raises(exc_type) as info:
        gw.client(retries).chat.completions.create(**_body(n))
    return info.value


def _denied(events: list[LedgerEvent]) -> list[LedgerEvent]:
    return [e for e in events if e.state == "denied"]


def _assert_budget_exhausted(error: openai.APIStatusError, *, resets_daily: bool) -> None:
    assert error.status_code == 429
    assert error.code == "budget_exhausted"
    assert error.response.headers["x-should-retry"] == "false"
    if resets_daily:
        now = datetime.now(UTC)
        midnight = datetime(now.year, now.month, now.day, tzinfo=UTC) + timedelta(days=1)
        to_midnight = (midnight - now).total_seconds()
        assert abs(int(error.response.headers["retry-after"]) - to_midnight) <= 5
    else:
        assert "retry-after" not in error.response.headers  # no period resets it


# -- per-minute windows -------------------------------------------------------------------


async def test_tokens_per_minute(launch: Any, sizes: dict[int, Size]) -> None:
    one = sizes[1]
    # room for the first two (actuals after settling) and a third reservation short of it
    limit = 2 * one.tokens + one.reserved_tokens - 1
    gw = launch({"tokens_per_minute": limit})
    _fresh_minute()
    await _ok(gw)
    await _ok(gw)
    before = await _usage(gw.tmp)
    error = _refused(gw, openai.RateLimitError)
    assert (error.status_code, error.code) == (429, "rate_limit_exceeded")
    retry_after = int(error.response.headers["retry-after"])
    assert 0 <= retry_after <= 60
    assert "x-should-retry" not in error.response.headers  # the client's own rule: retry
    assert await _usage(gw.tmp) == before  # refused: no counter moved
    events = await rows(gw.tmp)
    assert [e.policy_reason for e in _denied(events)] == ["rate_limit_exceeded"]
    usage = await assert_counters_match_ledger(gw)
    assert usage.tokens_minute == 2 * one.tokens


async def test_a_request_larger_than_the_whole_minute_is_never_admitted(
    launch: Any, sizes: dict[int, Size]
) -> None:
    gw = launch({"tokens_per_minute": sizes[1].reserved_tokens - 1})
    error = _refused(gw, openai.RateLimitError, retries=2)
    _assert_budget_exhausted(error, resets_daily=False)  # retrying can never help
    assert [e.state for e in await rows(gw.tmp)] == ["denied"]  # and the SDK did not retry
    await assert_counters_match_ledger(gw)


async def test_requests_per_minute(launch: Any, sizes: dict[int, Size]) -> None:
    gw = launch({"requests_per_minute": 2})
    _fresh_minute()
    await _ok(gw)
    await _ok(gw)
    before = await _usage(gw.tmp)
    error = _refused(gw, openai.RateLimitError)
    assert (error.status_code, error.code) == (429, "rate_limit_exceeded")
    assert 0 <= int(error.response.headers["retry-after"]) <= 60
    assert int(error.response.headers["retry-after-ms"]) <= 60_000
    assert await _usage(gw.tmp) == before
    usage = await assert_counters_match_ledger(gw)
    assert usage.requests_minute == 2


# -- day and month budgets -----------------------------------------------------------------


async def test_tokens_per_day(launch: Any, sizes: dict[int, Size]) -> None:
    one = sizes[1]
    gw = launch({"tokens_per_day": one.tokens + one.reserved_tokens - 1})
    await _ok(gw)
    before = await _usage(gw.tmp)
    error = _refused(gw, openai.RateLimitError, retries=2)  # the SDK must not retry
    _assert_budget_exhausted(error, resets_daily=True)
    assert "daily token budget" in error.message
    assert await _usage(gw.tmp) == before
    events = await rows(gw.tmp)
    assert [(e.state, e.policy_reason) for e in events] == [
        ("settled", "within_default"),
        ("denied", "budget_exhausted"),
    ]
    usage = await assert_counters_match_ledger(gw)
    assert usage.tokens_day == one.tokens


@pytest.mark.parametrize(
    ("window", "other", "resets_daily", "label"),
    [
        ("usd_per_day", "usd_per_month", True, "daily USD budget"),
        ("usd_per_month", "usd_per_day", False, "monthly USD budget"),
    ],
)
async def test_usd_budgets_are_each_their_own_window(
    launch: Any, sizes: dict[int, Size], window: str, other: str, resets_daily: bool, label: str
) -> None:
    one = sizes[1]
    # the tight window admits one request and not a second; the other is roomy, so a
    # limit read from the wrong field admits the second request
    tight = one.cost + one.reserved_cost - 1
    gw = launch({window: _usd(tight), other: _usd(100 * one.reserved_cost)})
    await _ok(gw)
    before = await _usage(gw.tmp)
    error = _refused(gw, openai.RateLimitError, retries=2)
    _assert_budget_exhausted(error, resets_daily=resets_daily)
    assert label in error.message and f"of ${_usd(tight)}" in error.message
    assert await _usage(gw.tmp) == before
    assert [e.state for e in await rows(gw.tmp)] == ["settled", "denied"]
    usage = await assert_counters_match_ledger(gw)
    assert usage.cost_day == usage.cost_month == one.cost


async def test_a_budget_that_covers_exactly_the_reservation_admits_it(
    launch: Any, sizes: dict[int, Size]
) -> None:
    one = sizes[1]
    gw = launch({"usd_per_day": _usd(one.reserved_cost), "tokens_per_day": one.reserved_tokens})
    await _ok(gw)
    _refused(gw, openai.RateLimitError)  # what is left is below a whole reservation
    await assert_counters_match_ledger(gw)


# -- concurrency -------------------------------------------------------------------------


async def _in_flight(fake: FakeState, count: int) -> None:
    deadline = time.monotonic() + 10
    while fake.stats()["in_flight"] < count:
        assert time.monotonic() < deadline, fake.stats()["in_flight"]
        await asyncio.sleep(0.02)


async def test_max_concurrency(
    launch: Any, fake: tuple[str, FakeState], sizes: dict[int, Size]
) -> None:
    gw = launch(
        {"max_concurrency": 2},
        route={"headers": {**ROUTE["headers"], "x-fake-latency-ms": "2000"}, "timeout_s": 30},
    )
    fake[1].reset()
    client = gw.aclient()
    slow = [asyncio.create_task(client.chat.completions.create(**_body())) for _ in range(2)]
    await _in_flight(fake[1], 2)  # both admitted and upstream: the ceiling is reached
    before = await _usage(gw.tmp)
    assert before.in_flight == 2
    with pytest.raises(openai.RateLimitError) as info:
        await client.chat.completions.create(**_body())
    error = info.value
    assert (error.status_code, error.code) == (429, "concurrency_limit_exceeded")
    assert error.response.headers["retry-after"] == "1"
    assert "x-should-retry" not in error.response.headers
    assert await _usage(gw.tmp) == before
    await asyncio.gather(*slow)
    await _ok(gw)  # the slots are free again
    usage = await assert_counters_match_ledger(gw)
    assert usage.in_flight == 0
    events = await rows(gw.tmp)
    assert sorted(e.state for e in events) == ["denied", "settled", "settled", "settled"]


@pytest.mark.parametrize("budgets", ["memory", "sqlite"])
async def test_clients_at_max_concurrency_are_never_refused(launch: Any, budgets: str) -> None:
    """Two clients, each sending its next request as soon as it has its answer, under
    ``max_concurrency: 2``: every request is served. (The hold used to be settled on
    the settlement's next tick, after the answer: the next request found the previous
    slot still taken, and 60 % of them were refused.)"""
    stores = {"budgets": "memory://"} if budgets == "memory" else {}
    gw = launch({"max_concurrency": 2}, stores=stores)
    client = gw.aclient()

    async def one_client() -> list[int]:
        codes = []
        for _ in range(40):
            raw = await client.chat.completions.with_raw_response.create(**_body())
            codes.append(raw.status_code)
        return codes

    try:
        results = await asyncio.gather(one_client(), one_client())
    except openai.RateLimitError as exc:
        pytest.fail(f"refused at the limit: {exc.code}")
    assert [c for codes in results for c in codes] == [200] * 80
    deadline = time.monotonic() + 10
    while len(final := [e for e in await rows(gw.tmp) if e.state == "settled"]) < 80:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert len(final) == 80 and not _denied(await rows(gw.tmp))


# -- an exception ----------------------------------------------------------------------------


async def test_exception_budget_its_id_in_the_ledger_and_its_limit(
    launch: Any, sizes: dict[int, Size]
) -> None:
    four, one = sizes[4], sizes[1]
    budget = four.cost + four.reserved_cost - 1  # one n=4 request, not two
    gw = launch({"usd_per_day": _usd(1000 * four.reserved_cost)}, [_grant(budget)])
    first = await _ok(gw, n=4)
    before = await _usage(gw.tmp, EXCEPTION)
    error = _refused(gw, openai.RateLimitError, n=4, retries=2)
    _assert_budget_exhausted(error, resets_daily=False)  # an exception's budget never resets
    assert f"exception '{EXCEPTION}' budget of ${_usd(budget)}" in error.message
    assert await _usage(gw.tmp, EXCEPTION) == before
    plain = await _ok(gw)  # n=1 does not engage the exception: its budget does not apply
    events = await rows(gw.tmp)
    by_id = {e.request_id: e for e in events}
    assert (by_id[first].exception_id, by_id[first].policy_reason) == (
        EXCEPTION,
        "within_exception",
    )
    assert by_id[plain].exception_id is None
    (denied,) = _denied(events)
    assert (denied.exception_id, denied.policy_reason) == (EXCEPTION, "budget_exhausted")
    usage = await assert_counters_match_ledger(gw, EXCEPTION)
    assert usage.cost_exception == four.cost  # the n=1 request is not charged to it
    assert usage.cost_day == four.cost + one.cost  # the workload's budget sees both


async def test_exception_does_not_lift_the_workload_windows(
    launch: Any, sizes: dict[int, Size]
) -> None:
    four = sizes[4]
    # the exception has money left, the workload's daily budget has not
    gw = launch({"usd_per_day": _usd(four.reserved_cost - 1)}, [_grant(100 * four.reserved_cost)])
    error = _refused(gw, openai.RateLimitError, n=4)
    _assert_budget_exhausted(error, resets_daily=True)
    assert "daily USD budget" in error.message
    await assert_counters_match_ledger(gw, EXCEPTION)


async def test_exception_without_budget_is_limited_only_by_the_workload(
    launch: Any, sizes: dict[int, Size]
) -> None:
    gw = launch({}, [_grant(None)])
    for _ in range(3):
        await _ok(gw, n=4)
    usage = await assert_counters_match_ledger(gw, EXCEPTION)
    assert usage.cost_exception == 3 * sizes[4].cost


async def test_expired_exception_is_ignored(launch: Any, sizes: dict[int, Size]) -> None:
    past = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    gw = launch({}, [_grant(100 * sizes[4].reserved_cost, expires=past)])
    error = _refused(gw, openai.BadRequestError, n=4, retries=2)
    assert (error.status_code, error.code, error.param) == (
        400,
        "candidate_count_exceeds_policy",
        "n",
    )
    assert "maximum" in error.message.lower() and "1" in error.message
    (event,) = await rows(gw.tmp)
    assert (event.state, event.exception_id) == ("denied", None)
    assert await assert_counters_match_ledger(gw, EXCEPTION) == Usage()


async def test_exception_expiring_between_requests(launch: Any, sizes: dict[int, Size]) -> None:
    soon = (datetime.now(UTC) + timedelta(seconds=4)).isoformat()  # slack for start-up
    gw = launch({}, [_grant(100 * sizes[4].reserved_cost, expires=soon)])
    first = await _ok(gw, n=4)
    remaining = (datetime.fromisoformat(soon) - datetime.now(UTC)).total_seconds()
    time.sleep(max(0.0, remaining) + 0.1)
    _refused(gw, openai.BadRequestError, n=4)
    events = await rows(gw.tmp)
    assert [(e.request_id == first, e.exception_id, e.state) for e in events] == [
        (True, EXCEPTION, "settled"),
        (False, None, "denied"),
    ]
    await assert_counters_match_ledger(gw, EXCEPTION)


# -- several windows at once --------------------------------------------------------------


async def test_a_request_refused_by_one_window_changes_no_counter_of_the_others(
    launch: Any, sizes: dict[int, Size]
) -> None:
    one = sizes[1]
    # tokens and requests have room; only the daily USD budget refuses
    gw = launch(
        {
            "tokens_per_minute": 100 * one.reserved_tokens,
            "requests_per_minute": 100,
            "tokens_per_day": 100 * one.reserved_tokens,
            "usd_per_day": _usd(one.cost + one.reserved_cost - 1),
            "usd_per_month": _usd(100 * one.reserved_cost),
            "max_concurrency": 10,
        }
    )
    _fresh_minute()
    await _ok(gw)
    before = await _usage(gw.tmp)
    assert before.tokens_minute == before.tokens_day == one.tokens
    for _ in range(3):
        _refused(gw, openai.RateLimitError)
    assert await _usage(gw.tmp) == before  # not one token, request or micro-USD moved
    await assert_counters_match_ledger(gw)


async def test_concurrent_burst_against_several_windows(
    launch: Any, fake: tuple[str, FakeState], sizes: dict[int, Size]
) -> None:
    one = sizes[1]
    # usage never arrives: every admitted attempt keeps its whole reservation, so what
    # is admitted does not depend on how fast the others finish
    gw = launch(
        {
            "usd_per_day": _usd(5 * one.reserved_cost),
            "tokens_per_day": 7 * one.reserved_tokens,
            "tokens_per_minute": 9 * one.reserved_tokens,
            "requests_per_minute": 50,
        },
        route={"headers": {**ROUTE["headers"], "x-fake-fault": "missing_usage"}},
    )
    _fresh_minute()
    fake[1].reset()
    client = gw.aclient()

    async def one_request() -> int:
        try:
            await client.chat.completions.create(**_body())
        except openai.RateLimitError as exc:
            assert exc.code == "budget_exhausted"
            return 429
        return 200

    codes = await asyncio.gather(*(one_request() for _ in range(20)))
    assert (codes.count(200), codes.count(429)) == (5, 15)
    assert fake[1].stats()["requests"] == 5
    events = await final_rows(gw.tmp)
    assert sorted({e.state for e in events}) == ["denied", "usage_reconciliation_required"]
    usage = await assert_counters_match_ledger(gw)
    assert usage.cost_day == 5 * one.reserved_cost
    assert usage.tokens_day == usage.tokens_minute == 5 * one.reserved_tokens


# -- quota scope -------------------------------------------------------------------------


async def test_admitted_rows_record_the_budget_store_scope(launch: Any) -> None:
    gw = launch({})
    await _ok(gw)
    assert [e.quota_scope for e in await rows(gw.tmp)] == ["host"]  # SQLite budgets


async def test_denied_rows_record_the_budget_store_scope(launch: Any) -> None:
    gw = launch({"tokens_per_day": 1})
    _refused(gw, openai.RateLimitError)
    assert [e.quota_scope for e in await rows(gw.tmp)] == ["host"]


async def test_a_fan_out_admitted_in_part_changes_no_counter(
    launch: Any, sizes: dict[int, Size]
) -> None:
    one = sizes[1]
    emulated = {"contract": {"candidates": "emulate", "max_candidates": 8}}
    # each of the 3 branches holds about one n=1 reservation: the daily budget covers
    # two branches and the requests-per-minute window three, so the third branch fails
    gw = launch(
        {"max_candidates": 4, "usd_per_day": _usd(2 * one.reserved_cost + one.reserved_cost // 2),
         "requests_per_minute": 10},
        route=emulated,
    )  # fmt: skip
    _fresh_minute()
    before = await _usage(gw.tmp)
    error = _refused(gw, openai.RateLimitError, n=3)
    _assert_budget_exhausted(error, resets_daily=True)
    assert await _usage(gw.tmp) == before == Usage()  # the two admitted branches gave back
    (event,) = await rows(gw.tmp)
    assert (event.state, event.policy_reason) == ("denied", "budget_exhausted")
    await assert_counters_match_ledger(gw)
    await _ok(gw, n=2)  # two branches fit: both admitted, both settled
    events = await rows(gw.tmp)
    assert sorted(e.state for e in events) == ["denied", "settled", "settled"]
    usage = await assert_counters_match_ledger(gw)
    assert usage.requests_minute == 2
