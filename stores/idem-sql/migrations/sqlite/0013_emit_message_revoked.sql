-- idem, SQLite, version 13: nothing to change, the version keeps both engines in step.
-- On PostgreSQL this version revokes pg_logical_emit_message from PUBLIC, so that only a role
-- granted it can write events for the CDC relay's message mode. SQLite has no logical decoding,
-- no such function and no roles: message mode does not exist here.
SELECT 1;
