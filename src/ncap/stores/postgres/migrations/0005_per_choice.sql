-- Each choice's output tokens where the route reveals them: "12,40,7" in
-- choice index order, or NULL.
ALTER TABLE ledger_events ADD COLUMN output_tokens_per_choice TEXT;
