"""The SQLite writer's inline commits (``synchronous=NORMAL``): a tick's batch commits
on the event loop's own thread, a batch that meets another process's write lock waits
in the writer thread without reordering later commits, and the writer thread
checkpoints the WAL the inline connection never checkpoints itself."""
# Also pinned: a job queued while a batch is in the thread waits behind it, then
# commits inline (a busy moment must not leave every later batch in the thread).

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

import ncap.stores.sqlite.connection as plumbing
from ncap.stores.sqlite.connection import SQLiteWriter, Synchronous

SCHEMA = [(1, "CREATE TABLE t (i INTEGER PRIMARY KEY, v TEXT NOT NULL)")]


def _insert(i: int, v: str = "x") -> Callable[[sqlite3.Connection], int]:
    def fn(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO t (i, v) VALUES (?, ?)", (i, v))
        return threading.get_ident()

    return fn


def _rows(path: Path) -> list[tuple[int, str]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT i, v FROM t ORDER BY i").fetchall()
    finally:
        conn.close()


async def test_normal_commits_on_the_loop_thread_full_in_the_writer_thread(
    tmp_path: Path,
) -> None:
    here = threading.get_ident()
    normal = SQLiteWriter(tmp_path / "n.db", SCHEMA, synchronous="NORMAL")
    full = SQLiteWriter(tmp_path / "f.db", SCHEMA, synchronous="FULL")
    try:
        assert normal.inline and not full.inline
        assert await normal.run(_insert(1)) == here
        assert await full.run(_insert(1)) != here
    finally:
        await normal.close()
        await full.close()
    # durable once awaited: another connection sees it
    assert _rows(tmp_path / "n.db") == [(1, "x")] == _rows(tmp_path / "f.db")


async def test_a_failing_job_fails_alone_inline(tmp_path: Path) -> None:
    writer = SQLiteWriter(tmp_path / "n.db", SCHEMA, synchronous="NORMAL")
    try:
        await writer.run(_insert(1))
        results = await asyncio.gather(
            writer.run(_insert(2)), writer.run(_insert(1)), return_exceptions=True
        )
    finally:
        await writer.close()
    assert isinstance(results[1], sqlite3.IntegrityError)
    assert _rows(tmp_path / "n.db") == [(1, "x"), (2, "x")]


async def test_a_locked_file_waits_in_the_thread_and_keeps_the_order(tmp_path: Path) -> None:
    path = tmp_path / "n.db"
    writer = SQLiteWriter(path, SCHEMA, synchronous="NORMAL")
    other = sqlite3.connect(path, isolation_level=None)
    try:
        await writer.run(_insert(1))
        other.execute("BEGIN IMMEDIATE")  # another process's write transaction
        first = asyncio.ensure_future(writer.run(_insert(2, "first")))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(writer.run(_insert(3, "second")))
        await asyncio.sleep(0.2)
        assert not first.done() and not second.done()  # waiting, not failed
        other.execute("UPDATE t SET v = 'other' WHERE i = 1")
        other.execute("COMMIT")
        ids = await asyncio.gather(first, second)
        # the first waited in the thread; the second waited on the loop behind it and
        # was then committed inline, after it
        assert ids[0] != threading.get_ident() and ids[1] == threading.get_ident()
        assert await writer.run(_insert(4)) == threading.get_ident()
    finally:
        other.close()
        await writer.close()
    assert _rows(path) == [(1, "other"), (2, "first"), (3, "second"), (4, "x")]


async def test_the_writer_thread_checkpoints_what_inline_commits_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plumbing, "CHECKPOINT_EVERY_S", 0.1)
    path = tmp_path / "n.db"
    writer = SQLiteWriter(path, SCHEMA, synchronous="NORMAL")
    try:
        await asyncio.gather(*(writer.run(_insert(i)) for i in range(1, 101)))
        copy = tmp_path / "main-file-only.db"
        shutil.copy(path, copy)  # the main file alone, without its -wal
        # the inline connection never checkpoints: not even the table is in the file
        with pytest.raises(sqlite3.OperationalError, match="no such table"):
            _rows(copy)
        await asyncio.sleep(0.6)
        shutil.copy(path, copy)
        assert len(_rows(copy)) == 100
    finally:
        await writer.close()


class _BrokenDisk:
    """A connection whose every statement fails as an I/O error would (not busy)."""

    def execute(self, sql: str, *args: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    def close(self) -> None:
        return None


async def test_a_non_busy_error_at_begin_fails_every_caller_inline(tmp_path: Path) -> None:
    """An I/O error at the inline BEGIN reaches every caller of the batch (it happens in
    a loop callback: raised there, nobody would ever resolve their futures)."""
    path = tmp_path / "n.db"
    writer = SQLiteWriter(path, SCHEMA, synchronous="NORMAL")
    try:
        await writer.run(_insert(1))
        assert writer._fast is not None
        writer._fast.close()
        writer._fast = _BrokenDisk()  # type: ignore[assignment]
        results = await asyncio.wait_for(
            asyncio.gather(writer.run(_insert(2)), writer.run(_insert(3)), return_exceptions=True),
            timeout=5,
        )
        writer._fast = None  # the next batch opens a working connection again
        await writer.run(_insert(4))
    finally:
        await writer.close()
    assert [str(r) for r in results] == ["disk I/O error"] * 2
    assert _rows(path) == [(1, "x"), (4, "x")]


# --- pins found by mutation testing (docs/mutation.md) ----------------------------


def _error(message: str, code: int | None = None) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError(message)
    if code is not None:
        exc.sqlite_errorcode = code  # as sqlite3 sets it on an error it raises
    return exc


@pytest.mark.parametrize(
    ("exc", "busy"),
    [
        # the primary result code decides, whatever the message says
        (_error("no words", sqlite3.SQLITE_BUSY), True),
        (_error("no words", 517), True),  # SQLITE_BUSY_SNAPSHOT, an extended code
        (_error("no words", sqlite3.SQLITE_LOCKED), True),
        (_error("no words", 262), True),  # SQLITE_LOCKED_SHAREDCACHE
        (_error("database is locked", sqlite3.SQLITE_ERROR), False),
        (_error("database is busy", sqlite3.SQLITE_READONLY), False),
        # without a code (an error built by hand): its message
        (_error("database is locked"), True),
        (_error("database table is busy"), True),
        (_error("disk I/O error"), False),
    ],
)
def test_is_busy_reads_the_primary_code_else_the_message(
    exc: sqlite3.OperationalError, busy: bool
) -> None:
    assert plumbing._is_busy(exc) is busy


class Interrupted(BaseException):
    """Not an ``Exception``: a job's own savepoint does not catch it."""


@pytest.mark.parametrize("synchronous", ["NORMAL", "FULL"])
async def test_an_interrupted_job_fails_its_whole_batch_rolled_back(
    tmp_path: Path, synchronous: plumbing.Synchronous
) -> None:
    path = tmp_path / "w.db"
    writer = SQLiteWriter(path, SCHEMA, synchronous=synchronous)

    def interrupted(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO t (i, v) VALUES (3, 'half')")
        raise Interrupted

    try:
        jobs = [asyncio.ensure_future(writer.run(f)) for f in (_insert(1), interrupted)]
        await asyncio.wait(jobs)
        assert all(isinstance(job.exception(), Interrupted) for job in jobs)  # raised
        # rolled back, the connection is clean: the next batch commits
        assert await writer.run(_insert(2)) is not None
    finally:
        await writer.close()
    assert _rows(path) == [(2, "x")]


async def test_a_failure_outside_the_jobs_reaches_every_caller_inline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "n.db"
    writer = SQLiteWriter(path, SCHEMA, synchronous="NORMAL")
    real = plumbing._commit

    def broken(conn: sqlite3.Connection, batch: list[Any], *, begun: bool = False) -> None:
        conn.execute("INSERT INTO t (i, v) VALUES (9, 'half')")
        raise Interrupted  # what _commit does not store on the jobs itself

    try:
        await writer.run(_insert(1))
        monkeypatch.setattr(plumbing, "_commit", broken)
        jobs = [asyncio.ensure_future(writer.run(_insert(i))) for i in (2, 3)]
        await asyncio.wait(jobs)
        assert all(isinstance(job.exception(), Interrupted) for job in jobs)  # raised
        monkeypatch.setattr(plumbing, "_commit", real)
        assert await writer.run(_insert(4)) == threading.get_ident()  # inline, clean
    finally:
        await writer.close()
    assert _rows(path) == [(1, "x"), (4, "x")]


@pytest.mark.parametrize(("synchronous", "inline"), [("FULL", True), ("NORMAL", False)])
async def test_inline_given_overrides_the_level(
    tmp_path: Path, synchronous: plumbing.Synchronous, inline: bool
) -> None:
    writer = SQLiteWriter(tmp_path / "w.db", SCHEMA, synchronous=synchronous, inline=inline)
    try:
        assert writer.inline is inline
        on_loop = await writer.run(_insert(1)) == threading.get_ident()
        level = await writer.run(lambda conn: conn.execute("PRAGMA synchronous").fetchone())
    finally:
        await writer.close()
    assert on_loop is inline
    # the connection that committed is at NORMAL: the writer thread's at the level
    # given, the loop's own always (an inline commit never fsyncs)
    assert level == (1,)


async def test_closing_inline_commits_what_is_queued_in_the_thread(tmp_path: Path) -> None:
    path = tmp_path / "n.db"
    writer = SQLiteWriter(path, SCHEMA, synchronous="NORMAL")
    await writer.run(_insert(1))
    last = asyncio.ensure_future(writer.run(_insert(2)))
    await asyncio.sleep(0)  # queued, its hand-over not run yet
    assert not last.done()
    await writer.close()
    assert last.done()  # committed before close returned
    assert last.result() != threading.get_ident()  # by the writer thread
    assert _rows(path) == [(1, "x"), (2, "x")]


def test_a_loop_closed_while_its_job_is_in_the_thread_leaves_the_writer_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    errors: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    path = tmp_path / "f.db"
    writer = SQLiteWriter(path, SCHEMA, synchronous="FULL")  # every batch in the thread
    started, release = threading.Event(), threading.Event()

    def slow(conn: sqlite3.Connection) -> int:
        started.set()
        release.wait(5)
        return _insert(1)(conn)

    gone = asyncio.new_event_loop()

    async def submit() -> asyncio.Future[int]:
        job = asyncio.ensure_future(writer.run(slow))
        assert await asyncio.to_thread(started.wait, 5)  # the job is in the thread
        job.cancel()  # its caller gives up, and its loop goes away
        return job

    job = gone.run_until_complete(submit())
    gone.run_until_complete(asyncio.sleep(0))
    assert job.cancelled()
    gone.close()
    release.set()  # the thread commits it and finds no loop to hand it back to

    async def later() -> int:
        try:
            return await asyncio.wait_for(writer.run(_insert(2)), 5)
        finally:
            await writer.close()

    assert asyncio.run(later()) != threading.get_ident()
    assert errors == []
    assert _rows(path) == [(1, "x"), (2, "x")]  # a job cancelled mid-batch is written


async def test_a_writer_by_default_commits_at_full_in_the_thread(tmp_path: Path) -> None:
    writer = SQLiteWriter(tmp_path / "w.db", SCHEMA)
    try:
        assert not writer.inline
        level = await writer.run(lambda conn: conn.execute("PRAGMA synchronous").fetchone())
        assert level == (2,)  # FULL: every commit fsyncs
    finally:
        await writer.close()


class _Refusing:
    """A connection whose every statement meets a lock (as a checkpoint can)."""

    def __init__(self) -> None:
        self.statements: list[str] = []

    def execute(self, sql: str) -> None:
        self.statements.append(sql)
        raise sqlite3.OperationalError("database is locked")


async def test_a_checkpoint_that_meets_a_lock_is_tried_again_next_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plumbing, "CHECKPOINT_EVERY_S", 0.02)
    writer = SQLiteWriter(tmp_path / "n.db", SCHEMA, synchronous="NORMAL")
    await writer.close()  # its thread gone: this test drives the idle wait itself
    conn = _Refusing()
    work = [object()]
    threading.Timer(0.3, writer._queue.put, (work,)).start()
    got = await asyncio.to_thread(writer._next, cast(sqlite3.Connection, conn))
    assert got is work  # the failed checkpoints did not end the wait
    assert len(conn.statements) >= 3  # one a period, each refused and tried again
    assert {sql.upper() for sql in conn.statements} == {"PRAGMA WAL_CHECKPOINT(PASSIVE)"}


async def test_a_full_writer_never_checkpoints_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plumbing, "CHECKPOINT_EVERY_S", 0.02)
    writer = SQLiteWriter(tmp_path / "f.db", SCHEMA, synchronous="FULL")
    await writer.close()
    conn = _Refusing()
    work = [object()]
    threading.Timer(0.2, writer._queue.put, (work,)).start()
    assert await asyncio.to_thread(writer._next, cast(sqlite3.Connection, conn)) is work
    assert conn.statements == []  # its commits checkpoint as SQLite does by itself


def _count_commits(writer: SQLiteWriter) -> list[int]:
    """The size of each batch the writer commits on the loop, in order."""
    sizes: list[int] = []
    commit = writer._commit_here

    def counted(batch: list[Any]) -> bool:
        sizes.append(len(batch))
        return commit(batch)

    writer._commit_here = counted  # type: ignore[method-assign]
    return sizes


async def test_a_write_that_rides_along_joins_the_next_commit_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "n.db"
    writer = SQLiteWriter(path, SCHEMA, synchronous="NORMAL")
    sizes = _count_commits(writer)
    try:
        settled = asyncio.ensure_future(writer.run(_insert(1), ride_along=True))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # two loop turns: a write asked for now would be committed
        assert not settled.done() and sizes == []
        await writer.run(_insert(2))  # a write a client waits for, a tick later
        await settled  # resumed after the write a client waits for
        assert sizes == [2]  # one commit for both (alone, it would have waited its bound)
    finally:
        await writer.close()
    assert _rows(path) == [(1, "x"), (2, "x")]


@pytest.mark.parametrize("synchronous", ["NORMAL", "FULL"])
async def test_a_write_a_client_waits_for_resumes_before_the_writes_that_rode_along(
    tmp_path: Path, synchronous: Synchronous
) -> None:
    """A settlement that rode along was queued first, yet the request whose row shares
    its commit goes on first: its caller dispatches upstream before the settlement's
    caller ends the earlier request's record, inline or back from the thread."""
    path = tmp_path / "n.db"
    writer = SQLiteWriter(path, SCHEMA, synchronous=synchronous)
    resumed: list[str] = []

    async def write(name: str, key: int, ride_along: bool) -> None:
        await writer.run(_insert(key), ride_along=ride_along)
        resumed.append(name)

    try:
        settled = asyncio.ensure_future(write("settlement", 1, True))
        await asyncio.sleep(0)
        await write("reserved row", 2, False)
        await settled
        assert resumed == ["reserved row", "settlement"]
    finally:
        await writer.close()
    assert _rows(path) == [(1, "x"), (2, "x")]


async def test_a_write_that_rides_along_alone_commits_after_its_bound(tmp_path: Path) -> None:
    path = tmp_path / "n.db"
    writer = SQLiteWriter(path, SCHEMA, synchronous="NORMAL")
    sizes = _count_commits(writer)
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        first = asyncio.ensure_future(writer.run(_insert(1), ride_along=True))
        second = asyncio.ensure_future(writer.run(_insert(2), ride_along=True))
        async with asyncio.timeout(2):  # never committed would hang here
            await asyncio.gather(first, second)
        waited = loop.time() - started
        assert sizes == [2]  # one commit, by the one timer the first armed
        assert plumbing.RIDE_ALONG_S * 0.9 <= waited < plumbing.RIDE_ALONG_S + 0.5
    finally:
        await writer.close()
    assert _rows(path) == [(1, "x"), (2, "x")]


async def test_closing_commits_a_write_still_riding_along(tmp_path: Path) -> None:
    path = tmp_path / "n.db"
    writer = SQLiteWriter(path, SCHEMA, synchronous="NORMAL")
    settled = asyncio.ensure_future(writer.run(_insert(1), ride_along=True))
    await asyncio.sleep(0)
    await writer.close()
    assert settled.done() and settled.exception() is None
    assert _rows(path) == [(1, "x")]
