-- idem outbox, SQLite, version 12: nothing to change, the version keeps both engines in step.
-- On PostgreSQL this version moves the writer's rules from CHECK constraints, which PostgreSQL
-- prepares afresh for every statement, into the BEFORE INSERT trigger. SQLite keeps its CHECK
-- constraints: it compiles them into the prepared INSERT, once per statement cache entry.
SELECT 1;
