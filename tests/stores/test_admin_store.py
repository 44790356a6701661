"""The admin store's contract, memory and SQLite alike (``ncap.stores.admin``): the
changes it hands ``Grants`` (created, revoked, a config entry's tombstone), its audit
trail row by row, ids never reused, budget alerts claimed once. Found by mutation
testing (docs/mutation.md): only the admin API's HTTP tests reached this module."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from ncap.config import ExceptionGrant, KeyEntry
from ncap.domain.grants import GrantChanges
from ncap.errors import ConfigError
from ncap.stores.admin import (
    AdminChange,
    AdminStore,
    AuditEntry,
    BudgetAlertRow,
    DuplicateGrant,
    MemoryAdminStore,
    SQLiteAdminStore,
    admin_store_for_ledger,
)

AT = datetime(2026, 12, 1, 9, 30, 15, 250_000, tzinfo=UTC)
GRANT = ExceptionGrant(
    id="eval", workload="w", owner="o", max_candidates=4, expires="2030-01-01T00:00:00Z"
)
KEY = KeyEntry(hash="sha256:" + "a" * 64, workload="w", label="ci")


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AdminStore]:
    made: AdminStore = (
        MemoryAdminStore() if request.param == "memory" else SQLiteAdminStore(tmp_path / "l.db")
    )
    yield made
    await made.close()


def _create(entry: Any, kind: str = "exception", actor: str = "alice") -> AdminChange:
    return AdminChange(actor, "create", kind, entry.id if kind == "exception" else "k1", entry)  # type: ignore[arg-type]


async def test_changes_hold_what_was_created_and_what_was_revoked(store: AdminStore) -> None:
    assert await store.changes() == GrantChanges()
    await store.record(_create(GRANT), AT)
    await store.record(_create(KEY, "key"), AT + timedelta(seconds=1))
    assert await store.changes() == GrantChanges(exceptions=(GRANT,), keys=(KEY,))
    # revoking a config entry the store never created leaves a tombstone
    await store.record(AdminChange("bob", "revoke", "exception", "from-config"), AT)
    await store.record(AdminChange("bob", "revoke", "key", "k1"), AT + timedelta(seconds=2))
    assert await store.changes() == GrantChanges(
        exceptions=(GRANT,),
        revoked_exceptions=frozenset({"from-config"}),
        revoked_keys=frozenset({"k1"}),
    )
    await store.record(AdminChange("bob", "revoke", "exception", "eval"), AT)
    assert await store.changes() == GrantChanges(
        revoked_exceptions=frozenset({"from-config", "eval"}), revoked_keys=frozenset({"k1"})
    )


async def test_an_id_is_never_reused(store: AdminStore) -> None:
    await store.record(_create(GRANT), AT)
    await store.record(AdminChange("bob", "revoke", "exception", "eval"), AT)
    with pytest.raises(DuplicateGrant, match=r"^eval$"):
        await store.record(_create(GRANT), AT)
    assert len(await store.audit()) == 2  # the refused change left no audit row
    # the same id as another kind is another entry
    await store.record(AdminChange("alice", "create", "key", "eval", KEY), AT)


async def test_the_audit_trail_row_by_row(store: AdminStore) -> None:
    await store.record(_create(GRANT), AT)
    await store.record(AdminChange("bob", "revoke", "key", "k9"), AT + timedelta(minutes=1))
    first, second = await store.audit()
    assert first == AuditEntry(
        1, AT, "alice", "create", "exception", "eval", GRANT.model_dump(mode="json")
    )
    assert second == AuditEntry(2, AT + timedelta(minutes=1), "bob", "revoke", "key", "k9", {})
    assert await store.audit(limit=1) == [second]  # the newest, oldest first
    assert await store.audit(limit=5) == [first, second]


async def test_the_audit_keeps_the_instant_whatever_its_zone(store: AdminStore) -> None:
    local = AT.astimezone(timezone(timedelta(hours=9)))
    await store.record(_create(GRANT), local)
    (entry,) = await store.audit()
    assert entry.at == AT  # the same instant (SQLite stores it in UTC, memory as given)


def _alert(threshold: int = 80, **kw: Any) -> BudgetAlertRow:
    fields: dict[str, Any] = {
        "subject": "w",
        "scope": "day",
        "period": "2026-12-01",
        "threshold_pct": threshold,
        "fired_at": AT,
        "spent_micros": 8,
        "limit_micros": 10,
    }
    return BudgetAlertRow(**(fields | kw))


async def test_the_audit_returns_the_newest_thousand_by_default(store: AdminStore) -> None:
    for i in range(1001):
        await store.record(AdminChange("a", "revoke", "key", f"k{i}"), AT)
    entries = await store.audit()
    assert (len(entries), entries[0].seq, entries[-1].seq) == (1000, 2, 1001)


@pytest.fixture
def tokyo() -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    yield
    mp.undo()
    time.tzset()


async def test_sqlite_stamps_are_utc_whatever_the_local_zone(tmp_path: Path, tokyo: None) -> None:
    store = SQLiteAdminStore(tmp_path / "l.db")
    await store.record(_create(GRANT), AT)
    await store.close()
    with sqlite3.connect(tmp_path / "l.db") as conn:
        assert conn.execute("SELECT at FROM admin_audit").fetchall() == [
            ("2026-12-01T09:30:15.250000Z",)
        ]


async def test_an_alert_is_claimed_once_per_subject_scope_period_and_threshold(
    store: AdminStore,
) -> None:
    assert await store.claim_alert(_alert()) is True
    assert await store.claim_alert(_alert(spent_micros=9)) is False
    assert await store.claim_alert(_alert(100)) is True
    assert await store.claim_alert(_alert(subject="x")) is True
    assert await store.claim_alert(_alert(scope="month")) is True
    assert await store.claim_alert(_alert(period="2026-12-02")) is True
    await store.mark_delivered(_alert())


async def test_sqlite_keeps_everything_across_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "two" / "levels" / "ledger.db"
    first = SQLiteAdminStore(path)
    await first.record(_create(GRANT), AT)
    assert await first.claim_alert(_alert()) is True
    await first.mark_delivered(_alert())
    await first.close()
    await first.close()  # closing twice is harmless
    again = SQLiteAdminStore(path)
    assert await again.changes() == GrantChanges(exceptions=(GRANT,))
    assert await again.claim_alert(_alert()) is False
    (entry,) = await again.audit()
    assert (entry.seq, entry.at, entry.actor) == (1, AT, "alice")
    await again.close()
    with sqlite3.connect(path) as conn:
        row = conn.execute(
            "SELECT subject, scope, period, threshold_pct, fired_at, spent_micros, limit_micros,"
            " delivered FROM budget_alerts"
        ).fetchone()
        stamps = conn.execute("SELECT at FROM admin_audit").fetchall()
        created = conn.execute("SELECT created_at FROM admin_grants").fetchall()
        mode = conn.execute("PRAGMA journal_mode").fetchone()
    assert row == ("w", "day", "2026-12-01", 80, "2026-12-01T09:30:15.250000Z", 8, 10, 1)
    assert stamps == created == [("2026-12-01T09:30:15.250000Z",)]
    assert mode == ("wal",)


async def test_sqlite_marks_only_the_alert_named(tmp_path: Path) -> None:
    store = SQLiteAdminStore(tmp_path / "l.db")
    for alert in (
        _alert(),
        _alert(100),
        _alert(subject="x"),
        _alert(scope="month"),
        _alert(period="2026-12-02"),
    ):
        await store.claim_alert(alert)
    await store.mark_delivered(_alert())
    await store.close()
    with sqlite3.connect(tmp_path / "l.db") as conn:
        delivered = conn.execute(
            "SELECT subject, scope, period, threshold_pct FROM budget_alerts WHERE delivered = 1"
        ).fetchall()
    assert delivered == [("w", "day", "2026-12-01", 80)]


async def test_a_revoke_after_a_revoke_keeps_the_first_instant(tmp_path: Path) -> None:
    store = SQLiteAdminStore(tmp_path / "l.db")
    await store.record(_create(GRANT), AT)
    await store.record(AdminChange("bob", "revoke", "exception", "eval"), AT + timedelta(hours=1))
    await store.record(AdminChange("bob", "revoke", "exception", "cfg"), AT + timedelta(hours=2))
    await store.record(AdminChange("bob", "revoke", "exception", "cfg"), AT + timedelta(hours=3))
    await store.close()
    with sqlite3.connect(tmp_path / "l.db") as conn:
        rows = conn.execute(
            "SELECT id, body IS NULL, created_at, revoked_at FROM admin_grants ORDER BY id"
        ).fetchall()
    assert rows == [
        ("cfg", 1, "2026-12-01T11:30:15.250000Z", "2026-12-01T12:30:15.250000Z"),
        ("eval", 0, "2026-12-01T09:30:15.250000Z", "2026-12-01T10:30:15.250000Z"),
    ]


async def test_a_database_error_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()  # not a file sqlite can open
    store = SQLiteAdminStore(tmp_path / "dir.db")
    with pytest.raises(ConfigError, match=r"^admin tables in .*dir\.db: "):
        await store.changes()


def test_the_admin_store_beside_each_ledger(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    beside = admin_store_for_ledger("sqlite:///x.db", tmp_path / "x.db")
    assert isinstance(beside, SQLiteAdminStore) and beside.path == tmp_path / "x.db"
    with caplog.at_level(logging.WARNING, "ncap.admin"):
        assert isinstance(admin_store_for_ledger("memory://", None), MemoryAdminStore)
        assert caplog.messages == []
        assert isinstance(admin_store_for_ledger("postgresql://h/db", None), MemoryAdminStore)
    assert caplog.messages == [
        "admin changes are kept in memory only: no admin tables for this ledger yet"
    ]
