-- The admin tables, in the ledger's file: what the admin API changed, its audit trail
-- and the budget alerts already fired (columns as PostgreSQL's 0006_admin.sql).
-- IF NOT EXISTS: a file at revision 5 may have them already (the admin store created
-- them before revision 6 existed), and the admin store runs this file on a file it
-- opens before the ledger does.
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
