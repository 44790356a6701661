"""The instance registry in the ledger's PostgreSQL schema (``gateway_instances``, revision 2)."""

from __future__ import annotations

from ncap.stores.ports import (
    Identity,
    InstanceInfo,
)
from ncap.stores.postgres.pool import PostgresPool


class PostgresInstanceRegistry:
    """The ``gateway_instances`` table beside the PostgreSQL ledger; server time."""

    def __init__(self, pool: PostgresPool) -> None:
        self._pool = pool

    async def beat(self, me: Identity, timeout_s: float) -> None:
        await self._pool.execute(
            "INSERT INTO gateway_instances (instance, host, pid, pid_namespace, timeout_s)"
            " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (instance) DO UPDATE"
            " SET host = $2, pid = $3, pid_namespace = $4, beat_at = now(), timeout_s = $5",
            me.instance,
            me.host,
            me.pid,
            me.pid_namespace,
            timeout_s,
        )

    async def instances(self) -> list[InstanceInfo]:
        rows = await self._pool.fetch(
            "SELECT instance, host, pid, pid_namespace, timeout_s,"
            " EXTRACT(EPOCH FROM now() - beat_at)::float8 AS age FROM gateway_instances"
        )
        return [
            InstanceInfo(
                Identity(r["instance"], r["host"], r["pid"], r["pid_namespace"]),
                r["age"],
                r["timeout_s"],
            )
            for r in rows
        ]

    async def forget(self, instance: str) -> None:
        await self._pool.execute("DELETE FROM gateway_instances WHERE instance = $1", instance)
