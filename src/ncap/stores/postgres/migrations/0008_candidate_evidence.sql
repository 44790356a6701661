-- How different a request's candidates were, as counts only (no digest, no text): on
-- the row of the attempt that returned two or more candidates and ended normally
-- (an emulated fan-out: its first branch's row), null on every other row and on
-- older rows.
ALTER TABLE ledger_events ADD COLUMN candidates_compared INTEGER;
ALTER TABLE ledger_events ADD COLUMN candidates_distinct INTEGER;
ALTER TABLE ledger_events ADD COLUMN candidates_majority INTEGER;
ALTER TABLE ledger_events ADD COLUMN candidates_tool_calls INTEGER;
