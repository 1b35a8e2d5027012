-- Effect intents, SQLite, version 4 (see the PostgreSQL migration). Times are Unix milliseconds.
CREATE TABLE IF NOT EXISTS {effect_intents} (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    idem_key         TEXT    NOT NULL,
    effect           TEXT    NOT NULL,
    target           TEXT    NOT NULL,
    event_id         TEXT    NOT NULL,
    body             TEXT    NOT NULL CHECK (json_valid(body)),
    traceparent      TEXT,
    status           TEXT    NOT NULL DEFAULT 'pending',
    attempts         INTEGER NOT NULL DEFAULT 0,
    next_attempt_at  INTEGER NOT NULL DEFAULT 0,
    claimed_until    INTEGER,
    response_status  INTEGER,
    response_body    TEXT,
    last_error       TEXT,
    created_at       TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    updated_at       TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    CONSTRAINT "{bare:effect_intents}_key" UNIQUE (idem_key),
    CONSTRAINT "{bare:effect_intents}_status_check" CHECK (status IN ('pending', 'done', 'parked', 'unknown'))
);
CREATE INDEX IF NOT EXISTS "{bare:effect_intents}_due_idx" ON {effect_intents} (next_attempt_at, id) WHERE status = 'pending';
