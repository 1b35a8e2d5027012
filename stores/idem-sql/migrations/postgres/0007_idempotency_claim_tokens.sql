-- Server-side Idempotency-Key store, PostgreSQL, version 7: claim tokens.
--
-- A claim stores a random token; renewing its lock, storing its response and releasing it are
-- fenced by the token, so a request whose lock ran out and was taken over by a retry can neither
-- overwrite nor delete the retry's claim. Rows claimed before this version have no token: no
-- running server holds them, and a retry takes them over once their lock has run out.
ALTER TABLE {idempotency_keys} ADD COLUMN IF NOT EXISTS claim_token text;
