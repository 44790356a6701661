-- Revision 7 rebuilt SQLite's ledger table with CHECK constraints written without IN
-- lists, which SQLite evaluates through an ephemeral b-tree per statement. PostgreSQL
-- evaluates them as = ANY(ARRAY[...]) with no such cost: nothing changes here, and the
-- revision keeps both dialects numbered alike.
SELECT 1
