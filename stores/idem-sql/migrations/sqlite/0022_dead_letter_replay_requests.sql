-- idem dead-letter replay requests, SQLite, version 22. See the PostgreSQL migration.
ALTER TABLE {dead_letters} ADD COLUMN replay_requested_at TEXT;
ALTER TABLE {dead_letters} ADD COLUMN replay_requested_by TEXT;
CREATE INDEX IF NOT EXISTS "{bare:dead_letters}_requested_idx"
    ON {dead_letters} (consumer_group, id)
    WHERE replay_requested_at IS NOT NULL;
