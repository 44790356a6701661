-- Gateway instances and their heartbeats (server time), so that recovery marks lost
-- only the rows of gateways that stopped beating, and the index that recovery uses.
CREATE TABLE gateway_instances (
    instance TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    pid_namespace BIGINT NOT NULL,
    started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    beat_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    timeout_s DOUBLE PRECISION NOT NULL
);
CREATE INDEX ledger_events_unsettled_instance ON ledger_events (gateway_instance)
    WHERE state = 'reserved';
