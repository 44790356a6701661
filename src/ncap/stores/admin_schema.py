"""The SQLite DDL of the admin tables, in one place. They live in the ledger's database
(same file or server), beside ``ledger_events``. One source per dialect: this module
for SQLite (run by the SQLite ledger's revision 6 and by ``SQLiteAdminStore`` on a file
it opens first), ``migrations/postgresql/0006_admin.sql`` for PostgreSQL; the columns
are the same (``tests/stores/test_migrations.py`` compares them).

admin_grants    exceptions and API keys the admin API created, and revocations (of
                its own entries and of the config's): ``kind`` is ``exception`` or
                ``key``; ``body`` the entry as JSON (a key: its hash, never the key),
                null for the revocation of an entry the config defines
admin_audit     one row per admin change: who, when, what (append-only)
budget_alerts   one row per budget threshold crossed, per window period; the primary
                key is what makes an alert fire once, across restarts and replicas
"""

from __future__ import annotations

__all__ = ["SQLITE_DDL"]

SQLITE_DDL = """
CREATE TABLE IF NOT EXISTS admin_grants (
    kind TEXT NOT NULL CHECK (kind IN ('exception', 'key')),
    id TEXT NOT NULL,
    body TEXT,
    created_at TEXT NOT NULL,
    revoked_at TEXT,
    PRIMARY KEY (kind, id)
);
CREATE TABLE IF NOT EXISTS admin_audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at TEXT NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL CHECK (action IN ('create', 'revoke')),
    kind TEXT NOT NULL,
    target TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS budget_alerts (
    subject TEXT NOT NULL,
    scope TEXT NOT NULL,
    period TEXT NOT NULL,
    threshold_pct INTEGER NOT NULL,
    fired_at TEXT NOT NULL,
    spent_micros INTEGER NOT NULL,
    limit_micros INTEGER NOT NULL,
    delivered INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (subject, scope, period, threshold_pct)
);
"""
