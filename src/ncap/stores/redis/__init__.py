"""Redis stores: the budgets every replica shares (``redis://…``, ``quota_scope=global``).

``?prefix=name`` namespaces the keys. The counters are a cache of the ledger, rebuilt
from it whenever Redis lost them; the ``Idempotency-Key`` records live beside them.
Redis keeps the server's time unless a clock is given (tests). The scripts: ``lua/``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ncap.stores.ports import Backend, BudgetHistory, BudgetSide, StoreOptions
from ncap.stores.redis.budgets import SCRIPT_VERSION, RedisBudgetStore
from ncap.stores.redis.idempotency import RedisIdempotency

__all__ = ["BACKEND"]


def open_budgets(url: str, options: StoreOptions, history: BudgetHistory | None) -> BudgetSide:
    budgets = RedisBudgetStore(
        url,
        gateway_instance=options.gateway_instance,
        clock=options.clock,
        history=history,
        connect_timeout_s=options.timeout_s,
        timeout_s=options.timeout_s,
        pool_timeout_s=options.timeout_s,
    )

    async def prepare(workloads: Iterable[str], warn: Callable[[str], None]) -> None:
        """Warn about server settings that lose counters, then rebuild them from the
        ledger when they were lost (or wait for a peer that is)."""
        for warning in await budgets.server_warnings():
            warn(warning)
        await budgets.ensure_counters(workloads)

    return BudgetSide(budgets, RedisIdempotency(budgets), prepare)


async def migrate(url: str, store: str) -> dict[str, object]:
    return {"backend": "redis", "version": SCRIPT_VERSION}


BACKEND = Backend("redis", shared=True, budgets=open_budgets, migrate=migrate)
