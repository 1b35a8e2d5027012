-- Server-side Idempotency-Key store, PostgreSQL, version 3. One row per (client scope, key).
CREATE TABLE IF NOT EXISTS {idempotency_keys} (
    scope             text        NOT NULL,
    idem_key          text        NOT NULL,
    fingerprint       text        NOT NULL,
    status            text        NOT NULL DEFAULT 'in_flight',
    locked_until      timestamptz NOT NULL,
    response_status   integer,
    response_headers  jsonb,
    response_body     bytea,
    created_at        timestamptz NOT NULL DEFAULT now(),
    expires_at        timestamptz NOT NULL,
    PRIMARY KEY (scope, idem_key),
    CONSTRAINT "{bare:idempotency_keys}_status_check" CHECK (status IN ('in_flight', 'completed'))
);
CREATE INDEX IF NOT EXISTS "{bare:idempotency_keys}_expires_idx" ON {idempotency_keys} (expires_at);
