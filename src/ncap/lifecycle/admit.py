"""Admission of one request: policy decision and route contracts (a denial writes one
``denied`` row and raises, before any upstream call), then the reservation, sized for
the dearest route the request may use, admitted atomically against every budget window
What comes out is the frozen ``Plan`` and the holds it reserved.

The policy reads the validated request struct (chat or legacy completions: what differs
is in ``ncap.lifecycle.asked``); only the reservation's size estimate reads the body as
sent, because it measures the bytes of what the client sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from msgspec.structs import replace

import ncap.lifecycle.asked as asked
from ncap import __version__
from ncap.config import Config, ExceptionGrant, Fingerprint
from ncap.domain.contracts import candidates_mode, check_route, fallback_allowed
from ncap.domain.events import LedgerEvent
from ncap.domain.grants import Grants
from ncap.domain.policy import Decision, decide
from ncap.domain.reservation import Reservation, reservation_for
from ncap.errors import (
    PolicyDenied,
    RateLimited,
    RouteDoesNotSupportCandidates,
    StoreUnavailable,
)
from ncap.lifecycle.asked import Request, given
from ncap.lifecycle.plan import Caller, Holds, Plan, RouteRuntime, Sampling
from ncap.lifecycle.settle import Accounting
from ncap.metrics import Metrics
from ncap.protocol.chat import ChatCompletionRequest
from ncap.protocol.completions import CompletionRequest

__all__ = ["Admitter"]

_NOTHING = Reservation(0, 0, 0)
_NO_SAMPLING = Sampling()


class Admitter:
    """Per-request policy admission. What it reads is passed in: the config, the
    grants in force (exceptions), the clock and the metrics; what it writes (holds,
    the first row, a denial) goes through the books."""

    def __init__(
        self,
        config: Config,
        books: Accounting,
        *,
        grants: Grants,
        metrics: Metrics,
        clock: Callable[[], datetime],
    ) -> None:
        self.config = config
        self.books = books
        self.grants = grants
        self.metrics = metrics
        self.clock = clock
        # the sampling parameters are only for telemetry: not read when it is off
        self._sampling = config.observability.telemetry
        self._lanes: dict[str, _Lane] = {}

    async def admit(
        self,
        request_id: str,
        caller: Caller,
        request: Request,
        body: dict[str, Any],
        chain: Sequence[RouteRuntime],
    ) -> tuple[Plan, Holds]:
        now = self.clock()
        lane = self._lane(caller.workload_id, now)
        decision, allowed = lane.decision(caller, request, now, self._decide)
        lane.candidates_requested.observe(decision.effective)
        holds = Holds()
        plan: Plan | None = None
        written: LedgerEvent | None = None  # the first row, when written at admission
        try:
            if decision.error is not None:
                raise decision.error
            plan = self._plan(request_id, caller, request, body, chain, decision, now)
            if self.books.row_beside_reserve and not plan.emulated:
                row, refused = await self.books.reserve_beside_row(plan, holds)
                if refused is not None:
                    written = row
                    raise refused
                holds.first_row = row
            else:
                for number in range(1, (decision.effective if plan.emulated else 1) + 1):
                    await self.books.reserve(plan, holds, number, at=now)
        except (PolicyDenied, RateLimited) as exc:
            await self.books.abandon(holds)  # a fan-out admitted in part gives back
            scope = self.books.quota_scope
            denied = plan or _draft(request_id, caller, request, chain, decision, now, scope)
            await self.books.deny(denied, chain[0], exc, written=written)
            exc.request_headers = denied.headers(chain[0].id)
            raise
        except Exception as exc:
            if written is not None:  # e.g. the budget store down: 503, and a refused row
                await self.books.void(written, exc)
            if isinstance(exc, StoreUnavailable) and plan is not None:
                self.books.give_back_later(request_id, holds, len(holds) + 1)
            raise
        allowed.inc()
        return plan, holds

    def _lane(self, workload_id: str, now: datetime) -> _Lane:
        """The workload's lane, built again once the grants changed or one of the
        workload's exceptions expired (decisions taken before no longer hold)."""
        lane = self._lanes.get(workload_id)
        exceptions = self.grants.exceptions
        if lane is None or lane.exceptions is not exceptions or not lane.since <= now < lane.until:
            m = self.metrics
            lane = self._lanes[workload_id] = _Lane(
                workload_id,
                exceptions,
                now,
                m.child(m.candidates_requested, workload_id),
                lambda reason: m.child(m.requests, workload_id, "allow", reason),
            )
        return lane

    def _decide(self, caller: Caller, request: Request, now: datetime) -> Decision:
        temperature = given(request.temperature)
        decision = decide(
            workload_id=caller.workload_id,
            workload=self.config.workloads[caller.workload_id],
            exceptions=self.grants.exceptions,
            limits=self.config.limits,
            requested=asked.candidates(request),
            count_param=asked.candidate_param(request),
            temperature=float(temperature) if temperature is not None else None,
            max_completion_tokens=asked.max_completion_tokens(request),
            max_tokens=given(request.max_tokens),
            now=now,
        )
        if decision.ceiling_from_request:
            return decision
        ceiling = asked.default_ceiling(request, decision.per_candidate_ceiling)
        if ceiling == decision.per_candidate_ceiling:
            return decision  # chat's default is the policy's own: no copy to make
        return replace(decision, per_candidate_ceiling=ceiling)

    def _plan(
        self,
        request_id: str,
        caller: Caller,
        request: Request,
        body: dict[str, Any],
        chain: Sequence[RouteRuntime],
        decision: Decision,
        now: datetime,
    ) -> Plan:
        """The plan: its routes, its mode, what it and each attempt reserve (a fan-out
        branch holds one prefill and one ceiling; together they hold the whole)."""
        n = decision.effective
        routes = _usable_routes(chain, n, now)
        emulated = candidates_mode(routes[0].route.contract, n) == "emulate"
        returns = asked.returned(request)
        if emulated and returns is not None:
            raise RouteDoesNotSupportCandidates(
                f"best_of > n needs the route to rank candidates itself; route "
                f"{routes[0].id} emulates n by fan-out. Send best_of equal to n.",
                param="best_of",
            )
        kind = asked.kind_of(request)
        whole = _reservation(asked.input_estimate(body, kind), routes, decision)
        each = whole
        if emulated:
            each = Reservation(
                whole.input_tokens // n, whole.output_tokens // n, -(-whole.cost_micros // n)
            )
        stream, wants_usage = _stream_mode(request)
        return Plan(
            request_id=request_id,
            caller=caller,
            alias=request.model,
            decision=decision,
            reservation=whole,
            attempt_reservation=each,
            usable_routes=routes,
            emulated=emulated,
            stream=stream,
            client_wants_usage=wants_usage,
            quota_scope=self.books.quota_scope,
            timestamp=now,
            started=time.monotonic(),
            kind=kind,
            returns=returns,
            sampling=asked.sampling(request) if self._sampling else _NO_SAMPLING,
        )


