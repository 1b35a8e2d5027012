-- Server-side Idempotency-Key store, SQLite, version 3 (see the PostgreSQL migration).
-- Times are Unix milliseconds.
CREATE TABLE IF NOT EXISTS {idempotency_keys} (
    scope             TEXT    NOT NULL,
    idem_key          TEXT    NOT NULL,
    fingerprint       TEXT    NOT NULL,
    status            TEXT    NOT NULL DEFAULT 'in_flight',
    locked_until      INTEGER NOT NULL,
    response_status   INTEGER,
    response_headers  TEXT,
    response_body     BLOB,
    created_at        INTEGER NOT NULL,
    expires_at        INTEGER NOT NULL,
    PRIMARY KEY (scope, idem_key),
    CONSTRAINT "{bare:idempotency_keys}_status_check" CHECK (status IN ('in_flight', 'completed'))
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS "{bare:idempotency_keys}_expires_idx" ON {idempotency_keys} (expires_at);
