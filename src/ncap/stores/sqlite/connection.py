"""SQLite plumbing shared by the ledger and the budgets: group commit, reads, migrations.

GROUP COMMIT. One writer thread owns the write connection. Callers queue operations
(``fn(conn) -> T``); the thread takes everything queued (up to ``max_batch``), runs
each in its own SAVEPOINT inside one ``BEGIN IMMEDIATE`` transaction, commits once,
and only then resolves every caller's future. An awaited write is therefore durable
(per the ``synchronous`` level) while the hot path pays one commit per *batch*, not
per request. An operation that raises is rolled back to its savepoint and fails
alone; a failed COMMIT fails every operation of the batch. Nothing is swallowed.

ONE HAND-OFF EACH WAY PER LOOP TICK. Operations queued during one event-loop
iteration go to the writer thread as one list (one queue put, one thread wake-up),
and after the commit the writer hands the whole batch's outcomes back in one
``call_soon_threadsafe`` (one self-pipe write), instead of one each way per operation
as ``queue.put`` + ``asyncio.wrap_future`` would: under load a batch of 50 writes
costs the loop two cross-thread hand-offs, not 100. (So ``run`` is for one event
loop at a time, the way a store belongs to one app.)

ON THE LOOP WHEN NOTHING WAITS FOR A DISK. At ``synchronous=NORMAL`` a commit is a
few writes into the WAL in the OS's page cache, no fsync: tens of microseconds, less
than the two cross-thread hand-offs (a futex wake-up each way, and the wait for the
GIL behind a busy loop) it would otherwise cost. So at ``NORMAL`` (``inline``) the
batch of a tick is committed on the event loop's thread itself, on a connection of
its own that never waits for a lock (``busy_timeout = 0``) and never checkpoints. The
writer thread stays, for what may wait: a batch that met a lock another process
holds (the CLI, a heartbeat, a second gateway on the same file) goes to it and
waits there with the usual busy timeout; what is queued meanwhile waits on the loop
until that batch is back and is then committed inline again, so the order of commits
never changes and one busy moment does not leave every later batch in the thread.
And the thread checkpoints the WAL once a second when idle (``PASSIVE``: it never
blocks the writer), the fsync of a checkpoint staying off the loop. At ``FULL``
every batch goes through the thread (its commit fsyncs).

Durability: WAL with ``synchronous=FULL`` fsyncs the WAL at every commit, so an
acknowledged write survives power loss; ``NORMAL`` (the ledger's default, see
``stores.ledger_durability``) writes the WAL to the OS at every commit without an
fsync: it survives a killed process (kill -9, OOM) but an OS crash or power loss may
drop the last commits (never corrupt the file).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

__all__ = ["Migration", "SQLiteReader", "SQLiteWriter", "migrate", "sqlite_version"]

T = TypeVar("T")
Synchronous = Literal["FULL", "NORMAL"]
Migration = tuple[int, str]

BUSY_TIMEOUT_MS = 10_000
CHECKPOINT_EVERY_S = 1.0  # the writer thread's PASSIVE checkpoint of an inline WAL
# the longest a write that nobody is waiting on may wait for another write's commit
RIDE_ALONG_S = 0.005
_STOP = object()


@dataclass(slots=True)
class _Job:
    fn: Callable[[sqlite3.Connection], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    # one statement is atomic by itself; several need a savepoint to fail alone
    single_statement: bool = False
    # nobody waits for it on a client's behalf (``SQLiteWriter.run``)
    ride_along: bool = False
    outcome: tuple[bool, Any] = (False, None)


# the adapter of None (see ``connect``): it must return None, and a C callable does so
# without a Python frame per parameter; an empty dict's ``get`` answers None for any key
_NO_ENTRIES: dict[None, None] = {}
_BIND_NONE: Callable[[None], None] = _NO_ENTRIES.get


def connect(path: Path, *, synchronous: Synchronous = "FULL") -> sqlite3.Connection:
    """A connection in WAL mode with explicit transactions (autocommit driver mode).

    Also registers an adapter for ``None`` (process-wide, idempotent): CPython's
    ``sqlite3`` binds int, float, str and bytes directly but looks every other
    parameter up in its adapter table, and on a miss asks the protocol type for
    ``__adapt__`` (an ``AttributeError`` with a formatted message, raised and
    discarded) and the value for ``__conform__``. A ledger row binds about twenty
    ``None`` s; with the adapter found, each costs one dict hit and a call, and still
    binds as NULL.
    """
    sqlite3.register_adapter(type(None), _BIND_NONE)
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    return conn


def migrate(conn: sqlite3.Connection, migrations: Sequence[Migration]) -> int:
    """Apply the migrations newer than the file's ``schema_version``; returns the version."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_version ("
            " version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL DEFAULT (datetime('now')))"
        )
        row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()
        current = int(row[0])
        for version, script in sorted(migrations):
            if version > current:
                for statement in filter(str.strip, script.split(";")):
                    conn.execute(statement)
                conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
                current = version
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return current


