-- idem operator console, SQLite, version 23. See the PostgreSQL migration.
CREATE TABLE IF NOT EXISTS {audit} (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    at        TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    actor     TEXT    NOT NULL,
    action    TEXT    NOT NULL,
    target    TEXT    NOT NULL,
    reason    TEXT    NOT NULL,
    affected  INTEGER NOT NULL,
    outcome   TEXT    NOT NULL
);
CREATE INDEX IF NOT EXISTS "{bare:dead_letters}_group_idx" ON {dead_letters} (consumer_group, id);
CREATE INDEX IF NOT EXISTS "{bare:effect_intents}_stuck_idx" ON {effect_intents} (id)
    WHERE status IN ('parked', 'unknown');
