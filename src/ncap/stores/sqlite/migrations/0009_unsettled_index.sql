-- The ledger's index on state holds only the rows that are looked up by state: every
-- state but 'settled'. Each settlement used to move its row's entry from 'reserved' to
-- the far end of 'settled' (two index pages written per commit), and every settled row,
-- the bulk of the ledger, kept an entry that no query reads through the index (the
-- queries that select settled rows read most of the table, and scan it). The lookups by
-- state (recovery's reserved rows, the reports' pending rows) say `state <> 'settled'`
-- beside their own condition, so SQLite uses this partial index. The partial index of
-- reserved rows by gateway instance goes: recovery's lookup never used it (its
-- condition on the instance is optional, so SQLite took the state index), and it cost
-- one more page written at every insert and every settlement.
DROP INDEX ledger_events_unsettled_instance;
DROP INDEX ledger_events_state;
CREATE INDEX ledger_events_unsettled ON ledger_events (state) WHERE state <> 'settled'
