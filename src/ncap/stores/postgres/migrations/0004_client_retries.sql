-- The official SDK's x-stainless-retry-count of the try that made the row (a
-- client's own retries): null when the client sent none, and on older rows.
ALTER TABLE ledger_events ADD COLUMN client_retry_count INTEGER;