def sqlite_version(path: Path) -> int:
    """The schema revision a database file is at (0: never migrated)."""
    conn = sqlite3.connect(path)
    try:
        row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()
        return int(row[0])
    except sqlite3.OperationalError:
        return 0
    finally:
        conn.close()


class SQLiteWriter:
    """The single writer of one database file in this process (group commit)."""

    def __init__(
        self,
        path: Path,
        migrations: Sequence[Migration],
        *,
        synchronous: Synchronous = "FULL",
        max_batch: int = 512,
        inline: bool | None = None,
    ) -> None:
        self.path = path
        self._max_batch = max_batch
        # commit on the loop (see the module docstring); by default at NORMAL only
        self.inline = synchronous == "NORMAL" if inline is None else inline
        self._fast: sqlite3.Connection | None = None  # the loop's own connection
        self._in_thread = 0  # batches handed to the thread and not yet back
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: list[_Job] = []  # queued in this loop tick, not yet handed over
        # the loop a hand-over is scheduled on (a loop that died first is replaced)
        self._scheduled_on: asyncio.AbstractEventLoop | None = None
        # the hand-over of writes that ride along, when no other write asked for one,
        # and its loop (a loop that died first is replaced)
        self._ride_timer: asyncio.TimerHandle | None = None
        self._ride_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._ready: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._main, args=(migrations, synchronous), name=f"ncap-sqlite:{path.name}"
        )
        self._thread.daemon = True
        self._thread.start()
        self._ready.result()  # re-raises a failure to open or migrate the file

    async def run(
        self,
        fn: Callable[[sqlite3.Connection], T],
        *,
        single_statement: bool = False,
        ride_along: bool = False,
    ) -> T:
        """Run ``fn`` in the next group transaction; returns once that has committed.

        ``single_statement`` skips the savepoint: a lone statement that fails is
        already undone by SQLite without touching the rest of the batch.

        ``ride_along``: nobody waits for this write on a client's behalf (a whole
        answer's settlement, written beside the answer), so it joins the next commit
        another write asks for, or commits on its own after ``RIDE_ALONG_S``: under
        load a settlement shares the commit of the next requests' ``reserved`` rows
        instead of paying one of its own (each commit writes the pages it touched to
        the WAL again, whatever the number of rows in it).
        """
        result: T = await self._enqueue(fn, single_statement, ride_along)
        return result

    def submit(self, fn: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        """Queue one statement that rides along (``run``'s ``ride_along``) without
        waiting for it: its outcome is the returned future's, for a done-callback. The
        caller made the write durable some other way (the ledger's journal)."""
        return self._enqueue(fn, True, True)

    def _enqueue(
        self, fn: Callable[[sqlite3.Connection], T], single_statement: bool, ride_along: bool
    ) -> asyncio.Future[T]:
        """``fn`` queued for the next commit (``run``), its outcome the future's."""
        if self._closed:
            raise RuntimeError(f"SQLite store {self.path} is closed")
        loop = asyncio.get_running_loop()
        job = _Job(fn, loop, loop.create_future(), single_statement, ride_along)
        self._pending.append(job)
        if self._scheduled_on is not loop:
            if not ride_along:
                self._scheduled_on = loop
                loop.call_soon(self._hand_over)
            elif self._ride_timer is None or self._ride_loop is not loop:
                self._ride_loop = loop
                self._ride_timer = loop.call_later(RIDE_ALONG_S, self._hand_over)
        return job.future

    def _hand_over(self) -> None:
        """Commit everything queued in this loop tick: here when inline and nothing is
        still in the thread, else in the writer thread, in one put."""
        self._scheduled_on = None
        if self._ride_timer is not None:
            self._ride_timer.cancel()
            self._ride_timer = None
        if not self._pending:
            return
        if self.inline and self._in_thread:
            return  # behind the batch in the thread: handed over when it is back
        batch, self._pending = self._pending, []
        if self.inline and not self._closed:
            live = [job for job in batch if not job.future.cancelled()]
            if not live or self._commit_here(live):
                return
        self._to_thread(batch)

    def _to_thread(self, batch: list[_Job]) -> None:
        self._in_thread += 1
        self._queue.put(batch)

    def _commit_here(self, batch: list[_Job]) -> bool:
        """Commit ``batch`` on this thread; False (nothing done) when another
        connection holds the write lock: the batch must wait, in the thread."""
        try:
            if self._fast is None:
                self._fast = connect(self.path, synchronous="NORMAL")
                self._fast.execute("PRAGMA busy_timeout = 0")
                self._fast.execute("PRAGMA wal_autocheckpoint = 0")  # the thread's job
            self._fast.execute("BEGIN IMMEDIATE")
        except Exception as exc:
            if isinstance(exc, sqlite3.OperationalError) and _is_busy(exc):
                return False
            # the file cannot be opened or written: say so to every caller (this runs
            # in a loop callback, where nobody else would)
            _fail_all(batch, exc)
            return True
        try:
            _commit(self._fast, batch, begun=True)
        except BaseException as exc:  # _commit stores failures; anything else must
            _rollback(self._fast)  # still reach every caller, never leave one waiting
            _fail_all(batch, exc)
            return True
        _resolve_all(batch)
        return True

    def _back_from_thread(self, jobs: list[_Job], counted: bool) -> None:
        if counted:
            self._in_thread -= 1
        _resolve_all(jobs)
        if counted and not self._in_thread:
            self._hand_over()  # what queued meanwhile: inline again if the lock is free

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ride_timer is not None:
            self._ride_timer.cancel()
            self._ride_timer = None
        if self._pending:  # last writes, in order behind any batch still in the thread
            batch, self._pending = self._pending, []
            self._to_thread(batch)
        self._queue.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        if self._fast is not None:
            self._fast.close()
            self._fast = None

    def _main(self, migrations: Sequence[Migration], synchronous: Synchronous) -> None:
        try:
            conn = connect(self.path, synchronous=synchronous)
            migrate(conn, migrations)
        except BaseException as exc:
            self._ready.set_exception(exc)
            return
        self._ready.set_result(None)
        try:
            while self._serve_batch(conn):
                pass
        finally:
            conn.close()

    def _serve_batch(self, conn: sqlite3.Connection) -> bool:
        """Commit one batch; False once the stop marker has been seen. Idle for a
        second with inline commits: checkpoint the WAL they left."""
        batch: list[_Job] = []
        item = self._next(conn)
        while item is not _STOP:
            batch.extend(item)
            if len(batch) >= self._max_batch or self._queue.empty():
                break
            item = self._queue.get()
        # a caller cancelled before its job started gets nothing written (best effort:
        # one cancelled while the batch runs is written, its result dropped)
        live = [job for job in batch if not job.future.cancelled()]
        if live:
            _commit(conn, live)
        if batch:
            self._hand_back(batch, live)
        return item is not _STOP

    def _next(self, conn: sqlite3.Connection) -> Any:
        if not self.inline:
            return self._queue.get()
        last = time.monotonic()
        while True:
            try:
                return self._queue.get(timeout=CHECKPOINT_EVERY_S)
            except queue.Empty:
                pass
            if time.monotonic() - last >= CHECKPOINT_EVERY_S:
                with contextlib.suppress(sqlite3.Error):  # busy: the next second's turn
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                last = time.monotonic()

    def _hand_back(self, batch: list[_Job], live: list[_Job]) -> None:
        """Resolve the batch's futures with one wake-up of each event loop involved,
        and tell the loop the batch is out of the thread (its ``_in_thread``)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Job]] = {}
        for job in batch:
            by_loop.setdefault(job.loop, [])
        for job in live:
            by_loop[job.loop].append(job)
        for i, (loop, jobs) in enumerate(by_loop.items()):
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(self._back_from_thread, jobs, i == 0)


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)


def _commit(conn: sqlite3.Connection, batch: list[_Job], *, begun: bool = False) -> None:
    """Run and commit the batch, storing each job's outcome on it."""
    try:
        if not begun:
            conn.execute("BEGIN IMMEDIATE")
        for job in batch:
            job.outcome = _run_one(conn, job)
        conn.execute("COMMIT")
    except BaseException as exc:
        for job in batch:
            job.outcome = (False, exc)
        _rollback(conn)


def _fail_all(jobs: list[_Job], exc: BaseException) -> None:
    for job in jobs:
        job.outcome = (False, exc)
    _resolve_all(jobs)


def _resolve_all(jobs: list[_Job]) -> None:
    """Resolve each job's future, the writes a client waits on first: their callers
    run on (a ``reserved`` row's request goes upstream) before the callers of writes
    that rode along (a settlement, then its request's record) in the same iteration."""
    riders: list[_Job] = []
    for job in jobs:
        if job.ride_along:
            riders.append(job)
        elif not job.future.done():
            _resolve(job.future, *job.outcome)
    for job in riders:
        if not job.future.done():
            _resolve(job.future, *job.outcome)


def _run_one(conn: sqlite3.Connection, job: _Job) -> tuple[bool, Any]:
    """Run one job; its own failure is its result, unless SQLite rolled back the whole
    transaction (disk full, I/O error): then the batch fails, earlier jobs included."""
    if not job.single_statement:
        conn.execute("SAVEPOINT op")
    try:
        value = job.fn(conn)
    except Exception as exc:
        if not conn.in_transaction:
            raise
        if not job.single_statement:
            conn.execute("ROLLBACK TO op")
            conn.execute("RELEASE op")
        return False, exc
    if not job.single_statement:
        conn.execute("RELEASE op")
    return True, value


def _rollback(conn: sqlite3.Connection) -> None:
    """Undo a failed batch. Its callers already hold the original error; a connection
    that cannot even roll back reports itself at the next batch's BEGIN."""
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def _resolve(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


class SQLiteReader:
    """One read connection on its own thread: WAL readers never block the writer."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"ncap-sqlite-read:{path.name}")
        self._conn: sqlite3.Connection | None = None
        self._closed = False

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, fn)

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._conn is None:
            self._conn = connect(self._path)
            self._conn.execute("PRAGMA query_only = 1")
        return fn(self._conn)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        self._executor.submit(self._close_conn).result()
        self._executor.shutdown(wait=True)

    def _close_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
