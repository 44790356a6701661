"""Versioned SQL migration files, in each backend's folder (``<backend>/migrations/``).

``NNNN_name.sql`` is revision NNNN. Each database records the revisions it has in a
``schema_version`` table; opening a store applies the newer ones (SQLite inside
``BEGIN IMMEDIATE``, PostgreSQL under an advisory lock), and ``ncap migrate`` does the
same on demand. Plain SQL files rather than Alembic or yoyo: two small schemas, no ORM,
and the same files are readable by an operator's DBA (docs/decisions/migrations-versioned-sql.md).
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files

__all__ = ["Migration", "latest", "migrations"]

Migration = tuple[int, str]
_PACKAGES = {"sqlite": "ncap.stores.sqlite", "postgresql": "ncap.stores.postgres"}
_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


@cache
def migrations(dialect: str) -> tuple[Migration, ...]:
    """Every revision of ``dialect`` in order."""
    folder = files(_PACKAGES[dialect]).joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry.read_text()))
    return tuple(sorted(found))


def latest(dialect: str) -> int:
    return max((v for v, _ in migrations(dialect)), default=0)
