"""PostgreSQL stores: the ledger every replica shares (``postgresql://…``).

``?schema=name`` picks a schema; ``stores.ledger_durability`` sets
``synchronous_commit`` (``normal``: off; ``full``: the server's), as does
``?synchronous_commit=`` (which overrides it). The instance registry and the admin
tables live in the ledger's schema. The schema: ``migrations/``.
"""

from __future__ import annotations

from ncap.errors import ConfigError
from ncap.stores._common import history_of
from ncap.stores.ports import AdminStore, Backend, LedgerSide, LedgerSource, StoreOptions
from ncap.stores.postgres.admin import PostgresAdminStore
from ncap.stores.postgres.instances import PostgresInstanceRegistry
from ncap.stores.postgres.ledger import PostgresLedgerStore
from ncap.stores.postgres.pool import PostgresPool, postgres_target
from ncap.stores.postgres.report_source import PostgresSource

__all__ = ["BACKEND"]


def open_ledger(url: str, options: StoreOptions) -> LedgerSide:
    ledger = PostgresLedgerStore(
        _checked(url, "ledger"), durability=options.durability, timeout_s=options.timeout_s
    )
    return LedgerSide(ledger, PostgresInstanceRegistry(ledger.pool), history_of(ledger))


def open_admin(url: str, create: bool) -> AdminStore | None:
    return PostgresAdminStore(url)


def open_report_source(url: str) -> LedgerSource:
    return PostgresSource(url)


async def migrate(url: str, store: str) -> dict[str, object]:
    pool = PostgresPool(_checked(url, store), store=store)
    try:
        await pool.get()
        return {"backend": "postgresql", "version": pool.version}
    finally:
        await pool.close()


def _checked(url: str, store: str) -> str:
    try:
        postgres_target(url)
    except ValueError as exc:
        raise ConfigError(f"stores.{store}: {exc}") from exc
    return url


BACKEND = Backend(
    "postgresql",
    shared=True,
    ledger=open_ledger,
    admin=open_admin,
    report_source=open_report_source,
    migrate=migrate,
)
