-- The ledger: one row per attempt, exactly the columns docs/ledger.md lists (as in SQLite 0001).
CREATE TABLE ledger_events (
    timestamp TIMESTAMPTZ NOT NULL,
    request_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    workload_id TEXT NOT NULL,
    environment TEXT NOT NULL,
    route_id TEXT,
    model_alias TEXT,
    upstream_model TEXT,
    provider_request_id TEXT,
    requested_candidate_count INTEGER,
    effective_candidate_count INTEGER NOT NULL,
    returned_candidate_count INTEGER,
    exception_id TEXT,
    input_tokens BIGINT,
    cached_input_tokens BIGINT,
    output_tokens_total BIGINT,
    reasoning_tokens BIGINT,
    total_tokens BIGINT,
    reserved_input_tokens BIGINT NOT NULL,
    reserved_output_tokens BIGINT NOT NULL,
    reserved_cost_micros BIGINT NOT NULL,
    cost_micros BIGINT,
    finish_reasons JSONB NOT NULL,
    stream_mode BOOLEAN NOT NULL,
    usage_source TEXT NOT NULL CHECK (usage_source IN
        ('provider_response', 'provider_stream', 'reconciliation_import', 'none')),
    quota_scope TEXT NOT NULL,
    policy_result TEXT NOT NULL CHECK (policy_result IN ('allow', 'deny')),
    policy_reason TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('reserved', 'settled', 'pending',
        'usage_reconciliation_required', 'reconciled', 'denied')),
    reconciliation_reason TEXT,
    gateway_instance TEXT NOT NULL,
    latency_ms DOUBLE PRECISION,
    PRIMARY KEY (request_id, attempt)
);
CREATE INDEX ledger_events_timestamp ON ledger_events (timestamp, request_id, attempt);
CREATE INDEX ledger_events_state ON ledger_events (state);
CREATE INDEX ledger_events_provider_request_id ON ledger_events (provider_request_id);
