-- idem outbox, SQLite, version 11: nothing to change, the version keeps both engines in step.
-- On PostgreSQL this version drops the index that made every lease rewrite the row's index
-- entries and lowers the outbox's fillfactor, so a lease is a HOT update. SQLite updates a row
-- in place in its b-tree and keeps its single-writer claim (BEGIN IMMEDIATE) unchanged.
SELECT 1;
