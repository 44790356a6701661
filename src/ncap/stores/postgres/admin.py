"""The admin tables in the ledger's PostgreSQL database (revision 6 of
``postgres/migrations/``): a small pool of its own on the ledger's URL, at the server's own
``synchronous_commit`` (a committed revocation survives a server crash)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import asyncpg

from ncap.domain.grants import GrantChanges
from ncap.stores._admin import audit_detail, entry_json, grant_changes
from ncap.stores.ports import (
    AdminChange,
    AuditEntry,
    BudgetAlertRow,
    DuplicateGrant,
)
from ncap.stores.postgres.pool import PostgresPool, mapped


class PostgresAdminStore:
    """The admin tables beside the PostgreSQL ledger, shared by every replica: an id is
    refused (``DuplicateGrant``) whichever replica used it first, and an alert is
    claimed by one replica only (``INSERT … ON CONFLICT DO NOTHING`` on its key)."""

    def __init__(self, url: str) -> None:
        # a small pool of its own; the server's synchronous_commit (module docstring)
        self.pool = PostgresPool(url, store="admin", max_size=2)

    async def changes(self) -> GrantChanges:
        rows = await self.pool.fetch(
            "SELECT kind, id, body, revoked_at IS NOT NULL AS revoked FROM admin_grants"
            " ORDER BY created_at, kind, id"
        )
        parsed = [
            (r["kind"], r["id"], json.loads(r["body"]) if r["body"] else None, r["revoked"])
            for r in rows
        ]
        ended = await self.pool.fetch(
            "SELECT max(at) AS at FROM admin_audit WHERE kind = 'session'"
        )
        return grant_changes(parsed, {(k, i) for k, i, _, r in parsed if r}, ended[0]["at"])

    async def record(self, change: AdminChange, at: datetime) -> None:
        body = json.dumps(entry_json(change.entry), sort_keys=True)
        detail = json.dumps(audit_detail(change), sort_keys=True)
        pool = await self.pool.get()
        with mapped("admin"):
            async with pool.acquire() as conn, conn.transaction():
                await _write_pg_grant(conn, change, body, at)
                await conn.execute(
                    "INSERT INTO admin_audit (at, actor, action, kind, target, detail)"
                    " VALUES ($1, $2, $3, $4, $5, $6)",
                    at,
                    change.actor,
                    change.action,
                    change.kind,
                    change.target,
                    detail,
                )

    async def audit(self, limit: int = 1000) -> list[AuditEntry]:
        rows = await self.pool.fetch(
            "SELECT seq, at, actor, action, kind, target, detail FROM admin_audit"
            " ORDER BY seq DESC LIMIT $1",
            limit,
        )
        return [
            AuditEntry(
                r["seq"],
                r["at"],
                r["actor"],
                r["action"],
                r["kind"],
                r["target"],
                json.loads(r["detail"]),
            )
            for r in reversed(rows)
        ]

    async def claim_alert(self, alert: BudgetAlertRow) -> bool:
        status = await self.pool.execute(
            "INSERT INTO budget_alerts (subject, scope, period, threshold_pct, fired_at,"
            " spent_micros, limit_micros) VALUES ($1, $2, $3, $4, $5, $6, $7)"
            " ON CONFLICT DO NOTHING",
            alert.subject,
            alert.scope,
            alert.period,
            alert.threshold_pct,
            alert.fired_at,
            alert.spent_micros,
            alert.limit_micros,
        )
        return status == "INSERT 0 1"

    async def mark_delivered(self, alert: BudgetAlertRow) -> None:
        await self.pool.execute(
            "UPDATE budget_alerts SET delivered = 1 WHERE subject = $1 AND scope = $2"
            " AND period = $3 AND threshold_pct = $4",
            alert.subject,
            alert.scope,
            alert.period,
            alert.threshold_pct,
        )

    async def close(self) -> None:
        await self.pool.close()


async def _write_pg_grant(
    conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy[Any],
    change: AdminChange,
    detail: str,
    at: datetime,
) -> None:
    """``_write_grant`` on PostgreSQL. A create that meets the id (committed by any
    replica, or being written by one: the insert waits for it) writes nothing."""
    if change.kind == "session":
        return  # a sign-out is its audit row alone
    if change.action == "create":
        created = await conn.fetchval(
            "INSERT INTO admin_grants (kind, id, body, created_at) VALUES ($1, $2, $3, $4)"
            " ON CONFLICT (kind, id) DO NOTHING RETURNING true",
            change.kind,
            change.target,
            detail,
            at,
        )
        if not created:
            raise DuplicateGrant(change.target)  # the transaction rolls back: no audit row
        return
    status = await conn.execute(
        "UPDATE admin_grants SET revoked_at = $1 WHERE kind = $2 AND id = $3"
        " AND revoked_at IS NULL",
        at,
        change.kind,
        change.target,
    )
    if status == "UPDATE 0":  # a tombstone, or revoked already: the first instant stays
        await conn.execute(
            "INSERT INTO admin_grants (kind, id, body, created_at, revoked_at)"
            " VALUES ($1, $2, NULL, $3, $3) ON CONFLICT (kind, id) DO NOTHING",
            change.kind,
            change.target,
            at,
        )
