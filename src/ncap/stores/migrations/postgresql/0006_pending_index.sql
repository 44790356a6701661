-- The state index covers only the rows waiting for usage (issue 9, third phase): the
-- one query that looks rows up by state alone (``pending()``) asks for exactly these,
-- and ``mark_lost`` has its own partial index (reserved rows by instance). Every
-- reserved row and every settlement no longer adds an entry to it, which was a
-- PostgreSQL index insertion per write on the request path (an update that changes
-- the state is never HOT, so it indexes its new row version anew).
DROP INDEX IF EXISTS ledger_events_state;
CREATE INDEX ledger_events_pending ON ledger_events (state)
    WHERE state IN ('pending', 'usage_reconciliation_required');
