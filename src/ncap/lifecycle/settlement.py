"""The lifecycle's settlement service: where a closed attempt's store writes run.

The books (``ncap.lifecycle.settle``) close an attempt and work out its final row and
what happens to its hold; this service runs those writes, in the order "the hold,
then the row", and owns everything about *when*:

- ``run``: now, awaited by the lifecycle (a failed attempt, the end of a stream:
  their row is final before the client's error or last chunk);
- ``beside_answer``: a whole answer's closed attempts, queued as data and settled
  beside the answer. The first one queued in an event-loop iteration starts the
  tick's one batch task, so the holds are settled before the loop reads any request
  that arrives after the answer (a client at ``max_concurrency`` finds its slot
  free), and the answer never waits for the bookkeeping. The books settle the whole
  tick at once (``settles_with``: one budget call for the holds, one ledger call for
  the rows, so one transaction of the group commit), with no task or coroutine per
  request. The request's record (access line, span) is ended once its settlement is
  done (``on_request_settled``), so its tokens are known;
- ``Deferred``: writes a store refused, kept and retried with backoff until it is back.

The composition root creates one per app and stops it at shutdown, before the stores
close (``stop``: every queued settlement run, refused ones retried until a deadline).
The HTTP layer never drives it. A failure is logged without content and counted
(``ncap_bookkeeping_failures``); a crash before a settlement leaves the attempt's
``reserved`` row, which recovery finds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from ncap.errors import StoreUnavailable
from ncap.metrics import Metrics

__all__ = ["Deferred", "Settlement", "Steps"]

log = logging.getLogger("ncap.lifecycle")


class Settlement:
    """Runs settlements now, beside an answer (batched per loop tick), or later (a
    store refused them), and drains them all at shutdown."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        deferred: Deferred | None = None,
        on_request_settled: Callable[[str], None] | None = None,
    ) -> None:
        self._metrics = metrics
        self._deferred = deferred or Deferred()
        self._on_settled = on_request_settled
        self._queued: list[tuple[str, Any]] | None = None
        self._settle_tick: Callable[[list[tuple[str, Any]]], Awaitable[None]] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # now, awaited; kept for later when the store is unavailable (the deferred
        # queue's own ``run``, bound here: no coroutine layer of its own per settlement)
        self.run: Callable[[Steps], Awaitable[None]] = self._deferred.run

    @property
    def pending(self) -> int:
        """Settlements waiting for a store to answer again."""
        return self._deferred.pending

    def later(self, steps: Steps) -> None:
        """Once the store answers again (a write whose outcome is unknown)."""
        self._deferred.later(steps)

    def keep(self, steps: Steps, exc: StoreUnavailable | None) -> None:
        """What ``run`` does with steps a store refused (``exc``), or with any while
        others wait (``exc`` None): kept in order, retried until the store is back."""
        self._deferred._keep(steps, exc)

    def settles_with(self, settle_tick: Callable[[list[tuple[str, Any]]], Awaitable[None]]) -> None:
        """What settles a tick's whole answers, ``[(request_id, closed attempts)]`` (the
        books bind theirs); it counts each request's failure itself (``failed``)."""
        self._settle_tick = settle_tick

    def beside_answer(self, request_id: str, closed: Any) -> None:
        """Queue a whole answer's closed attempts: settled in the next loop iteration, in
        the tick's one batch, while the answer goes out."""
        if self._queued is None:
            self._queued = []
            task = asyncio.get_running_loop().create_task(self._run_batch())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._queued.append((request_id, closed))

    async def _run_batch(self) -> None:
        batch, self._queued = self._queued or [], None
        try:
            assert self._settle_tick is not None, "beside_answer needs settles_with first"
            await self._settle_tick(batch)
        except Exception as exc:
            self.failed(exc)
        finally:
            if self._on_settled is not None:
                for request_id, _ in batch:
                    self._on_settled(request_id)

    def failed(self, exc: Exception) -> None:
        """A settlement that failed for good: counted and logged (without content)."""
        self._metrics.bookkeeping_failures.inc()
        log.error("settlement failed: %s", type(exc).__name__)

    async def drain(self) -> None:
        """Every settlement queued so far run (tests, and the first step of ``stop``)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self, deadline_s: float = 0.0) -> int:
        """At shutdown, before the stores close: run everything queued, then retry the
        settlements a store refused until ``deadline_s``; returns how many are left
        (their rows stay ``reserved`` for recovery)."""
        await self.drain()
        return await self._deferred.close(deadline_s)


class Steps:
    """A settlement's store writes in order; a retry resumes at the first not done
    (each is safe to repeat: a settled hold is not settled twice, an update rewrites
    the same columns)."""

    def __init__(self, steps: list[Callable[[], Awaitable[None]]]) -> None:
        self._steps = steps

    async def step(self) -> None:
        """Run the first step not done yet."""
        if self._steps:
            await self._steps[0]()
            self._steps.pop(0)

    async def __call__(self) -> None:
        while self._steps:
            await self.step()


class Deferred:
    """Settlements a store refused, retried with backoff until the store is back.

    Without this, a settlement that met a Redis or PostgreSQL outage left its hold
    active and its row ``reserved`` under a live gateway (whose heartbeat goes on), so
    nothing ever swept them. At most ``max_pending`` wait (then the store error
    propagates, as before); one warning when the first is kept, one line when all are
    applied. The lifecycle does not wait for a kept settlement: the client's answer
    (or error) does not depend on it.
    """

    def __init__(
        self,
        *,
        max_pending: int = 10_000,
        first_delay_s: float = 0.1,
        max_delay_s: float = 5.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._pending: deque[Steps] = deque()
        self._task: asyncio.Task[None] | None = None
        self._max_pending = max_pending
        self._delays = (first_delay_s, max_delay_s)
        self._sleep = sleep

    @property
    def pending(self) -> int:
        return len(self._pending)

    def later(self, steps: Steps) -> None:
        """Queue writes that must wait for the store to answer again (never refused for
        the backlog: each stands for a row that would otherwise stay wrong)."""
        self._pending.append(steps)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._retry())

    async def run(self, steps: Steps) -> None:
        if self._pending:  # keep settlements in order behind the ones already waiting
            self._keep(steps, None)
            return
        try:
            await steps()
        except StoreUnavailable as exc:
            self._keep(steps, exc)

    def _keep(self, steps: Steps, exc: StoreUnavailable | None) -> None:
        if len(self._pending) >= self._max_pending:
            raise exc or StoreUnavailable("ledger or budgets", "store", "settlements backlog")
        if not self._pending and exc is not None:
            log.warning(
                "settlement deferred: the %s store (%s) is unavailable (%s); settlements "
                "are kept and retried until it is back",
                exc.store,
                exc.backend,
                exc.detail,
            )
        self._pending.append(steps)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._retry())

    async def _retry(self) -> None:
        delay, longest = self._delays
        while self._pending:
            await self._sleep(delay)
            try:
                while self._pending:
                    await self._pending[0]()
                    self._pending.popleft()
            except StoreUnavailable:
                delay = min(delay * 2, longest)
        log.warning("deferred settlements applied: the store is back")

    async def close(self, deadline_s: float = 0.0) -> int:
        """At shutdown: retry (with the same backoff) until ``deadline_s`` has passed;
        returns how many are left. Their rows stay ``reserved`` and their holds active
        for recovery to find: the caller keeps the instance registered, so a restart
        or a peer turns them into ``gateway_lost`` rows and kept holds."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        end = time.monotonic() + deadline_s
        delay, longest = self._delays
        while self._pending:
            try:
                while self._pending:
                    await self._pending[0]()
                    self._pending.popleft()
            except StoreUnavailable:
                if time.monotonic() + delay > end:
                    break
                await self._sleep(delay)
                delay = min(delay * 2, longest)
        if self._pending:
            log.error(
                "%d settlements not applied by the shutdown deadline: their rows stay "
                "reserved for recovery (a restart or a peer marks them gateway_lost)",
                self.pending,
            )
        return self.pending
