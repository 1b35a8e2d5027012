-- idem outbox, SQLite, version 1.
-- Placeholders: {name} is the quoted name of table <prefix><name>; {bare:name} the unquoted one.
--
-- SQLite lets one writer hold the database at a time, from its first write to its commit, so
-- rows are inserted in commit order and `id` (AUTOINCREMENT, never reused) is the commit order
-- of every aggregate. Times the relay compares are integer Unix milliseconds.

CREATE TABLE IF NOT EXISTS {outbox} (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id        TEXT    NOT NULL,
    aggregate_type  TEXT    NOT NULL,
    aggregate_id    TEXT    NOT NULL,
    event_type      TEXT    NOT NULL,
    payload         TEXT    NOT NULL,
    headers         TEXT    NOT NULL DEFAULT '{}',
    topic           TEXT,
    traceparent     TEXT,
    occurred_at     TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    created_at      TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    status          TEXT    NOT NULL DEFAULT 'pending',
    attempts        INTEGER NOT NULL DEFAULT 0,
    permanent_failures INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL DEFAULT 0,
    claim_id        TEXT,
    claimed_by      TEXT,
    claimed_until   INTEGER,
    last_error      TEXT,
    published_at    TEXT,
    CONSTRAINT "{bare:outbox}_event_id_key" UNIQUE (event_id),
    CONSTRAINT "{bare:outbox}_status_check" CHECK (status IN ('pending', 'published', 'parked')),
    CONSTRAINT "{bare:outbox}_event_id_check" CHECK (
        length(event_id) = 36 AND event_id NOT GLOB '*[^0-9a-fA-F-]*'
        AND substr(event_id, 9, 1) = '-' AND substr(event_id, 14, 1) = '-'
        AND substr(event_id, 19, 1) = '-' AND substr(event_id, 24, 1) = '-'),
    CONSTRAINT "{bare:outbox}_aggregate_type_check" CHECK (
        length(aggregate_type) BETWEEN 1 AND 200
        AND aggregate_type NOT GLOB '*[^A-Za-z0-9._-]*' AND aggregate_type NOT GLOB '[._-]*'),
    CONSTRAINT "{bare:outbox}_event_type_check" CHECK (
        length(event_type) BETWEEN 1 AND 255
        AND event_type NOT GLOB '*[^A-Za-z0-9._-]*' AND event_type NOT GLOB '[._-]*'),
    CONSTRAINT "{bare:outbox}_aggregate_id_check" CHECK (
        aggregate_id <> '' AND length(CAST(aggregate_id AS BLOB)) <= 512
        AND aggregate_id NOT GLOB ('*[' || char(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,
                                              19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 127) || ']*')),
    CONSTRAINT "{bare:outbox}_payload_check" CHECK (json_valid(payload)),
    CONSTRAINT "{bare:outbox}_headers_check" CHECK (json_valid(headers) AND json_type(headers) = 'object'),
    CONSTRAINT "{bare:outbox}_topic_check" CHECK (
        topic IS NULL OR (length(topic) BETWEEN 1 AND 249 AND topic NOT GLOB '*[^A-Za-z0-9._-]*'))
);

CREATE INDEX IF NOT EXISTS "{bare:outbox}_pending_idx" ON {outbox} (id) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS "{bare:outbox}_pending_aggregate_idx"
    ON {outbox} (aggregate_type, aggregate_id, id) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS "{bare:outbox}_leased_idx"
    ON {outbox} (aggregate_type, aggregate_id) WHERE status = 'pending' AND claim_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS "{bare:outbox}_published_idx" ON {outbox} (published_at) WHERE status = 'published';
CREATE INDEX IF NOT EXISTS "{bare:outbox}_parked_idx" ON {outbox} (id) WHERE status = 'parked';

-- Published rows moved here by `prune` in archive mode.
CREATE TABLE IF NOT EXISTS {outbox_archive} (
    id              INTEGER PRIMARY KEY,
    event_id        TEXT    NOT NULL,
    aggregate_type  TEXT    NOT NULL,
    aggregate_id    TEXT    NOT NULL,
    event_type      TEXT    NOT NULL,
    payload         TEXT    NOT NULL,
    headers         TEXT    NOT NULL,
    topic           TEXT,
    traceparent     TEXT,
    occurred_at     TEXT    NOT NULL,
    created_at      TEXT    NOT NULL,
    status          TEXT    NOT NULL,
    attempts        INTEGER NOT NULL,
    permanent_failures INTEGER NOT NULL,
    next_attempt_at INTEGER NOT NULL,
    claim_id        TEXT,
    claimed_by      TEXT,
    claimed_until   INTEGER,
    last_error      TEXT,
    published_at    TEXT
);
