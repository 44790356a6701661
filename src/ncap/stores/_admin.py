"""What every admin store shares: the audit detail of a change, the grants read back from the
rows, and the text form of a stamp."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ncap.config import ExceptionGrant, KeyEntry
from ncap.domain.grants import GrantChanges
from ncap.stores.ports import (
    AdminChange,
)


def entry_json(entry: ExceptionGrant | KeyEntry | None) -> dict[str, Any]:
    return entry.model_dump(mode="json") if entry is not None else {}


def audit_detail(change: AdminChange) -> dict[str, Any]:
    """The audit row's detail: the entry, and the name the request claimed, if any."""
    detail = entry_json(change.entry)
    if change.claimed_by is not None:
        detail["claimed_actor"] = change.claimed_by
    return detail


def grant_changes(
    rows: list[tuple[str, str, dict[str, Any] | None, bool]],
    revoked: set[tuple[str, str]],
    sessions_ended_at: datetime | None = None,
) -> GrantChanges:
    live = [(k, b) for k, _, b, r in rows if b and not r]
    return GrantChanges(
        sessions_ended_at=sessions_ended_at,
        exceptions=tuple(ExceptionGrant.model_validate(b) for k, b in live if k == "exception"),
        keys=tuple(KeyEntry.model_validate(b) for k, b in live if k == "key"),
        revoked_exceptions=frozenset(i for k, i in revoked if k == "exception"),
        revoked_keys=frozenset(i for k, i in revoked if k == "key"),
    )


def text_stamp(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
