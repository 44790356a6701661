"""Recovery that knows its peers, and the sweeper of gateways that stopped beating.

At start-up a gateway registers in the shared instance registry *before* it writes
anything, then recovers only the instances that are certainly dead:

- its own earlier incarnation (an entry with its own instance id);
- a neighbour on the same host and PID namespace whose process is gone;
- any instance whose last heartbeat is older than its timeout.

A live peer — a second gateway started on the same files or databases — is left
alone: its ``reserved`` rows stay reserved and its holds keep their concurrency slots.

Recovering an instance turns its ``reserved`` rows into ``usage_reconciliation_required``
/ ``gateway_lost`` and its active holds into kept holds: the amounts stay counted
(never released as zero) until reconciliation settles them. While running, every
gateway beats every ``interval_s`` and sweeps the instances whose beat expired; the
steps are idempotent, so two sweepers racing on one dead peer count it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from ncap.config import utcnow
from ncap.errors import ConfigError, StoreUnavailable
from ncap.stores.ports import BudgetStore, Identity, InstanceInfo, InstanceRegistry, LedgerStore

__all__ = ["PeerWatch", "Recovered"]

log = logging.getLogger("ncap.lifecycle.peers")


@dataclass(frozen=True, slots=True)
class Recovered:
    instance: str
    rows: int
    holds: int


class PeerWatch:
    """Heartbeats for this gateway; recovery of the peers that died."""

    def __init__(
        self,
        registry: InstanceRegistry,
        ledger: LedgerStore,
        budgets: BudgetStore,
        me: Identity,
        *,
        interval_s: float = 2.0,
        timeout_s: float = 15.0,
        reserved_timeout_s: float | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        if timeout_s <= interval_s:
            raise ConfigError("the heartbeat timeout must be longer than its interval")
        self.registry = registry
        self.ledger = ledger
        self.budgets = budgets
        self.me = me
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.reserved_timeout_s = reserved_timeout_s
        self._clock = clock
        self.recovered: list[Recovered] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> list[Recovered]:
        """Register, recover the dead, then keep beating and sweeping in the background."""
        dead = self._dead(await self.registry.instances(), starting=True)
        await self.registry.beat(self.me, self.timeout_s)
        done = [await self.recover(instance) for instance in dead]
        self._task = asyncio.create_task(self._run())
        return done

    def _dead(self, infos: list[InstanceInfo], *, starting: bool) -> list[str]:
        dead = []
        for info in infos:
            if info.identity.instance != self.me.instance:
                if info.expired or info.dead_neighbour_of(self.me):
                    dead.append(info.identity.instance)
            elif starting:  # our own earlier incarnation, unless it is still running
                if info.live_twin_of(self.me):
                    raise ConfigError(
                        f"gateway instance id {self.me.instance!r} is in use by process "
                        f"{info.identity.pid} on this host; give each gateway its own id"
                    )
                dead.append(info.identity.instance)
        return dead

    async def recover(self, instance: str) -> Recovered:
        rows = await self.ledger.mark_lost(instance)
        holds = await self.budgets.recover_lost(instance)
        if instance != self.me.instance:
            await self.registry.forget(instance)
        done = Recovered(instance, rows, holds)
        if rows or holds:
            log.warning(
                "gateway %s was lost: %d row(s) now gateway_lost, %d hold(s) kept",
                instance,
                rows,
                holds,
            )
        self.recovered.append(done)
        return done

    async def sweep(self) -> list[Recovered]:
        """Beat, recover every peer whose heartbeat expired, then flag the rows left
        ``reserved`` past their attempt's time limit by anyone."""
        await self.registry.beat(self.me, self.timeout_s)
        dead = self._dead(await self.registry.instances(), starting=False)
        done = [await self.recover(instance) for instance in dead]
        await self.sweep_stale()
        return done

    async def sweep_stale(self) -> int:
        """``reserved`` rows older than ``reserved_timeout_s`` (a write that committed
        after its caller was told nothing was sent, a settlement that never came)
        become ``usage_reconciliation_required``/``reserved_timeout``: visible in
        ``ncap reconcile list``, never reserved for ever."""
        if self.reserved_timeout_s is None:
            return 0
        before = self._clock() - timedelta(seconds=self.reserved_timeout_s)
        rows = await self.ledger.mark_lost(None, before=before, reason="reserved_timeout")
        if rows:
            log.warning("%d row(s) left reserved past their time limit: now reserved_timeout", rows)
        return rows

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep()
            except StoreUnavailable as exc:  # the store is down: beat again next tick
                log.warning("heartbeat failed: %s store (%s) unavailable", exc.store, exc.backend)

    async def stop(self, *, leave: bool = True) -> None:
        """After the in-flight requests drained: stop beating and, with ``leave``, leave
        the registry (nothing to recover). A gateway stopping with work left (rows
        still ``reserved``) stays registered: its beat expires, and a peer's sweep or
        its own restart recovers those rows, as for a gateway that died."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if leave:
            with contextlib.suppress(StoreUnavailable):
                await self.registry.forget(self.me.instance)
