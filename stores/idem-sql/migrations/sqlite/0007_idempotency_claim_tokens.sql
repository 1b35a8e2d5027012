-- Server-side Idempotency-Key store, SQLite, version 7: claim tokens (see the PostgreSQL
-- migration).
ALTER TABLE {idempotency_keys} ADD COLUMN claim_token TEXT;
