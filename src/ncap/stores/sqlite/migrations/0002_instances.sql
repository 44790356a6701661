-- Gateway instances and their heartbeats, so that recovery marks lost only the rows
-- of gateways that stopped beating, and the index that recovery uses.
CREATE TABLE gateway_instances (
    instance TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    pid_namespace INTEGER NOT NULL,
    started_at REAL NOT NULL,
    beat_at REAL NOT NULL,
    timeout_s REAL NOT NULL
);
CREATE INDEX ledger_events_unsettled_instance ON ledger_events (gateway_instance)
    WHERE state = 'reserved'
