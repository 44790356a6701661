-- The ledger table (columns: docs/ledger.md) and its indexes.
CREATE TABLE ledger_events (
    timestamp TEXT NOT NULL,
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
    input_tokens INTEGER,
    cached_input_tokens INTEGER,
    output_tokens_total INTEGER,
    reasoning_tokens INTEGER,
    total_tokens INTEGER,
    reserved_input_tokens INTEGER NOT NULL,
    reserved_output_tokens INTEGER NOT NULL,
    reserved_cost_micros INTEGER NOT NULL,
    cost_micros INTEGER,
    finish_reasons TEXT NOT NULL,
    stream_mode INTEGER NOT NULL,
    usage_source TEXT NOT NULL CHECK (usage_source IN
        ('provider_response', 'provider_stream', 'reconciliation_import', 'none')),
    quota_scope TEXT NOT NULL,
    policy_result TEXT NOT NULL CHECK (policy_result IN ('allow', 'deny')),
    policy_reason TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('reserved', 'settled', 'pending',
        'usage_reconciliation_required', 'reconciled', 'denied')),
    reconciliation_reason TEXT,
    gateway_instance TEXT NOT NULL,
    latency_ms REAL,
    PRIMARY KEY (request_id, attempt)
);
CREATE INDEX ledger_events_timestamp ON ledger_events (timestamp);
CREATE INDEX ledger_events_state ON ledger_events (state);
CREATE INDEX ledger_events_provider_request_id ON ledger_events (provider_request_id);
