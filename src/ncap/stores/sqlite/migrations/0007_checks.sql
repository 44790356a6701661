-- CHECK constraints without IN lists. SQLite builds an ephemeral
-- b-tree for each IN list of a CHECK at every INSERT and UPDATE that checks it (three
-- per request here), and the same constraints written as OR chains need none. SQLite
-- cannot alter a constraint, so the table is rebuilt: its rows copied in this one
-- transaction, then its indexes made again (the report's partial indexes are made
-- again by the next gateway start-up, sqlite/report_indexes.py). The provider request id's
-- index now leaves out the rows that have none (every reserved row, every denial):
-- the insert no longer writes an entry that its settlement deletes, and the lookup
-- by id (provider_request_id = ?) still uses it.
CREATE TABLE ledger_events_v7 (
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
    usage_source TEXT NOT NULL CHECK (usage_source = 'provider_response'
        OR usage_source = 'provider_stream' OR usage_source = 'reconciliation_import'
        OR usage_source = 'none'),
    quota_scope TEXT NOT NULL,
    policy_result TEXT NOT NULL CHECK (policy_result = 'allow' OR policy_result = 'deny'),
    policy_reason TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state = 'reserved' OR state = 'settled' OR state = 'pending'
        OR state = 'usage_reconciliation_required' OR state = 'reconciled'
        OR state = 'denied'),
    reconciliation_reason TEXT,
    gateway_instance TEXT NOT NULL,
    latency_ms REAL,
    denied_by TEXT,
    denied_limit INTEGER,
    denied_amount INTEGER,
    upstream_status INTEGER,
    client_retry_count INTEGER,
    output_tokens_per_choice TEXT,
    PRIMARY KEY (request_id, attempt)
);
INSERT INTO ledger_events_v7 (timestamp, request_id, attempt, workload_id, environment,
    route_id, model_alias, upstream_model, provider_request_id, requested_candidate_count,
    effective_candidate_count, returned_candidate_count, exception_id, input_tokens,
    cached_input_tokens, output_tokens_total, reasoning_tokens, total_tokens,
    reserved_input_tokens, reserved_output_tokens, reserved_cost_micros, cost_micros,
    finish_reasons, stream_mode, usage_source, quota_scope, policy_result, policy_reason,
    state, reconciliation_reason, gateway_instance, latency_ms, denied_by, denied_limit,
    denied_amount, upstream_status, client_retry_count, output_tokens_per_choice)
SELECT timestamp, request_id, attempt, workload_id, environment,
    route_id, model_alias, upstream_model, provider_request_id, requested_candidate_count,
    effective_candidate_count, returned_candidate_count, exception_id, input_tokens,
    cached_input_tokens, output_tokens_total, reasoning_tokens, total_tokens,
    reserved_input_tokens, reserved_output_tokens, reserved_cost_micros, cost_micros,
    finish_reasons, stream_mode, usage_source, quota_scope, policy_result, policy_reason,
    state, reconciliation_reason, gateway_instance, latency_ms, denied_by, denied_limit,
    denied_amount, upstream_status, client_retry_count, output_tokens_per_choice
FROM ledger_events;
DROP TABLE ledger_events;
ALTER TABLE ledger_events_v7 RENAME TO ledger_events;
CREATE INDEX ledger_events_timestamp ON ledger_events (timestamp);
CREATE INDEX ledger_events_state ON ledger_events (state);
CREATE INDEX ledger_events_provider_request_id ON ledger_events (provider_request_id)
    WHERE provider_request_id IS NOT NULL;
CREATE INDEX ledger_events_unsettled_instance ON ledger_events (gateway_instance)
    WHERE state = 'reserved'
