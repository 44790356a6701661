"""The admin store of a ``memory://`` ledger: admin changes live as long as the process."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ncap.domain.grants import GrantChanges
from ncap.stores._admin import audit_detail, entry_json, grant_changes
from ncap.stores.ports import (
    AdminChange,
    AuditEntry,
    BudgetAlertRow,
    DuplicateGrant,
)


class MemoryAdminStore:
    """The admin store of a ``memory://`` ledger (nothing survives the process)."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], dict[str, Any] | None] = {}
        self._revoked: set[tuple[str, str]] = set()
        self._audit: list[AuditEntry] = []
        self._alerts: set[tuple[str, str, str, int]] = set()

    async def changes(self) -> GrantChanges:
        ended = [e.at for e in self._audit if e.kind == "session"]
        return grant_changes(
            [(k, i, b, (k, i) in self._revoked) for (k, i), b in self._rows.items()],
            self._revoked,
            max(ended, default=None),
        )

    async def record(self, change: AdminChange, at: datetime) -> None:
        key = (change.kind, change.target)
        if change.kind == "session":
            pass
        elif change.action == "create":
            if key in self._rows:
                raise DuplicateGrant(change.target)
            self._rows[key] = entry_json(change.entry)
        else:
            self._rows.setdefault(key, None)
            self._revoked.add(key)
        self._audit.append(
            AuditEntry(
                len(self._audit) + 1,
                at,
                change.actor,
                change.action,
                change.kind,
                change.target,
                audit_detail(change),
            )
        )

    async def audit(self, limit: int = 1000) -> list[AuditEntry]:
        return self._audit[-limit:]

    async def claim_alert(self, alert: BudgetAlertRow) -> bool:
        key = (alert.subject, alert.scope, alert.period, alert.threshold_pct)
        if key in self._alerts:
            return False
        self._alerts.add(key)
        return True

    async def mark_delivered(self, alert: BudgetAlertRow) -> None:
        return None

    async def close(self) -> None:
        return None
