-- idem, SQLite, version 21: nothing to change, the version keeps both engines in step.
-- On PostgreSQL this version checks the writer's rules when a parked row returns to pending
-- and refuses an UPDATE of aggregate_seq; SQLite checks a row's CHECK constraints at every
-- UPDATE already.
SELECT 1;
