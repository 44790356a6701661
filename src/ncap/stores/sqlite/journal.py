"""The journal of ``reserved`` rows not yet in the SQLite ledger's table.

An attempt's ``reserved`` row must be durable before the attempt is dispatched. At
``synchronous=NORMAL`` a commit is durable against a killed process, not against an
OS crash: its WAL frames are in the OS's page cache. One ``write(2)`` of the row to an
append-only file is durable in the same way, for a few microseconds instead of a
commit on the request's path (about 0.1 ms at one request at a time:
docs/decisions/sqlite-reserved-rows-journal.md). So ``append_reserved`` writes the row
here and hands its INSERT to the group commit as a write that rides along (it joins
the next commit, or commits on its own within ``RIDE_ALONG_S``).

Each open ledger has its own file beside the ledger's, ``<ledger>.reserved-<pid>-<n>``,
locked (``flock``) while it is open. Its first line names the columns, each later line
is one row (a JSON array in that order, values as the table stores them). The file is
emptied whenever every row written to it is in the table, and removed when the ledger
closes. A file no live process holds belongs to a process that ended without closing
its ledger (a crash, a ``kill -9``): ``recover`` inserts its rows that the table lacks
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
_HEADER = msgspec.json.encode(list(LEDGER_COLUMNS)) + b"\n"
_encode = msgspec.json.encode
_decode = msgspec.json.decode
_NUMBERS = itertools.count(1)


class Journal:
    """This process's journal of one ledger file (the module docstring)."""

    def __init__(self, ledger: Path) -> None:
        # one file per store object: a process may open one ledger twice
        self.path = ledger.with_name(f"{ledger.name}{SUFFIX}{os.getpid()}-{next(_NUMBERS)}")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)  # recovered already, if an earlier process of this pid left it
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._empty = True
        # rows written here whose INSERT has not ended yet
        self.unwritten = 0
        # a row here could not be put in the table: the file stays for the next start
        self.kept = False

    def write(self, row: list[Any]) -> None:
        """``row`` (``LEDGER_COLUMNS`` order, encoded as the table stores it) durable
        against a killed process when this returns."""
        fd = self._fd
        if fd is None:
            raise RuntimeError(f"the journal {self.path} is closed")
        data = _encode(row) + b"\n"
        if self._empty:
            data = _HEADER + data
        view = memoryview(data)
        while view:  # a regular file takes it whole, unless the disk is full
            view = view[os.write(fd, view) :]
        self._empty = False
        self.unwritten += 1

    def written(self, future: asyncio.Future[Any]) -> None:
        """The done-callback of a journaled row's INSERT."""
        self.unwritten -= 1
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or (error is not None and not isinstance(error, DuplicateAttempt)):
            self.kept = True
            log.error(
                "a reserved row is in %s but not in the ledger's table (%s); the next start "
                "of a gateway on this ledger inserts it",
                self.path.name,
                "cancelled" if error is None else type(error).__name__,
            )
        elif error is not None:  # a key made by this gateway cannot exist already
            log.error("a reserved row's key was in the ledger already: %s", error)
        if not self.unwritten and not self.kept and self._fd is not None:
            os.ftruncate(self._fd, 0)
            self._empty = True

    def close(self) -> None:
        """Release the file (its rows, if any, are recovered by ``remove``)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


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
