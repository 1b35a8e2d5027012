-- idem, SQLite, version 14: nothing to change, the version keeps both engines in step.
-- On PostgreSQL this version records each outbox row's WAL insert position (`written_lsn`), for
-- the CDC relay's drain. SQLite has no WAL positions a relay could stream from.
SELECT 1;
