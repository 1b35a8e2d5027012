-- idem inbox and dead letters, SQLite, version 2. See the PostgreSQL migration for the design.
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer_group     TEXT    NOT NULL,
    event_id           TEXT    NOT NULL,
    event_type         TEXT    NOT NULL,
    aggregate_type     TEXT    NOT NULL,
    aggregate_id       TEXT    NOT NULL,
    payload_hash       TEXT    NOT NULL,
    delivery_count     INTEGER NOT NULL DEFAULT 1,
    status             TEXT    NOT NULL DEFAULT 'processed',
    processed_at       TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    last_delivered_at  TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (consumer_group, event_id),
    CONSTRAINT "{bare:inbox}_status_check" CHECK (status IN ('processed', 'dead_lettered'))
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS {dead_letters} (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer_group     TEXT    NOT NULL,
    topic              TEXT    NOT NULL,
    record_partition   INTEGER NOT NULL,
    record_offset      INTEGER NOT NULL,
    event_id           TEXT,
    event_type         TEXT,
    reason             TEXT    NOT NULL,
    record_key         TEXT,
    payload            TEXT,
    headers            TEXT    NOT NULL DEFAULT '{}',
    created_at         TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    CONSTRAINT "{bare:dead_letters}_position_key" UNIQUE (consumer_group, topic, record_partition, record_offset)
);
