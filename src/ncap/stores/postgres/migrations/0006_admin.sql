-- The admin tables: what the admin API created and revoked, its
-- audit trail, and the budget alerts already fired, shared by every replica. The same
-- columns as SQLite revision 6 (sqlite/migrations/0006_admin.sql); timestamps are
-- TIMESTAMPTZ here, fixed-width UTC text there. ``body`` and ``detail`` are the JSON
-- text the SQLite tables hold (read back whole, never queried inside).
CREATE TABLE admin_grants (
    kind TEXT NOT NULL CHECK (kind IN ('exception', 'key')),
    id TEXT NOT NULL,
    body TEXT,
    created_at TIMESTAMPTZ NOT NULL,
    revoked_at TIMESTAMPTZ,
    PRIMARY KEY (kind, id)
);
CREATE TABLE admin_audit (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at TIMESTAMPTZ NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL CHECK (action IN ('create', 'revoke')),
    kind TEXT NOT NULL,
    target TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE TABLE budget_alerts (
    subject TEXT NOT NULL,
    scope TEXT NOT NULL,
    period TEXT NOT NULL,
    threshold_pct INTEGER NOT NULL,
    fired_at TIMESTAMPTZ NOT NULL,
    spent_micros BIGINT NOT NULL,
    limit_micros BIGINT NOT NULL,
    delivered INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (subject, scope, period, threshold_pct)
);
