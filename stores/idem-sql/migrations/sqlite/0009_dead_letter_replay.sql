-- idem dead-letter replay bookkeeping, SQLite, version 9. See the PostgreSQL migration.
ALTER TABLE {dead_letters} ADD COLUMN replayed_at TEXT;
ALTER TABLE {dead_letters} ADD COLUMN replayed_by TEXT;
ALTER TABLE {dead_letters} ADD COLUMN replay_outcome TEXT
    CONSTRAINT "{bare:dead_letters}_replay_outcome_check"
    CHECK (replay_outcome IN ('applied', 'already_applied', 'failed'));
ALTER TABLE {dead_letters} ADD COLUMN replay_attempts INTEGER NOT NULL DEFAULT 0;
