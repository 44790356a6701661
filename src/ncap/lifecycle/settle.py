"""The books of one request: budget holds and ledger rows, attempt by attempt.

1. ``reserve``: an attempt's hold, admitted atomically against every budget window.
   With budgets on another server (Redis), the first attempt's hold and its
   ``reserved`` row are written at once (``reserve_beside_row``): two round trips
   overlapped, and a refused reservation turns that row into the request's denial.
2. ``begin``: the attempt's ``reserved`` row is durable before dispatch; the ``Attempt``
   it returns is then closed exactly once:
3. ``answered`` / ``answered_beside`` / ``stream_finished`` / ``failed``: the row gets
   the provider's usage and its final state (``final_row``); the hold is settled with
   actuals, kept (usage unknown: held until reconciled), or, for an upstream refusal
   that generated nothing, released (a refusal that reported usage, Gemini's blocked
   prompt, is settled at that usage). The store writes run on the settlement service
   (``ncap.lifecycle.settlement``): awaited, or beside a whole answer.
4. ``abandon``: a request that ends with holds no closed attempt took releases them.

A ledger failure is never swallowed: awaited, it propagates and the client gets an
error; beside an answer, it is logged and counted (``ncap_bookkeeping_failures``).

Each upstream failure (a failed attempt, a stream the upstream cut) and each budget
exhaustion is logged here, once, as one sanitized line on ``ncap.lifecycle``: request
id, workload, route, status and a reason from a closed set, never content (route
health, ``ncap.lifecycle.health``, keeps metrics only, so no failure is logged twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import msgspec
from msgspec.structs import replace

from ncap.config import Config, ExceptionGrant
from ncap.domain.budget import Amounts, BudgetWindows
from ncap.domain.events import AttemptOutcome, EventState, LedgerEvent
from ncap.domain.grants import Grants
from ncap.domain.policy import Decision
from ncap.errors import NcapError, StoreUnavailable
from ncap.lifecycle.failures import classify, ledger_outcome, reported_usage
from ncap.lifecycle.final_row import (
    NOTHING_GENERATED,
    candidate_count,
    denied_columns,
    final_columns,
)
from ncap.lifecycle.plan import Attempt, AttemptReport, Caller, Holds, Plan, RouteRuntime
from ncap.lifecycle.settlement import Settlement, Steps
from ncap.metrics import Metrics
from ncap.providers.base import AttemptFailed
from ncap.stores import backend_name
from ncap.stores.ports import (
    BudgetStore,
    DuplicateAttempt,
    Hold,
    LedgerStore,
    Settle,
    hold_id_for,
)

__all__ = ["Accounting", "AttemptObserver"]

log = logging.getLogger("ncap.lifecycle")


class AttemptObserver(Protocol):
    """Told when an attempt's row is final (``attempt`` None: a denial, no attempt)."""

    def attempt_closed(
        self, plan: Plan, attempt: Attempt | None, final: Mapping[str, Any], outcome: str
    ) -> None: ...


class AttemptStartObserver(Protocol):
    """Told when an attempt begins, before its upstream request (traces open its span
    and may set ``Attempt.trace``)."""

    def attempt_begun(self, attempt: Attempt) -> None: ...


log = logging.getLogger("ncap.lifecycle")


