"""The admin store's contract, memory, SQLite and PostgreSQL alike (``ncap.stores.admin``):
the changes it hands ``Grants`` (created, revoked, a config entry's tombstone), its audit
trail row by row, ids never reused, budget alerts claimed once. Found by mutation
testing (docs/mutation.md): only the admin API's HTTP tests reached this module. The
PostgreSQL store is also shared: two replicas on one schema race for an id and an
alert, and an unreachable server is ``StoreUnavailable`` (a 503 at the edge)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from ncap.config import ExceptionGrant, KeyEntry
from ncap.domain.grants import GrantChanges
from ncap.errors import ConfigError, StoreUnavailable
from ncap.stores import open_admin
from ncap.stores.memory.admin import MemoryAdminStore
from ncap.stores.ports import AdminChange, AdminStore, AuditEntry, BudgetAlertRow, DuplicateGrant
from ncap.stores.postgres.admin import PostgresAdminStore
from ncap.stores.postgres.pool import postgres_target
from ncap.stores.sqlite.admin import SQLiteAdminStore
from tests.services import pg_schema
from tests.stores.conftest import LEDGER_URLS, isolated

AT = datetime(2026, 12, 1, 9, 30, 15, 250_000, tzinfo=UTC)
GRANT = ExceptionGrant(
    id="eval", workload="w", owner="o", max_candidates=4, expires="2030-01-01T00:00:00Z"
)
KEY = KeyEntry(hash="sha256:" + "a" * 64, workload="w", label="ci")


@pytest.fixture(params=LEDGER_URLS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AdminStore]:
    """The admin store beside each ledger of the test matrix."""
    url, _ = request.param
    async with isolated(url, tmp_path) as own:
        made = open_admin(own)
        yield made
        await made.close()


@pytest.fixture
async def pg_url() -> AsyncIterator[str]:
    """A PostgreSQL ledger URL on a schema of its own (two stores on it: two replicas)."""
    async with pg_schema() as url:
        yield url


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
    assert entry.at == AT  # the same instant (SQLite stores it in UTC, memory as given,
    # PostgreSQL as a timestamptz)


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
    # replicas that had not yet read the first revoke revoke again, later
    await store.record(AdminChange("bob", "revoke", "exception", "cfg"), AT + timedelta(hours=3))
    await store.record(AdminChange("bob", "revoke", "exception", "eval"), AT + timedelta(hours=4))
    await store.close()
    with sqlite3.connect(tmp_path / "l.db") as conn:
        rows = conn.execute(
            "SELECT id, body IS NULL, created_at, revoked_at FROM admin_grants ORDER BY id"
        ).fetchall()
    assert rows == [
        ("cfg", 1, "2026-12-01T11:30:15.250000Z", "2026-12-01T11:30:15.250000Z"),
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
    beside = open_admin(f"sqlite:///{tmp_path}/x.db")
    assert isinstance(beside, SQLiteAdminStore) and beside.path == tmp_path / "x.db"
    with caplog.at_level(logging.WARNING, "ncap.admin"):
        assert isinstance(open_admin("memory://"), MemoryAdminStore)
        in_schema = open_admin("postgresql://h/db?schema=s1")
        default = open_admin("postgres://h/db")
    assert caplog.messages == []  # a PostgreSQL ledger has its admin tables now
    assert isinstance(in_schema, PostgresAdminStore) and isinstance(default, PostgresAdminStore)
    assert (in_schema.pool.dsn, in_schema.pool.schema) == ("postgresql://h/db", "s1")
    assert (default.pool.dsn, default.pool.schema) == ("postgresql://h/db", None)
    # its changes are durable at the server's own synchronous_commit (never "off")
    assert in_schema.pool.synchronous_commit is None


@pytest.mark.postgresql
async def test_postgres_keeps_everything_across_a_reopen_in_the_ledgers_schema(
    pg_url: str,
) -> None:
    first = PostgresAdminStore(pg_url)
    await first.record(_create(GRANT), AT)
    assert await first.claim_alert(_alert()) is True
    await first.mark_delivered(_alert())
    await first.close()
    await first.close()  # closing twice is harmless
    again = PostgresAdminStore(pg_url)
    try:
        assert await again.changes() == GrantChanges(exceptions=(GRANT,))
        assert await again.claim_alert(_alert()) is False
        (entry,) = await again.audit()
        assert (entry.seq, entry.at, entry.actor) == (1, AT, "alice")
    finally:
        await again.close()
    dsn, schema = postgres_target(pg_url)
    conn = await asyncpg.connect(dsn, server_settings={"search_path": schema or "public"})
    try:
        alerts = await conn.fetch(
            "SELECT subject, scope, period, threshold_pct, fired_at, spent_micros,"
            " limit_micros, delivered FROM budget_alerts"
        )
        grants = await conn.fetch("SELECT kind, id, body IS NULL, created_at FROM admin_grants")
        version = await conn.fetchval("SELECT MAX(version) FROM schema_version")
    finally:
        await conn.close()
    assert [tuple(r) for r in alerts] == [("w", "day", "2026-12-01", 80, AT, 8, 10, 1)]
    assert [tuple(r) for r in grants] == [("exception", "eval", False, AT)]
    assert version == 9  # the admin tables came with the ledger's own migrations (6)


@pytest.mark.postgresql
async def test_postgres_marks_only_the_alert_named_and_revokes_keep_sqlites_instants(
    pg_url: str,
) -> None:
    store = PostgresAdminStore(pg_url)
    try:
        for alert in (_alert(), _alert(100), _alert(subject="x"), _alert(period="2026-12-02")):
            await store.claim_alert(alert)
        await store.mark_delivered(_alert())
        await store.record(_create(GRANT), AT)
        later = [AT + timedelta(hours=h) for h in (1, 2, 3, 4)]
        await store.record(AdminChange("bob", "revoke", "exception", "eval"), later[0])
        await store.record(AdminChange("bob", "revoke", "exception", "cfg"), later[1])
        await store.record(AdminChange("bob", "revoke", "exception", "cfg"), later[2])
        await store.record(AdminChange("bob", "revoke", "exception", "eval"), later[3])
        delivered = await store.pool.fetch(
            "SELECT subject, scope, period, threshold_pct FROM budget_alerts WHERE delivered = 1"
        )
        grants = await store.pool.fetch(
            "SELECT id, body IS NULL, created_at, revoked_at FROM admin_grants ORDER BY id"
        )
    finally:
        await store.close()
    assert [tuple(r) for r in delivered] == [("w", "day", "2026-12-01", 80)]
    assert [tuple(r) for r in grants] == [  # as test_a_revoke_after_a_revoke_… on SQLite
        ("cfg", True, later[1], later[1]),
        ("eval", False, AT, later[0]),
    ]


@pytest.mark.postgresql
async def test_two_replicas_racing_for_one_id_one_wins_and_one_audit_row(pg_url: str) -> None:
    replicas = [PostgresAdminStore(pg_url) for _ in range(2)]
    try:
        results = await asyncio.gather(
            *(r.record(_create(GRANT, actor=f"r{i}"), AT) for i, r in enumerate(replicas)),
            return_exceptions=True,
        )
        assert sorted(type(r).__name__ for r in results) == ["DuplicateGrant", "NoneType"]
        winner = f"r{results.index(None)}"
        for replica in replicas:  # each sees the one entry and the one audit row
            assert await replica.changes() == GrantChanges(exceptions=(GRANT,))
            assert [(e.seq, e.actor) for e in await replica.audit()] == [(1, winner)]
    finally:
        for replica in replicas:
            await replica.close()


@pytest.mark.postgresql
async def test_an_alert_raced_by_two_replicas_is_claimed_once(pg_url: str) -> None:
    """What makes one replica (only) post each webhook: 20 alerts, each claimed by both
    replicas at once, are 20 wins in all, one per alert."""
    replicas = [PostgresAdminStore(pg_url) for _ in range(2)]
    try:
        for replica in replicas:  # both pools open (migrated) before the race
            await replica.audit()
        alerts = [_alert(threshold=t) for t in range(1, 21)]
        wins = await asyncio.gather(*(r.claim_alert(a) for a in alerts for r in replicas))
        per_alert = [wins[2 * i] + wins[2 * i + 1] for i in range(len(alerts))]
        assert per_alert == [1] * len(alerts)
        assert not any(await asyncio.gather(*(r.claim_alert(a) for a in alerts for r in replicas)))
    finally:
        for replica in replicas:
            await replica.close()


@pytest.mark.postgresql
async def test_an_unreachable_server_is_store_unavailable_naming_the_admin_store() -> None:
    from tests.servers import free_port

    store = PostgresAdminStore(f"postgresql://postgres@127.0.0.1:{free_port()}/none")
    calls = [
        store.changes(),
        store.record(_create(GRANT), AT),
        store.audit(),
        store.claim_alert(_alert()),
        store.mark_delivered(_alert()),
    ]
    for call in calls:
        with pytest.raises(StoreUnavailable) as refused:
            await call
        assert (refused.value.store, refused.value.backend, refused.value.status) == (
            "admin",
            "PostgreSQL",
            503,
        )
        assert "GET /admin/audit" in refused.value.message
    await store.close()


@pytest.mark.postgresql
async def test_the_report_reads_the_alerts_and_exceptions_of_a_postgresql_ledger(
    pg_url: str,
) -> None:
    """``reports/admin_tables`` was written for these tables before they existed on
    PostgreSQL; with migration 6 the report finds them."""
    from ncap.reports.admin_tables import admin_exceptions, budget_alerts
    from ncap.reports.model import Window
    from ncap.reports.source import PostgresSource

    store = PostgresAdminStore(pg_url)
    try:
        await store.record(_create(GRANT), AT)
        await store.claim_alert(_alert(100))
    finally:
        await store.close()

    def read() -> tuple[list[Any], list[ExceptionGrant]]:
        source = PostgresSource(pg_url)
        try:
            window = Window(AT - timedelta(hours=1), AT + timedelta(hours=1))
            return budget_alerts(source, window), admin_exceptions(source)
        finally:
            source.close()

    alerts, exceptions = await asyncio.to_thread(read)
    assert [(a.code, a.severity) for a in alerts] == [("budget_day_100", "critical")]
    assert "(webhook not delivered)" in alerts[0].message
    assert exceptions == [GRANT]


async def test_a_locked_sqlite_file_is_store_unavailable_naming_the_admin_store(
    tmp_path: Path,
) -> None:
    """Once open, a failure (here a write meeting another process's write lock past the
    busy timeout; WAL readers are not blocked) is a 503 ``store_unavailable``, as on
    PostgreSQL, not a configuration error; the store works again once the lock is gone."""
    store = SQLiteAdminStore(tmp_path / "l.db")
    await store.changes()
    store._connection().execute("PRAGMA busy_timeout = 50")  # not 10 s in a test
    other = sqlite3.connect(tmp_path / "l.db", isolation_level=None)
    try:
        other.execute("BEGIN EXCLUSIVE")
        for call in (store.record(_create(GRANT), AT), store.claim_alert(_alert())):
            with pytest.raises(StoreUnavailable) as refused:
                await call
            assert (refused.value.store, refused.value.backend, refused.value.status) == (
                "admin",
                "SQLite",
                503,
            )
        other.execute("ROLLBACK")
    finally:
        other.close()
    await store.record(_create(GRANT), AT)
    assert [g.id for g in (await store.changes()).exceptions] == [GRANT.id]
    await store.close()