_FOREVER = datetime.max.replace(tzinfo=UTC)
_LANE_DECISIONS = 256  # request shapes remembered per workload (a bound, not a need)


class _Lane:
    """One workload's admissions under one grants snapshot: the policy decisions taken
    so far, by request shape, and the metric children every admission updates.

    ``decide`` is pure: the same workload, grants and request fields give the same
    decision until an exception of the workload expires (``until``, the earliest
    expiry still ahead when the lane was built) or the grants change (another
    ``exceptions`` tuple: the admin API swaps the whole snapshot). So an allowed
    decision is taken once per request shape and shared (it is frozen); a denial is
    decided every time (its error is raised, and carries the request's headers).
    The workload's config cannot change while the gateway runs."""

    __slots__ = ("_allow", "_decisions", "candidates_requested", "exceptions", "since", "until")

    def __init__(
        self,
        workload_id: str,
        exceptions: tuple[ExceptionGrant, ...],
        now: datetime,
        candidates_requested: Any,
        allow: Callable[[str], Any],
    ) -> None:
        self.exceptions = exceptions
        self.since = now  # a clock set back (a test's) may find an expired grant live
        ahead = [e.expires for e in exceptions if e.workload == workload_id and e.expires > now]
        self.until = min(ahead, default=_FOREVER)
        self.candidates_requested = candidates_requested
        self._allow = allow  # the ``requests{result="allow"}`` child of a reason
        self._decisions: dict[tuple[Any, ...], tuple[Decision, Any]] = {}

    def decision(
        self,
        caller: Caller,
        request: Request,
        now: datetime,
        decide_: Callable[[Caller, Request, datetime], Decision],
    ) -> tuple[Decision, Any]:
        """The request's decision and, when allowed, the counter its admission adds to."""
        key = _shape(request)
        found = self._decisions.get(key)
        if found is not None:
            return found
        decision = decide_(caller, request, now)
        if decision.error is not None:
            return decision, None
        found = (decision, self._allow(decision.policy_reason))
        if len(self._decisions) < _LANE_DECISIONS:
            self._decisions[key] = found
        return found


