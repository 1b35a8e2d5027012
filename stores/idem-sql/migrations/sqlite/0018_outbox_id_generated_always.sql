-- idem, SQLite, version 18: nothing to change, the version keeps both engines in step.
-- On PostgreSQL this version makes the outbox's id `GENERATED ALWAYS`. SQLite's AUTOINCREMENT
-- continues after the largest id in the table, and no SQLite relay reads an id of 0 as special.
SELECT 1;
