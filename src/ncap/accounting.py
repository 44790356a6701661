"""Policy, reservations and the ledger around each request: the service's bookkeeper.

Order for one request (SPEC §4–§7):

1. ``admit``: policy decision and route contract (a denial writes one ``denied`` event
   and raises, before any upstream call); the reservation, sized for the dearest
   route the request may use, is admitted atomically against every budget window.
2. ``attempt_started``: the attempt's ``reserved`` row is durable before dispatch.
3. ``attempt_answered`` / ``stream_finished`` / ``attempt_failed``: the row gets the
   provider's usage and its final state; the budget hold is settled with actuals, kept
   (usage unknown: held until reconciled), or, for an upstream refusal that generated
   nothing, carried over to the next attempt.
4. ``abandon``: a request that ends with a hold never dispatched releases it.

A ledger failure is never swallowed: it propagates and the client gets an error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from ncap import __version__
from ncap.config import Config, Fingerprint, Pricing
from ncap.domain.budget import Amounts, BudgetWindows
from ncap.domain.contracts import candidates_mode, check_route, fallback_allowed
from ncap.domain.events import AttemptOutcome, LedgerEvent, settle
from ncap.domain.money import cost_micros
from ncap.domain.policy import Decision, decide
from ncap.domain.reservation import Reservation, estimate_input_tokens, reservation_for
from ncap.errors import NcapError, PolicyDenied, RateLimited
from ncap.metrics import Metrics
from ncap.protocol.responses import SummaryUsage
from ncap.providers.base import AttemptFailed
from ncap.stores.base import BudgetStore, Hold, LedgerStore, hold_id_for

if TYPE_CHECKING:
    from ncap.service import RouteRuntime

__all__ = ["Accounting", "AttemptReport", "Caller", "Plan"]


@dataclass(frozen=True, slots=True)
class Caller:
    workload_id: str
    environment: str


@dataclass(frozen=True, slots=True)
class AttemptReport:
    """What an answered attempt said about itself (from its body or its stream)."""

    provider_request_id: str | None
    returned: int
    finish_reasons: dict[str, int]
    usage: SummaryUsage | None
    stream: bool
    cut: str | None  # why a stream ended early, None when it ended normally


@dataclass(slots=True)
class Plan:
    """One admitted request: its decision, reservation and attempts so far."""

    request_id: str
    caller: Caller
    alias: str
    decision: Decision
    reservation: Reservation
    usable_routes: list[RouteRuntime]
    stream: bool
    client_wants_usage: bool
    timestamp: datetime
    started: float
    # holds by attempt number: one per attempt (k at once for a fan-out)
    holds: dict[int, Hold] = field(default_factory=dict)
    attempts: int = 0
    # fan-out emulation: k single-candidate branches, each its own attempt and hold
    emulated: bool = False
    attempt_reservation: Reservation = field(default_factory=lambda: Reservation(0, 0, 0))
    quota_scope: str = "instance"
    rows: dict[int, LedgerEvent] = field(default_factory=dict)

    @property
    def candidates_per_attempt(self) -> int:
        return 1 if self.emulated else self.decision.effective

    @property
    def ceiling_from_request(self) -> bool:
        return self.decision.ceiling_from_request

    @property
    def per_candidate_ceiling(self) -> int:
        return self.decision.per_candidate_ceiling

    def headers(self, route_id: str) -> dict[str, str]:
        d = self.decision
        return {
            "x-ncap-route": route_id,
            "x-ncap-candidates-requested": "omitted" if d.requested is None else str(d.requested),
            "x-ncap-candidates-effective": str(d.effective),
            "x-ncap-reserved-tokens": str(self.reservation.total_tokens),
        }


class Accounting:
    def __init__(
        self,
        config: Config,
        ledger: LedgerStore,
        budgets: BudgetStore,
        *,
        instance: str,
        metrics: Metrics,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.budgets = budgets
        self.instance = instance
        self.metrics = metrics
        self.clock = clock
        self._window_cache: dict[tuple[str, str | None], BudgetWindows] = {}

    # -- lifecycle of the stores -------------------------------------------------------

    async def start(self) -> None:
        """Recover what a crashed predecessor left in flight (SPEC §6: gateway_lost)."""
        await self.ledger.mark_lost()
        await self.budgets.recover_lost()
        self.metrics.reservations_outstanding.set(len(await self.budgets.outstanding()))

    async def close(self) -> None:
        await self.ledger.close()
        await self.budgets.close()

    async def check_ready(self) -> list[str]:
        """Each store answers a cheap read; the problem list names the ones that did not."""
        problems = []
        probes = (
            ("ledger", self.ledger.get("readyz-probe")),
            ("budgets", self.budgets.usage(next(iter(self.config.workloads)))),
        )
        for name, probe in probes:
            try:
                await probe
            except Exception as exc:  # readiness reports any failure, whatever its type
                problems.append(f"{name}: {type(exc).__name__}")
        return problems

    # -- admission ---------------------------------------------------------------------

    async def admit(
        self,
        request_id: str,
        caller: Caller,
        alias: str,
        body: dict[str, Any],
        chain: Sequence[RouteRuntime],
    ) -> Plan:
        now = self.clock()
        decision = self._decide(caller, body, now)
        plan = self._plan(request_id, caller, alias, body, chain, decision, now)
        m = self.metrics
        m.child(m.candidates_requested, caller.workload_id).observe(decision.effective)
        try:
            if decision.error is not None:
                raise decision.error
            plan.usable_routes = self._usable_routes(chain, decision.effective, now)
            plan.emulated = _emulated(plan.usable_routes[0], decision.effective)
            self._size(plan, body)
            for number in range(1, (decision.effective if plan.emulated else 1) + 1):
                await self._reserve(plan, number, now)
        except (PolicyDenied, RateLimited) as exc:
            await self.abandon(plan)  # a fan-out admitted in part gives its holds back
            await self._deny(plan, chain[0], exc)
            raise
        plan.quota_scope = self.budgets.quota_scope
        m.child(m.requests, caller.workload_id, "allow", decision.policy_reason).inc()
        return plan

    def _decide(self, caller: Caller, body: dict[str, Any], now: datetime) -> Decision:
        temperature = body.get("temperature")
        return decide(
            workload_id=caller.workload_id,
            workload=self.config.workloads[caller.workload_id],
            exceptions=self.config.exceptions,
            limits=self.config.limits,
            requested=body.get("n"),
            temperature=float(temperature) if temperature is not None else None,
            max_completion_tokens=body.get("max_completion_tokens"),
            max_tokens=body.get("max_tokens"),
            now=now,
        )

    def _plan(
        self,
        request_id: str,
        caller: Caller,
        alias: str,
        body: dict[str, Any],
        chain: Sequence[RouteRuntime],
        decision: Decision,
        now: datetime,
    ) -> Plan:
        stream = bool(body.get("stream"))
        options = body.get("stream_options") or {}
        return Plan(
            request_id=request_id,
            caller=caller,
            alias=alias,
            decision=decision,
            reservation=Reservation(0, 0, 0),
            usable_routes=list(chain[:1]),
            stream=stream,
            client_wants_usage=bool(options.get("include_usage")),
            timestamp=now,
            started=time.monotonic(),
        )

    def _usable_routes(
        self, chain: Sequence[RouteRuntime], n: int, now: datetime
    ) -> list[RouteRuntime]:
        """The primary must accept n (else the request is denied); fallbacks that do
        not approve the same count are dropped for this request."""
        if n == 1:
            return list(chain)  # every route serves one candidate; no contract needed
        primary = chain[0]
        check_route(
            primary.route.contract, primary.id, n, now=now, expected_fingerprint=_print(primary)
        )
        fallbacks = [
            rt
            for rt in chain[1:]
            if fallback_allowed(
                rt.route.contract, rt.id, n, now=now, expected_fingerprint=_print(rt)
            )
            and candidates_mode(rt.route.contract, n) == "native"
        ]
        return [primary, *fallbacks]

    def _size(self, plan: Plan, body: dict[str, Any]) -> None:
        """The request's reservation, and what each of its attempts holds (a fan-out
        branch holds one prefill and one ceiling; together they hold the whole)."""
        plan.reservation = self._reserve_size(body, plan.usable_routes, plan.decision)
        plan.attempt_reservation = plan.reservation
        if plan.emulated:
            k = plan.decision.effective
            branch = plan.reservation
            plan.attempt_reservation = Reservation(
                branch.input_tokens // k, branch.output_tokens // k, -(-branch.cost_micros // k)
            )

    @staticmethod
    def _reserve_size(
        body: dict[str, Any], routes: Sequence[RouteRuntime], decision: Decision
    ) -> Reservation:
        """Sized for the dearest route the request may end up on (fallbacks included)."""
        estimate = estimate_input_tokens(
            body.get("messages") or [],
            tools=body.get("tools"),
            functions=body.get("functions"),
            response_format=body.get("response_format"),
        )
        sizes = [
            reservation_for(
                estimated_input_tokens=estimate,
                effective_n=decision.effective,
                per_candidate_ceiling=decision.per_candidate_ceiling,
                output_cap=rt.route.contract.output_cap,
                candidates_mode=candidates_mode(rt.route.contract, decision.effective),
                pricing=rt.route.pricing,
            )
            for rt in routes
        ]
        return max(sizes, key=lambda r: (r.cost_micros, r.total_tokens))

    def _windows(self, caller: Caller, decision: Decision) -> BudgetWindows:
        """The workload's windows with its engaged exception's; config is frozen, so each
        pair is converted (USD to micro-USD) once."""
        key = (caller.workload_id, decision.exception_id)
        windows = self._window_cache.get(key)
        if windows is None:
            grant = next((e for e in self.config.exceptions if e.id == key[1]), None)
            workload = self.config.workloads[caller.workload_id]
            windows = self._window_cache[key] = BudgetWindows.for_workload(workload, grant)
        return windows

    async def _deny(self, plan: Plan, primary: RouteRuntime, error: NcapError) -> None:
        reason = str(error.code)
        event = self._row(plan, 0, primary, state="denied")
        event = replace(event, policy_result="deny", policy_reason=reason, reserved_cost_micros=0)
        await self.ledger.append(event)
        self.metrics.requests.labels(plan.caller.workload_id, "deny", reason).inc()

    # -- attempts ----------------------------------------------------------------------

    async def _reserve(self, plan: Plan, number: int, now: datetime) -> None:
        size = plan.attempt_reservation
        plan.holds[number] = await self.budgets.reserve(
            plan.caller.workload_id,
            self._windows(plan.caller, plan.decision),
            Amounts(size.total_tokens, size.cost_micros),
            exception_id=plan.decision.exception_id,
            now=now,
            hold_id=hold_id_for(plan.request_id, number),
        )
        self.metrics.reservations_outstanding.inc()

    async def attempt_started(self, plan: Plan, number: int, rt: RouteRuntime) -> None:
        """Write the attempt's reserved row; every attempt after the first needs a
        reservation of its own (the previous one was settled, kept or released)."""
        if number not in plan.holds:
            await self._reserve(plan, number, self.clock())
        event = self._row(plan, number, rt, state="reserved")
        plan.rows[number] = event
        await self.ledger.append(event)

    async def attempt_answered(
        self, plan: Plan, number: int, rt: RouteRuntime, report: AttemptReport, started: float
    ) -> None:
        await self._finish(plan, number, rt, report, "completed", started)

    async def stream_finished(
        self, plan: Plan, number: int, rt: RouteRuntime, report: AttemptReport, started: float
    ) -> None:
        outcome: AttemptOutcome = "completed" if report.cut is None else "stream_cut"
        await self._finish(plan, number, rt, report, outcome, started)

    async def attempt_failed(
        self, plan: Plan, number: int, rt: RouteRuntime, failure: AttemptFailed, started: float
    ) -> None:
        outcome = _failure_outcome(failure)
        report = AttemptReport(failure.provider_request_id, 0, {}, None, plan.stream, None)
        await self._finish(plan, number, rt, report, outcome, started)

    async def abandon(self, plan: Plan) -> None:
        """Release the holds no dispatched attempt is using (the request ended early)."""
        while plan.holds:
            _, hold = plan.holds.popitem()
            await self.budgets.release(hold)
            self.metrics.reservations_outstanding.dec()

    async def _finish(
        self,
        plan: Plan,
        number: int,
        rt: RouteRuntime,
        report: AttemptReport,
        outcome: AttemptOutcome,
        started: float,
    ) -> None:
        usage = report.usage
        settlement = settle(
            effective_n=plan.candidates_per_attempt,
            returned_n=report.returned if outcome != "rejected" else 0,
            usage_present=_usage_complete(usage),
            stream=report.stream,
            outcome=outcome,
        )
        row = plan.rows.get(number) or self._row(plan, number, rt, state="reserved")
        final = _usage_fields(usage, rt.route.pricing) if settlement.state == "settled" else {}
        if outcome == "rejected":
            final = dict(_NOTHING_USED)
        final.update(
            provider_request_id=report.provider_request_id,
            returned_candidate_count=report.returned if outcome != "rejected" else 0,
            finish_reasons=report.finish_reasons,
            usage_source=_usage_source(usage, report.stream),
            state=settlement.state,
            reconciliation_reason=settlement.reconciliation_reason,
            latency_ms=round((time.monotonic() - started) * 1000, 3),
        )
        # the hold first: once the row shows its final state, the budget does too
        await self._settle_hold(plan, number, final, outcome, settlement.holds_reservation)
        await self.ledger.update(row.request_id, row.attempt, **final)
        self._observe(rt, final, outcome, started)

    async def _settle_hold(
        self, plan: Plan, number: int, final: dict[str, Any], outcome: AttemptOutcome, holds: bool
    ) -> None:
        hold = plan.holds.pop(number, None)
        if hold is None:
            return
        if outcome == "rejected":
            await self.budgets.release(hold)  # a refusal generated nothing
        elif holds:
            await self.budgets.keep(hold)
            return  # still outstanding until reconciled
        else:
            tokens, cost = final.get("total_tokens") or 0, final.get("cost_micros") or 0
            await self.budgets.settle(hold, tokens, cost)
        self.metrics.reservations_outstanding.dec()

    def _observe(
        self, rt: RouteRuntime, final: dict[str, Any], outcome: AttemptOutcome, started: float
    ) -> None:
        m = self.metrics
        m.child(m.attempts, rt.id, outcome).inc()
        m.child(m.upstream_latency, rt.id).observe(time.monotonic() - started)
        if final.get("input_tokens"):
            m.child(m.tokens, rt.id, "in").inc(final["input_tokens"])
        if final.get("output_tokens_total"):
            m.child(m.tokens, rt.id, "out").inc(final["output_tokens_total"])
        if final["state"] in ("pending", "usage_reconciliation_required"):
            m.pending_reconciliation.inc()

    def _row(self, plan: Plan, number: int, rt: RouteRuntime, *, state: Any) -> LedgerEvent:
        d, r = plan.decision, plan.attempt_reservation
        return LedgerEvent(
            timestamp=self.clock(),
            request_id=plan.request_id,
            attempt=number,
            workload_id=plan.caller.workload_id,
            environment=plan.caller.environment,
            route_id=rt.id,
            model_alias=plan.alias,
            upstream_model=rt.route.upstream_model or plan.alias,
            requested_candidate_count=d.requested,
            effective_candidate_count=d.effective,
            exception_id=d.exception_id,
            reserved_input_tokens=r.input_tokens,
            reserved_output_tokens=r.output_tokens,
            reserved_cost_micros=r.cost_micros,
            stream_mode=plan.stream,
            quota_scope=plan.quota_scope,
            policy_result=d.policy_result,
            policy_reason=d.policy_reason,
            state=state,
            gateway_instance=self.instance,
        )


def _emulated(rt: RouteRuntime, n: int) -> bool:
    """Whether the route serves n by fan-out (k single-candidate requests)."""
    return candidates_mode(rt.route.contract, n) == "emulate"


@lru_cache(maxsize=256)
def _fingerprint(provider: str, upstream_model: str | None) -> Fingerprint:
    return Fingerprint(
        provider=provider, upstream_model=upstream_model, gateway_version=__version__
    )


def _print(rt: RouteRuntime) -> Fingerprint:
    """What a contract record must have been verified for to still hold."""
    return _fingerprint(rt.route.provider, rt.route.upstream_model)


def _failure_outcome(failure: AttemptFailed) -> AttemptOutcome:
    """429/503 and other 4xx refusals generated nothing; anything else may have."""
    if failure.kind == "status" and failure.status is not None:
        if failure.status in (429, 503) or 400 <= failure.status < 500:
            return "rejected"
        return "upstream_error"
    if failure.kind == "connection" and not failure.dispatched:
        return "rejected"
    return {"timeout": "timeout", "connection": "connection_error"}.get(
        failure.kind, "upstream_error"
    )  # type: ignore[return-value]


def _usage_complete(usage: SummaryUsage | None) -> bool:
    return (
        usage is not None
        and usage.prompt_tokens is not None
        and (usage.completion_tokens is not None)
    )


def _usage_fields(usage: SummaryUsage | None, pricing: Pricing) -> dict[str, Any]:
    if usage is None or usage.prompt_tokens is None or usage.completion_tokens is None:
        return {}
    cached = (usage.prompt_tokens_details and usage.prompt_tokens_details.cached_tokens) or 0
    reasoning = usage.completion_tokens_details and usage.completion_tokens_details.reasoning_tokens
    return {
        "input_tokens": usage.prompt_tokens,
        "cached_input_tokens": cached,
        "output_tokens_total": usage.completion_tokens,
        "reasoning_tokens": reasoning,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "cost_micros": cost_micros(usage.prompt_tokens, cached, usage.completion_tokens, pricing),
    }


def _usage_source(usage: SummaryUsage | None, stream: bool) -> Any:
    if usage is None:
        return "none"
    return "provider_stream" if stream else "provider_response"


_NOTHING_USED: dict[str, Any] = {
    "input_tokens": 0,
    "output_tokens_total": 0,
    "total_tokens": 0,
    "cost_micros": 0,
    "cached_input_tokens": 0,
}
