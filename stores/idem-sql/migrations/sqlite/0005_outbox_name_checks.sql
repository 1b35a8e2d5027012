-- idem outbox, SQLite, version 5: nothing to change. Version 5 makes PostgreSQL's name checks
-- cheaper (bounded regular-expression repetitions were slow there); SQLite's checks use GLOB
-- and length() already. Kept so that one schema version means the same tables on both.
SELECT 1;
