-- idem, SQLite, version 17: nothing to change, the version keeps both engines in step.
-- On PostgreSQL this version refuses outbox text that does not convert to UTF-8 in a database
-- whose encoding is not UTF8. SQLite's text is the application's bytes.
SELECT 1;
