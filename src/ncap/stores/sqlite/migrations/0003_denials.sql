-- What refused a denial and a failed attempt's upstream status: null on
-- older rows.
ALTER TABLE ledger_events ADD COLUMN denied_by TEXT;
ALTER TABLE ledger_events ADD COLUMN denied_limit INTEGER;
ALTER TABLE ledger_events ADD COLUMN denied_amount INTEGER;
ALTER TABLE ledger_events ADD COLUMN upstream_status INTEGER