class Accounting:
    """The ledger and the budgets, as the lifecycle uses them (and their readiness and
    shutdown, which the composition root drives). Recovering a dead gateway's rows and
    holds is not here: ``stores.PeerWatch`` does it, knowing which instances are alive
    (an earlier ``start()`` marked every instance's rows lost, live peers' included)."""

    def __init__(
        self,
        config: Config,
        ledger: LedgerStore,
        budgets: BudgetStore,
        *,
        instance: str,
        metrics: Metrics,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        grants: Grants | None = None,
        observers: Sequence[AttemptObserver] = (),
        start_observers: Sequence[AttemptStartObserver] = (),
        settlement: Settlement | None = None,
    ) -> None:
        self.config = config
        # exceptions and keys in force (the admin API changes them without a restart)
        self.grants = grants or Grants.from_config(config)
        self.observers = tuple(observers)
        # told when an attempt begins (traces); none unless telemetry is on
        self.start_observers = tuple(start_observers)
        self.ledger = ledger
        self.budgets = budgets
        self.instance = instance
        self.metrics = metrics
        self.clock = clock
        self._window_cache: dict[tuple[str, ExceptionGrant | None], BudgetWindows] = {}
        # where the closed attempts' store writes run (the composition root stops it)
        self.settlement = settlement or Settlement(metrics)
        self.settlement.settles_with(self._settle_tick)
        # a reservation that is a round trip to another server is sent beside the row
        self.row_beside_reserve = budgets.round_trip

    # -- lifecycle of the stores -------------------------------------------------------

    async def close(self) -> None:
        """The stores closed, once the settlement service ran what it still had."""
        await self.settlement.stop()
        await self.ledger.close()
        await self.budgets.close()

    async def check_ready(self) -> dict[str, dict[str, Any]]:
        """Each store answers a cheap read: per store, its backend (the URL's scheme),
        whether it answered, and the error's class when it did not (never a message,
        which could name a host or a credential)."""
        stores = self.config.stores
        probes = (
            ("ledger", stores.ledger, self.ledger.get("readyz-probe")),
            ("budgets", stores.budgets, self.budgets.usage(next(iter(self.config.workloads)))),
        )
        report: dict[str, dict[str, Any]] = {}
        for name, url, probe in probes:
            entry: dict[str, Any] = {"backend": backend_name(url), "ready": True}
            try:
                await probe
            except Exception as exc:  # readiness reports any failure, whatever its type
                error = exc.detail if isinstance(exc, StoreUnavailable) and exc.detail else None
                entry.update(ready=False, error=error or type(exc).__name__)
            report[name] = entry
        return report

    # -- holds -------------------------------------------------------------------------

    async def reserve(
        self, plan: Plan, holds: Holds, number: int, *, at: datetime | None = None
    ) -> None:
        """Attempt ``number``'s hold, charged to the windows of ``at`` (the admission's
        instant for the holds taken at admission; now for a retry's)."""
        size = plan.attempt_reservation
        holds[number] = await self.budgets.reserve(
            plan.caller.workload_id,
            self._windows(plan.caller, plan.decision),
            Amounts(size.total_tokens, size.cost_micros),
            exception_id=plan.decision.exception_id,
            now=at or self.clock(),
            hold_id=hold_id_for(plan.request_id, number),
        )
        self.metrics.reservations_outstanding.inc()

    async def reserve_beside_row(
        self, plan: Plan, holds: Holds
    ) -> tuple[LedgerEvent, BaseException | None]:
        """The first attempt's hold and its ``reserved`` row, sent together: with budgets
        on Redis and the ledger on PostgreSQL (or SQLite) the two round trips overlap
        instead of adding up. Both are done before dispatch, as ever. A ledger failure
        gives the hold back and is raised; otherwise the row and the reservation's
        refusal, if any (the row is written either way, and the caller turns it into
        the request's record: ``deny`` or ``void``)."""
        row = self.row(plan, 1, plan.usable_routes[0], state="reserved", at=plan.timestamp)
        reserved, written = await asyncio.gather(
            self.reserve(plan, holds, 1, at=plan.timestamp),
            self.ledger.append_reserved(row),
            return_exceptions=True,
        )
        if isinstance(written, BaseException):
            await self.abandon(holds)
            if isinstance(written, StoreUnavailable):
                self.void_later(row)
            raise written
        return row, reserved if isinstance(reserved, BaseException) else None

    def void_later(self, row: LedgerEvent) -> None:
        """A ``reserved`` row whose write failed (a timeout, a partition): the client is
        told nothing was sent, yet the write may still reach the server and commit
        once the network heals. Once the ledger answers again, the attempt is recorded
        as refused (``denied``/``store_unavailable``, nothing held), whichever lands
        first: written as denied if the late row never came (which then meets this one
        and is dropped as a duplicate), else the late row turned into that denial."""
        denied = replace(row, **_VOIDED)

        async def step() -> None:
            try:
                await self.ledger.append(denied)
            except DuplicateAttempt:
                with contextlib.suppress(KeyError):
                    await self.ledger.update(row.request_id, row.attempt, **_VOIDED)

        self.settlement.later(Steps([step]))

    async def void(self, row: LedgerEvent, error: BaseException) -> None:
        """A row written beside a reservation that failed for another reason than policy
        (the budget store down: the client gets 503): it records a refused request, not
        an attempt, and holds nothing. If the ledger fails too, it is closed once the
        ledger answers again (``void_later``)."""
        reason = str(error.code) if isinstance(error, NcapError) else "store_unavailable"
        try:
            await self.ledger.update(
                row.request_id,
                row.attempt,
                state="denied",
                policy_result="deny",
                policy_reason=reason,
                reserved_cost_micros=0,
            )
        except Exception as exc:
            log.error(
                "refused request's row not closed: request=%s reason=%s error=%s",
                row.request_id,
                reason,
                type(exc).__name__,
            )
            if isinstance(exc, StoreUnavailable):
                self.void_later(row)  # closed once the ledger answers again

    def give_back_later(self, request_id: str, holds: Holds, unsure: int) -> None:
        """A reservation the budget store failed to answer (a timeout, a dropped
        connection, counters lost and not rebuilt in time): the client gets 503, yet
        attempt ``unsure``'s hold may exist (the store applied the call and its reply was
        lost, or the store rebuilt it from the ledger while the attempt's row still read
        ``reserved``), and ``holds`` are the ones admitted before it. All are released
        once the store answers (after the row's own close: a rebuild that reads the
        closed row restores no hold); releasing a hold that does not exist changes
        nothing."""
        admitted = list(holds.values())
        holds.clear()
        unknown = hold_id_for(request_id, unsure)

        async def release() -> None:
            while admitted:
                await self.budgets.release(admitted[-1])
                admitted.pop()
                self.metrics.reservations_outstanding.dec()
            await self.budgets.release(unknown)

        self.settlement.later(Steps([release]))

    async def abandon(self, holds: Holds) -> None:
        """Release the holds no dispatched attempt is using (the request ended early)."""
        while holds:
            _, hold = holds.popitem()
            await self.budgets.release(hold)
            self.metrics.reservations_outstanding.dec()

    def _windows(self, caller: Caller, decision: Decision) -> BudgetWindows:
        """The workload's windows with its engaged exception's; grants are frozen values,
        so each pair is converted (USD to micro-USD) once."""
        grant = self.grants.exception(decision.exception_id)
        key = (caller.workload_id, grant)
        windows = self._window_cache.get(key)
        if windows is None:
            workload = self.config.workloads[caller.workload_id]
            windows = self._window_cache[key] = BudgetWindows.for_workload(workload, grant)
        return windows

    # -- rows --------------------------------------------------------------------------

    async def deny(
        self,
        plan: Plan,
        primary: RouteRuntime,
        error: NcapError,
        *,
        written: LedgerEvent | None = None,
    ) -> None:
        """The one ``denied`` row of a request refused before any upstream call, with
        what refused it (``denied_*``) and the budget store's real scope: attempt 0, or
        the ``written`` row (attempt 1) turned into it when the reservation was sent
        beside its row (``reserve_beside_row``)."""
        number = 0 if written is None else written.attempt
        event = replace(
            self.row(plan, number, primary, state="denied"),
            policy_result="deny",
            policy_reason=str(error.code),
            reserved_cost_micros=0,
            quota_scope=self.budgets.quota_scope,
            **denied_columns(error.refusal, plan),
        )
        await self.record_denial(event, plan, written=written is not None)

    async def record_denial(
        self, event: LedgerEvent, plan: Plan | None = None, *, written: bool = False
    ) -> None:
        """Write a denial row (or turn the request's ``written`` reserved row into it),
        count it, and log a budget exhaustion."""
        if written:
            changes = {name: getattr(event, name) for name in _DENIAL_COLUMNS}
            await self.ledger.update(event.request_id, event.attempt, **changes)
        else:
            await self.ledger.append(event)
        workload, reason = event.workload_id, event.policy_reason
        self.metrics.requests.labels(workload, "deny", reason).inc()
        if reason == "budget_exhausted":
            window = event.denied_by or "unknown"
            self.metrics.budget_exhausted(workload, window)
            log.warning(
                "budget exhausted: request=%s workload=%s route=%s status=429 "
                "reason=budget_exhausted window=%s limit=%s needed=%s",
                event.request_id,
                workload,
                event.route_id,
                window,
                event.denied_limit,
                event.denied_amount,
            )
        if plan is not None:  # a refused field has no plan: nothing to observe
            final = {"state": "denied", "policy_reason": reason, "denied_by": event.denied_by}
            self._notify(plan, None, final, "denied")

    async def deny_field(
        self,
        request_id: str,
        caller: Caller,
        body: Mapping[str, Any],
        field: str,
        chain: Sequence[RouteRuntime],
    ) -> None:
        """The denial row of a body refused for an unknown field that could ask for
        several choices (``best_of``, ``candidate_count``, …): the operator's search for
        such callers is one ledger query. Nothing the client wrote is recorded beyond
        the field's name (from a fixed set), an alias the config knows and ``n``."""
        primary = chain[0] if chain else None
        alias = str(body["model"]) if primary else None
        requested = candidate_count(body.get("n"))
        event = LedgerEvent(
            timestamp=self.clock(),
            request_id=request_id,
            attempt=0,
            workload_id=caller.workload_id,
            environment=caller.environment,
            route_id=primary.id if primary else None,
            model_alias=alias,
            upstream_model=(primary.route.upstream_model or alias) if primary else None,
            requested_candidate_count=requested,
            effective_candidate_count=requested or 1,
            stream_mode=body.get("stream") is True,
            quota_scope=self.quota_scope,
            policy_result="deny",
            policy_reason="unknown_multi_candidate_field",
            state="denied",
            gateway_instance=self.instance,
            denied_by=field,
            client_retry_count=caller.client_retry_count,
        )
        await self.record_denial(event)

    @property
    def quota_scope(self) -> str:
        """Where the budget counters live (every row records it)."""
        return self.budgets.quota_scope

    def row(
        self,
        plan: Plan,
        number: int,
        rt: RouteRuntime,
        *,
        state: EventState,
        at: datetime | None = None,
    ) -> LedgerEvent:
        """Attempt ``number``'s row, stamped ``at`` (the admission's instant for the first
        attempt, which its hold shares) or now."""
        d, r = plan.decision, plan.attempt_reservation
        return LedgerEvent(
            timestamp=at or self.clock(),
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
            client_retry_count=plan.caller.client_retry_count,
        )

    # -- one attempt: begun, then closed exactly once ---------------------------------

    async def begin(self, plan: Plan, holds: Holds, number: int, rt: RouteRuntime) -> Attempt:
        """Write the attempt's reserved row (the first attempt's may be written already,
        beside its reservation); every attempt after the first needs a reservation of
        its own (the previous one was settled, kept or released)."""
        row = holds.first_row
        if number != 1 or row is None or row.route_id != rt.id:
            if number not in holds:
                await self.reserve(plan, holds, number)
            at = plan.timestamp if number == 1 else None  # dispatched as it was admitted
            row = self.row(plan, number, rt, state="reserved", at=at)
            try:
                await self.ledger.append_reserved(row)
            except StoreUnavailable:
                self.void_later(row)  # it may still commit: recorded as refused then
                raise
        attempt = Attempt(plan, holds, number, rt, holds[number], row, time.monotonic())
        for observer in self.start_observers:
            try:
                observer.attempt_begun(attempt)
            except Exception as exc:  # an observer's bug must not fail the request
                log.error("attempt observer failed: %s", type(exc).__name__)
        return attempt

    async def answered(self, attempt: Attempt, report: AttemptReport) -> None:
        await self._close(attempt, report, "completed")

    def answered_beside(self, answered: Sequence[tuple[Attempt, AttemptReport]]) -> None:
        """Whole answers (one, or a fan-out's branches): the attempts are closed now and
        their settlement is handed to the settlement service, which runs it beside the
        answer, holds first: a client at ``max_concurrency`` that sends its next request
        as soon as it has the answer finds its slot free. The reserved rows are
        durable already, so a crash in between leaves them for recovery."""
        closings = [self._closing(a, r, "completed", None) for a, r in answered]
        self.settlement.beside_answer(closings[0].attempt.plan.request_id, closings)

    async def answered_together(self, answered: Sequence[tuple[Attempt, AttemptReport]]) -> None:
        """``answered_beside``, awaited now (a fan-out that fails after some branches
        answered: they were paid, and are settled before the error goes out)."""
        await self._settle_answers([self._closing(a, r, "completed", None) for a, r in answered])

    async def _settle_tick(self, batch: list[tuple[str, list[_Closing]]]) -> None:
        """A loop tick's whole answers: every hold in one budget call, then every row in
        one ledger call, then each closing counted and observed. A store that is down
        (or was down a moment ago: settlements wait) keeps the closings in order for
        the deferred queue, each resuming where it stopped; any other failure settles
        the tick again request by request, so that it stays that request's own."""
        settlement = self.settlement
        if not settlement.pending:
            closings = [closing for _, group in batch for closing in group]
            try:
                await self._holds_together(closings)
                await self.ledger.update_many(
                    [(c.attempt.row.request_id, c.attempt.row.attempt, c.final) for c in closings]
                )
            except StoreUnavailable as exc:
                self._keep_for_later(closings, exc)
                return
            except Exception:
                pass  # settled again request by request, below: the failure is its own
            else:
                for closing in closings:
                    self._closed(closing)
                return
        for _, group in batch:
            try:
                await self._settle_answers(group)
            except Exception as exc:
                settlement.failed(exc)

    def _keep_for_later(self, closings: list[_Closing], exc: StoreUnavailable) -> None:
        """Closings a store refused: each kept in the deferred queue (resuming at its
        first step not done), then counted and observed."""
        settlement = self.settlement
        for closing in closings:
            try:
                settlement.keep(self._steps(closing), exc)
            except StoreUnavailable as full:  # the backlog is full: it fails, as `run`
                settlement.failed(full)
                continue
            self._closed(closing)

    async def _holds_together(self, closings: list[_Closing]) -> None:
        """The closings' holds: settled in one budget call (a hold kept or released, for
        an answer that lacks usage, on its own)."""
        settles: list[Settle] = []
        settled: list[_Closing] = []
        for closing in closings:
            if closing.hold is None or closing.hold_done:
                continue
            if _hold_action(closing.final, closing.outcome, closing.keeps) == "settle":
                settles.append((closing.hold, *_actuals(closing.final)))
                settled.append(closing)
            else:
                await self._hold_step(closing)
        if settles:
            await self.budgets.settle_many(settles)
            outstanding = self.metrics.reservations_outstanding
            for closing in settled:
                closing.hold_done = True
                outstanding.dec()

    async def _settle_answers(self, closings: list[_Closing]) -> None:
        """Every hold first, then each row in order; a failing settlement does not keep
        the others from running (the first failure is raised after them)."""
        # the holds run at once, even while earlier settlements wait for a store that
        # is down (the deferred queue keeps whole settlements in order): the slots
        # free now; only the rows wait their turn
        for closing in closings:
            # a failed hold step is not done: ``_finish`` runs it again (deferred while
            # its store is down) and a failure is reported there
            with contextlib.suppress(Exception):
                await self._hold_step(closing)
        failure: Exception | None = None
        for closing in closings:
            try:
                await self._finish(closing)
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    async def stream_finished(self, attempt: Attempt, report: AttemptReport) -> None:
        outcome: AttemptOutcome = "completed" if report.cut is None else "stream_cut"
        await self._close(attempt, report, outcome)
        if report.cut not in (None, "client_disconnect"):  # the upstream's doing
            _log_failure(attempt, None, str(report.cut), outcome)

    async def failed(self, attempt: Attempt, failure: AttemptFailed) -> None:
        # a refusal's own report (a blocked prompt's), or what a cancelled engine used
        usage = reported_usage(failure)
        unbilled = attempt.route.route.contract.error_responses == "unbilled"
        outcome = ledger_outcome(failure, unbilled_errors=unbilled)
        finish = {"cancelled": attempt.plan.expected_returned} if outcome == "cancelled" else {}
        report = AttemptReport(
            failure.provider_request_id, 0, finish, usage, attempt.plan.stream, None
        )
        await self._close(attempt, report, outcome, upstream_status=failure.status)
        _log_failure(attempt, failure.status, classify(failure, unbilled_errors=unbilled), outcome)

    async def _close(
        self,
        attempt: Attempt,
        report: AttemptReport,
        outcome: AttemptOutcome,
        *,
        upstream_status: int | None = None,
    ) -> None:
        # the hold first: once the row shows its final state, the budget does too
        await self._finish(self._closing(attempt, report, outcome, upstream_status))

    def _closing(
        self,
        attempt: Attempt,
        report: AttemptReport,
        outcome: AttemptOutcome,
        upstream_status: int | None,
    ) -> _Closing:
        """Close the attempt (exactly once) and work out its final row and hold step."""
        if attempt.closed:
            raise RuntimeError(f"attempt {attempt.number} closed twice")
        attempt.closed = True
        final, keeps = final_columns(attempt, report, outcome, now=time.monotonic())
        if upstream_status is not None:
            final["upstream_status"] = upstream_status
        hold = attempt.holds.pop(attempt.number, None)
        return _Closing(attempt, final, outcome, keeps, hold)

    async def _hold_step(self, closing: _Closing) -> None:
        """The closing's hold settled, kept or released (once: then it is done)."""
        if not closing.hold_done:
            await self._settle_hold(closing.hold, closing.final, closing.outcome, closing.keeps)
            closing.hold_done = True

    async def _row_step(self, closing: _Closing) -> None:
        row = closing.attempt.row
        await self.ledger.update(row.request_id, row.attempt, **closing.final)

    async def _finish(self, closing: _Closing) -> None:
        """Run the closing's store writes on the settlement service (``Settlement.run``:
        the hold, then the row; kept for later while a store is down), then count and
        tell the observers. Written out here for the common case, no store waiting:
        the steps object the deferred queue retries is only built when one is kept."""
        settlement = self.settlement
        if settlement.pending:  # behind the settlements already waiting
            settlement.keep(self._steps(closing), None)
        else:
            try:
                await self._hold_step(closing)
                await self._row_step(closing)
            except StoreUnavailable as exc:
                settlement.keep(self._steps(closing), exc)
        self._closed(closing)

    def _closed(self, closing: _Closing) -> None:
        """A closing whose writes are done (or kept for later): counted and observed."""
        self._observe(closing.attempt, closing.final, closing.outcome)
        self._notify(closing.attempt.plan, closing.attempt, closing.final, closing.outcome)

    def _steps(self, closing: _Closing) -> Steps:
        """What is left of the closing's writes, as the deferred queue retries them."""

        async def row_step() -> None:
            await self._row_step(closing)

        async def hold_step() -> None:
            await self._hold_step(closing)

        return Steps([row_step] if closing.hold_done else [hold_step, row_step])

    def _notify(
        self, plan: Plan, attempt: Attempt | None, final: Mapping[str, Any], outcome: str
    ) -> None:
        """Tell the observers (access log, traces, budget alerts) that a row is final;
        they never fail the request or its bookkeeping."""
        for observer in self.observers:
            try:
                observer.attempt_closed(plan, attempt, final, outcome)
            except Exception as exc:  # an observer's bug must not lose a settlement
                log.error("attempt observer failed: %s", type(exc).__name__)

    async def _settle_hold(
        self, hold: Hold | None, final: dict[str, Any], outcome: AttemptOutcome, keeps: bool
    ) -> None:
        if hold is None:
            return
        action = _hold_action(final, outcome, keeps)
        if action == "release":
            await self.budgets.release(hold)  # a refusal (or unbilled error) generated nothing
        elif action == "keep":
            await self.budgets.keep(hold)
            return  # still outstanding until reconciled
        else:
            await self.budgets.settle(hold, *_actuals(final))
        self.metrics.reservations_outstanding.dec()

    def _observe(self, attempt: Attempt, final: dict[str, Any], outcome: AttemptOutcome) -> None:
        """The closed attempt counted: its route's meters, its settled cost (once, here,
        where every attempt of this process is closed; a row another process settles,
        a reconciliation import, is not this process's spend), the reconciliation
        gauge and the candidates' evidence."""
        m = self.metrics
        meters = m.route_meters(attempt.route.id)
        meters.closed(
            outcome,
            time.monotonic() - attempt.started,
            final.get("input_tokens"),
            final.get("output_tokens_total"),
        )
        cost = final.get("cost_micros")
        if cost and cost > 0:
            meters.spent(attempt.plan.caller.workload_id, cost)
        if final["state"] in ("pending", "usage_reconciliation_required"):
            m.pending_reconciliation.inc()
        compared = final.get("candidates_compared")
        if compared:
            m.candidates(
                attempt.plan.caller.workload_id,
                compared,
                final["candidates_distinct"],
                final["candidates_majority"],
                final["candidates_tool_calls"],
            )