def _shape(request: Request) -> tuple[Any, ...]:
    """Every request field the policy reads (``temperature`` only as greedy or not):
    two requests of one shape get the same decision."""
    if type(request) is ChatCompletionRequest:
        return (
            request.n,
            request.temperature == 0,
            request.max_completion_tokens,
            request.max_tokens,
        )
    legacy: CompletionRequest = request  # type: ignore[assignment]
    return ("legacy", legacy.n, legacy.best_of, legacy.temperature == 0, legacy.max_tokens)


def _draft(
    request_id: str,
    caller: Caller,
    request: Request,
    chain: Sequence[RouteRuntime],
    decision: Decision,
    now: datetime,
    quota_scope: str,
) -> Plan:
    """What a request denied before it was sized is recorded with (nothing reserved)."""
    stream, wants_usage = _stream_mode(request)
    return Plan(
        request_id=request_id,
        caller=caller,
        alias=request.model,
        decision=decision,
        reservation=_NOTHING,
        attempt_reservation=_NOTHING,
        usable_routes=tuple(chain[:1]),
        emulated=False,
        stream=stream,
        client_wants_usage=wants_usage,
        quota_scope=quota_scope,
        timestamp=now,
        started=time.monotonic(),
        kind=asked.kind_of(request),
        sampling=asked.sampling(request),
    )


def _stream_mode(request: Request) -> tuple[bool, bool]:
    """Whether the client streams, and whether it asked for the usage chunk."""
    options = given(request.stream_options)
    return bool(given(request.stream)), options is not None and bool(given(options.include_usage))


def _usable_routes(
    chain: Sequence[RouteRuntime], n: int, now: datetime
) -> tuple[RouteRuntime, ...]:
    """The primary must accept n (else the request is denied); fallbacks that do not
    approve the same count are dropped for this request."""
    if n == 1:
        return tuple(chain)  # every route serves one candidate; no contract needed
    primary = chain[0]
    check_route(
        primary.route.contract, primary.id, n, now=now, expected_fingerprint=_print(primary)
    )
    fallbacks = [
        rt
        for rt in chain[1:]
        if fallback_allowed(rt.route.contract, rt.id, n, now=now, expected_fingerprint=_print(rt))
        and candidates_mode(rt.route.contract, n) == "native"
    ]
    return (primary, *fallbacks)


def _reservation(estimate: int, routes: Sequence[RouteRuntime], decision: Decision) -> Reservation:
    """Sized for the dearest route the request may end up on (fallbacks included): the
    first of the largest by cost, then tokens."""
    n = decision.effective
    # a legacy max_tokens of 0 (the reference allows it: an echo of the prompt, for its
    # logprobs) still reserves a token a candidate: a bound, never short
    ceiling = max(decision.per_candidate_ceiling, 1)
    dearest: Reservation | None = None
    for rt in routes:
        contract = rt.route.contract
        size = reservation_for(
            estimated_input_tokens=estimate,
            effective_n=n,
            per_candidate_ceiling=ceiling,
            output_cap=contract.output_cap,
            candidates_mode=candidates_mode(contract, n),
            pricing=rt.route.pricing,
        )
        if dearest is None or (size.cost_micros, size.total_tokens) > (
            dearest.cost_micros,
            dearest.total_tokens,
        ):
            dearest = size
    assert dearest is not None  # a plan has at least its primary route
    return dearest


@lru_cache(maxsize=256)
def _fingerprint(provider: str, upstream_model: str | None) -> Fingerprint:
    return Fingerprint(
        provider=provider, upstream_model=upstream_model, gateway_version=__version__
    )


def _print(rt: RouteRuntime) -> Fingerprint:
    """What a contract record must have been verified for to still hold."""
    return _fingerprint(rt.route.provider, rt.route.upstream_model)
