-- idem outbox, SQLite, version 6: occurred_at must be a timestamp. Version 6 makes PostgreSQL
-- refuse timestamps no client can hold ('infinity', years beyond 9999). SQLite stores them as
-- text: a value that is not a date SQLite can read is now refused at insert (a value the relay
-- still cannot read, such as a bare Julian day number, is parked with the reason).
CREATE TRIGGER IF NOT EXISTS "{bare:outbox}_occurred_at_check"
BEFORE INSERT ON {outbox}
WHEN julianday(NEW.occurred_at) IS NULL
BEGIN
    SELECT RAISE(ABORT, 'occurred_at must be an ISO-8601 timestamp such as 2026-12-01T10:00:00Z');
END;
