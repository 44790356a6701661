"""Pins found by mutation testing (docs/mutation.md) for the SQLite plumbing
(``ncap.stores.sqlite.connection``): a failed migration leaves the file as it was and raises its
own error, a file that cannot be opened fails the constructor, each job's savepoint
undoes only that job, and a closed writer says so and stops cleanly."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from ncap.stores.sqlite.connection import SQLiteWriter, connect, migrate, sqlite_version


def test_a_failed_migration_is_undone_whole_and_raises_its_own_error(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    conn = connect(path)
    migrations = [(1, "CREATE TABLE t (x INTEGER)"), (2, "CREATE TABLE u (y INTEGER); BAD SQL")]
    with pytest.raises(sqlite3.OperationalError, match=r'near "BAD": syntax error'):
        migrate(conn, migrations)
    assert not conn.in_transaction
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    conn.close()
    assert tables == set()  # not even schema_version: the whole run was one transaction
    assert sqlite_version(path) == 0


def test_migrations_run_in_order_once(tmp_path: Path) -> None:
    conn = connect(tmp_path / "m.db")
    migrations = [(2, "INSERT INTO t VALUES (2)"), (1, "CREATE TABLE t (x INTEGER);\n;  ;")]
    assert migrate(conn, migrations) == 2
    assert migrate(conn, migrations) == 2  # already applied: nothing runs again
    assert conn.execute("SELECT x FROM t").fetchall() == [(2,)]
    conn.close()


def test_a_file_that_cannot_be_opened_fails_the_writer_at_once(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(sqlite3.OperationalError):
        SQLiteWriter(tmp_path / "dir.db", [])


async def test_a_failing_job_undoes_only_its_own_statements(tmp_path: Path) -> None:
    writer = SQLiteWriter(tmp_path / "w.db", [(1, "CREATE TABLE t (x INTEGER UNIQUE)")])

    def two_then_fail(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO t VALUES (1)")
        conn.execute("INSERT INTO t VALUES (1)")  # UNIQUE: fails after the first insert

    def one(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO t VALUES (2)")
        return 2

    with pytest.raises(sqlite3.IntegrityError):
        await writer.run(two_then_fail)
    assert await writer.run(one) == 2
    rows = await writer.run(lambda conn: conn.execute("SELECT x FROM t").fetchall())
    assert rows == [(2,)]
    await writer.close()


async def test_a_closed_writer_says_so_and_its_thread_ends_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    errors: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    writer = SQLiteWriter(tmp_path / "w.db", [])
    await writer.run(lambda conn: conn.execute("SELECT 1").fetchone())
    await writer.close()
    await writer.close()  # twice is harmless
    assert errors == []
    with pytest.raises(RuntimeError, match=r"^SQLite store .*w\.db is closed$"):
        await writer.run(lambda conn: None)