class _Closing(msgspec.Struct):
    """A closed attempt: its final row, and its hold and what happens to it (``keeps``:
    held until reconciled) until that is done."""

    attempt: Attempt
    final: dict[str, Any]
    outcome: AttemptOutcome
    keeps: bool
    hold: Hold | None
    hold_done: bool = False


# an attempt whose reserved row could not be written: refused, nothing held
_VOIDED: dict[str, Any] = {
    "state": "denied",
    "policy_result": "deny",
    "policy_reason": "store_unavailable",
    "reserved_cost_micros": 0,
    "reconciliation_reason": None,  # a sweep may have flagged it meanwhile
}

# what a denial changes on a reserved row written beside its refused reservation
_DENIAL_COLUMNS = (
    "state",
    "policy_result",
    "policy_reason",
    "reserved_cost_micros",
    "quota_scope",
    "denied_by",
    "denied_limit",
    "denied_amount",
)


def _hold_action(
    final: Mapping[str, Any], outcome: AttemptOutcome, keeps: bool
) -> Literal["release", "keep", "settle"]:
    """What a closed attempt's hold becomes: released (a refusal, or an unbilled error,
    that generated nothing), kept (usage unknown: held until reconciled) or settled."""
    if outcome in NOTHING_GENERATED and not final.get("total_tokens"):
        return "release"
    return "keep" if keeps else "settle"


def _actuals(final: Mapping[str, Any]) -> tuple[int, int]:
    """The tokens and cost a settled hold is charged (unknown counts as nothing)."""
    return final.get("total_tokens") or 0, final.get("cost_micros") or 0


def _log_failure(attempt: Attempt, status: int | None, reason: str, outcome: str) -> None:
    """One sanitized line per upstream failure; a 4xx about the request is INFO."""
    level = logging.INFO if reason in ("request_rejected", "other_4xx") else logging.WARNING
    log.log(
        level,
        "upstream failure: request=%s workload=%s route=%s attempt=%d status=%s "
        "reason=%s outcome=%s",
        attempt.plan.request_id,
        attempt.plan.caller.workload_id,
        attempt.route.id,
        attempt.number,
        status if status is not None else "-",
        reason,
        outcome,
    )
