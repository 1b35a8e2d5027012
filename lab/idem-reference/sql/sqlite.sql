-- Reference pipeline tables, SQLite. See postgres.sql.
CREATE TABLE IF NOT EXISTS orders (
    order_id      TEXT    PRIMARY KEY,
    payment_id    TEXT    NOT NULL UNIQUE,
    amount_minor  INTEGER NOT NULL CHECK (amount_minor > 0),
    currency      TEXT    NOT NULL,
    created_at    TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE TABLE IF NOT EXISTS settlements (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    payment_id    TEXT    NOT NULL,
    order_id      TEXT    NOT NULL,
    amount_minor  INTEGER NOT NULL CHECK (amount_minor > 0),
    currency      TEXT    NOT NULL,
    event_id      TEXT    NOT NULL,
    settled_at    TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    CONSTRAINT settlements_payment_id_key UNIQUE (payment_id)
);

-- Insert-only: one row each time the handler applied an event (see postgres.sql).
CREATE TABLE IF NOT EXISTS settlement_applications (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id      TEXT    NOT NULL,
    payment_id    TEXT    NOT NULL,
    applied_at    TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

-- The points API's own database (see postgres.sql).
CREATE TABLE IF NOT EXISTS points_awards (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    client        TEXT    NOT NULL,
    order_id      TEXT    NOT NULL,
    payment_id    TEXT    NOT NULL,
    points        INTEGER NOT NULL CHECK (points > 0),
    idem_key      TEXT,
    awarded_at    TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    CONSTRAINT points_awards_key UNIQUE (client, idem_key)
);
CREATE INDEX IF NOT EXISTS points_awards_payment_idx ON points_awards (payment_id);

-- Reversed awards (see postgres.sql).
CREATE TABLE IF NOT EXISTS points_reversals (
    award_id      INTEGER PRIMARY KEY REFERENCES points_awards (id),
    reversed_at   TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

-- The audit consumer group's log (see postgres.sql).
CREATE TABLE IF NOT EXISTS audit_log (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id      TEXT    NOT NULL,
    payment_id    TEXT    NOT NULL,
    amount_minor  INTEGER NOT NULL,
    logged_at     TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

-- Lab only (see postgres.sql).
CREATE TABLE IF NOT EXISTS points_lab_overlaps (
    id            INTEGER PRIMARY KEY,
    client        TEXT    NOT NULL,
    idem_key      TEXT    NOT NULL,
    at            TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
