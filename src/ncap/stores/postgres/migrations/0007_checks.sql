-- Revision 7. SQLite's rebuilt its ledger table with CHECK
-- constraints written without IN lists, which SQLite evaluates through an ephemeral
-- b-tree per statement; PostgreSQL evaluates them as = ANY(ARRAY[...]) at no such cost,
-- so its constraints stay. Both dialects now index the provider request id only on the
-- rows that have one: a reserved row has none yet, so its insert wrote an entry that
-- its settlement then replaced. The lookup by id (= ANY($1)) still uses the index.
DROP INDEX ledger_events_provider_request_id;
CREATE INDEX ledger_events_provider_request_id ON ledger_events (provider_request_id)
    WHERE provider_request_id IS NOT NULL
