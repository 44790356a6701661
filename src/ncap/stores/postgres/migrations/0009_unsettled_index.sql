-- The ledger's index on state holds only the rows that are looked up by state: every
-- state but 'settled'. Every settled row, the bulk of the ledger, kept an entry that no
-- query reads through the index (the queries that select settled rows read most of the
-- table), and each settlement wrote one. The lookups by state (recovery's reserved
-- rows, the reports' pending rows) imply `state <> 'settled'`, and say it beside their
-- own condition. Recovery's reserved rows of one gateway instance are found through this
-- index too (they are the few rows in flight), so the partial index of reserved rows by
-- instance goes, with the entry each insert wrote and each settlement deleted. The same
-- revision on SQLite.
DROP INDEX ledger_events_unsettled_instance;
DROP INDEX ledger_events_state;
CREATE INDEX ledger_events_unsettled ON ledger_events (state) WHERE state <> 'settled'
