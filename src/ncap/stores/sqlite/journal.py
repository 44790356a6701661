"""The journal of ``reserved`` rows not yet in the SQLite ledger's table.

An attempt's ``reserved`` row must be durable before the attempt is dispatched. At
``synchronous=NORMAL`` a commit is durable against a killed process, not against an
OS crash: its WAL frames are in the OS's page cache. One ``write(2)`` of the row to an
append-only file is durable in the same way, for a few microseconds instead of a
commit on the request's path (about 0.1 ms at one request at a time:
docs/decisions/sqlite-reserved-rows-journal.md). So ``append_reserved`` writes the row
here and hands its INSERT to the group commit as a write that rides along (it joins
the next commit, or commits on its own within ``RIDE_ALONG_S``).

Each open ledger writes its own files beside the ledger's,
``<ledger>.reserved-<pid>-<n>.<generation>``, each locked (``flock``) while it is in use.
A file's first line names the columns, each later line is one row (a JSON array in that
order, values as the table stores them). The file in use is emptied whenever every row
written to it is in the table; past ``ROTATE_BYTES`` the next rows go to a new file,
and the older one is removed once its rows are in the table (under steady load some
row is always on its way). All are removed when the ledger closes.

A file no live process holds belongs to a process that ended without closing its
ledger (a crash, a ``kill -9``): ``recover`` inserts its rows that the table lacks
(``INSERT OR IGNORE``: a row already written, and perhaps settled since, is kept as it
is), then removes it, when a ledger opens and before a sweep marks lost rows. A last
line cut short by an OS crash is skipped: its ``append_reserved`` had not returned, so
its attempt was never dispatched.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any

import msgspec

from ncap.domain.events import LEDGER_COLUMNS
from ncap.stores.ports import DuplicateAttempt

__all__ = ["SUFFIX", "Journal", "recover", "remove"]

log = logging.getLogger("ncap.stores.sqlite")

SUFFIX = ".reserved-"
# a journal file past this size gives way to a new one (about a thousand rows)
ROTATE_BYTES = 1 << 20
_HEADER = msgspec.json.encode(list(LEDGER_COLUMNS)) + b"\n"
_encode = msgspec.json.encode
_decode = msgspec.json.decode
_NUMBERS = itertools.count(1)


class _File:
    """One of a journal's files and the rows in it whose INSERT has not ended yet."""

    __slots__ = ("fd", "kept", "path", "size", "unwritten")

    def __init__(self, path: Path) -> None:
        # made under a name ``recover`` does not look at, locked, then renamed: a file
        # under a journal's name is never found unlocked while its ledger is open
        hidden = path.with_name(f".{path.name}")
        fd = os.open(hidden, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 0)
            os.replace(hidden, path)  # an earlier process's file of this name: recovered
        except BaseException:
            os.close(fd)
            raise
        self.path = path
        self.fd = fd
        self.size = 0
        self.unwritten = 0
        # a row here could not be put in the table: the file stays for the next start
        self.kept = False


class Journal:
    """This ledger's journal (the module docstring). Under steady load some row is
    always on its way to the table, so a file is never found empty of pending rows:
    past ``ROTATE_BYTES`` the journal moves on to a new file, and an older file is
    removed once every row in it is in the table."""

    def __init__(self, ledger: Path) -> None:
        # one name per store object: a process may open one ledger twice
        self._base = f"{ledger.name}{SUFFIX}{os.getpid()}-{next(_NUMBERS)}"
        self._dir = ledger.parent
        self._generations = itertools.count(1)
        self._file: _File | None = self._open()
        self._older: list[_File] = []

    def _open(self) -> _File:
        return _File(self._dir / f"{self._base}.{next(self._generations)}")

    @property
    def unwritten(self) -> int:
        """Rows written here whose INSERT has not ended yet."""
        current = self._file.unwritten if self._file is not None else 0
        return current + sum(f.unwritten for f in self._older)

    def write(self, row: list[Any]) -> _File:
        """``row`` (``LEDGER_COLUMNS`` order, encoded as the table stores them) durable
        against a killed process when this returns; returns the file that holds it,
        for ``written``."""
        file = self._file
        if file is None:
            raise RuntimeError(f"the journal {self._base} is closed")
        if file.size > ROTATE_BYTES:
            self._older.append(file)
            file = self._file = self._open()
        data = _encode(row) + b"\n"
        if not file.size:
            data = _HEADER + data
        view = memoryview(data)
        while view:  # a regular file takes it whole, unless the disk is full
            view = view[os.write(file.fd, view) :]
        file.size += len(data)
        file.unwritten += 1
        return file

    def written(self, file: _File, future: asyncio.Future[Any]) -> None:
        """The done-callback of the INSERT of a row in ``file``."""
        file.unwritten -= 1
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or (error is not None and not isinstance(error, DuplicateAttempt)):
            file.kept = True
            log.error(
                "a reserved row is in %s but not in the ledger's table (%s); the next start "
                "of a gateway on this ledger inserts it",
                file.path.name,
                "cancelled" if error is None else type(error).__name__,
            )
        elif error is not None:  # a key made by this gateway cannot exist already
            log.error("a reserved row's key was in the ledger already: %s", error)
        if file.unwritten or file.kept or file.fd < 0:
            return
        if file is self._file:
            os.ftruncate(file.fd, 0)
            file.size = 0
        elif file in self._older:
            self._older.remove(file)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file.path)
            os.close(file.fd)
            file.fd = -1

    def close(self) -> None:
        """Release the files (rows left in them, if any, are recovered by ``recover``)."""
        files = [*self._older, *([self._file] if self._file is not None else [])]
        self._file, self._older = None, []
        for file in files:
            if file.fd >= 0:
                os.close(file.fd)
                file.fd = -1


def recover(conn: sqlite3.Connection, ledger: Path) -> list[tuple[Path, int]]:
    """Insert, in ``conn``'s open transaction, the rows of every journal of ``ledger``
    that no live process holds, where the table lacks them; returns those files with
    their locks held, for ``remove`` once the transaction has committed."""
    found: list[tuple[Path, int]] = []
    for path in sorted(ledger.parent.glob(f"{ledger.name}{SUFFIX}*")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live process's
            os.close(fd)
            continue
        try:
            with open(fd, "rb", closefd=False) as file:
                lines = file.read().split(b"\n")
            _insert_lines(conn, lines, path)
        except BaseException:
            os.close(fd)
            raise
        found.append((path, fd))
    return found


def remove(found: list[tuple[Path, int]]) -> None:
    """The recovered journals, once their rows are committed."""
    for path, fd in found:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def _insert_lines(conn: sqlite3.Connection, lines: list[bytes], path: Path) -> None:
    if not lines or not lines[0]:
        return
    try:
        names = _decode(lines[0], type=list[str])
    except msgspec.DecodeError:
        log.error("journal %s: unreadable header, skipped", path.name)
        return
    known = set(LEDGER_COLUMNS)
    keep = [i for i, name in enumerate(names) if name in known]
    columns = ", ".join(names[i] for i in keep)
    sql = f"INSERT OR IGNORE INTO ledger_events ({columns}) VALUES ({', '.join('?' * len(keep))})"
    rows = 0
    for line in lines[1:]:
        if not line:
            continue
        try:
            row = _decode(line, type=list[Any])
        except msgspec.DecodeError:  # cut short: its attempt was never dispatched
            continue
        if len(row) != len(names):
            continue
        conn.execute(sql, [row[i] for i in keep])
        rows += 1
    if rows:
        log.warning("journal %s: %d reserved row(s) recovered into the ledger", path.name, rows)
