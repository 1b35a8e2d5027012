-- idem, SQLite, version 16: nothing to change, the version keeps both engines in step.
-- On PostgreSQL this version gives the outbox's trigger functions their own search_path and
-- schema-qualified names. SQLite has no search_path.
SELECT 1;
