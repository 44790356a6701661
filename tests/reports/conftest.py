"""Ledger backends for the report tests: SQLite always, PostgreSQL when ncap has a
PostgreSQL ledger store (each test gets its own database, dropped afterwards)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ncap.domain.events import LedgerEvent
from ncap.errors import ConfigError
from ncap.reports import LedgerSource, SQLiteSource
from ncap.stores import SQLiteLedgerStore, ledger_from_url

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"


@dataclass
class Backend:
    name: str
    open_source: Callable[[], LedgerSource]
    write: Callable[[Iterable[LedgerEvent]], Any]


def _pg_or_skip() -> Any:
    try:
        ledger_from_url("postgresql://postgres@127.0.0.1:5432/test")
    except ConfigError as exc:
        pytest.skip(f"no PostgreSQL ledger store in ncap.stores yet ({exc})")
    return pytest.importorskip("psycopg", reason="the test creates its database with psycopg")


@pytest.fixture(params=["sqlite", "postgresql"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "sqlite":
        path = tmp_path / "ledger.db"
        store = SQLiteLedgerStore(path)

        async def write_sqlite(events: Iterable[LedgerEvent]) -> None:
            for event in events:
                await store.append(event)

        yield Backend("sqlite", lambda: SQLiteSource(path), write_sqlite)
        await store.close()
        return
    psycopg = _pg_or_skip()
    from ncap.reports import PostgresSource

    name = f"ncap_reports_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    pg_store = ledger_from_url(url)

    async def write_pg(events: Iterable[LedgerEvent]) -> None:
        for event in events:
            await pg_store.append(event)

    try:
        yield Backend("postgresql", lambda: PostgresSource(url), write_pg)
    finally:
        await pg_store.close()
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
