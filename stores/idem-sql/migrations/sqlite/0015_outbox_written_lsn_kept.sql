-- idem, SQLite, version 15: nothing to change, the version keeps both engines in step.
-- On PostgreSQL this version keeps each outbox row's `written_lsn` on UPDATE (the CDC relay's
-- drain reads it). SQLite has no such column.
SELECT 1;
