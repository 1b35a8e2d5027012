-- idem outbox, PostgreSQL, version 15: `written_lsn` cannot be changed by an UPDATE either.
--
-- Version 14's trigger stamps the WAL insert position on INSERT, whatever the writer supplied.
-- An UPDATE could still set it (a role with UPDATE on the outbox, a script): a pending row moved
-- past every slot's confirmed position would be skipped by the CDC relay's session-start drain
-- and never streamed (the stream carries inserts only), so it would stay pending. The same
-- function now keeps the old position on an UPDATE that names the column; the relay's own
-- updates (marks, parking, `idem outbox retry`) never name it, so they do not fire it.
CREATE OR REPLACE FUNCTION {outbox_stamp_lsn}() RETURNS trigger
LANGUAGE plpgsql AS $idem$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.written_lsn := pg_current_wal_insert_lsn();
    ELSE
        NEW.written_lsn := OLD.written_lsn;
    END IF;
    RETURN NEW;
END
$idem$;

DROP TRIGGER IF EXISTS "{bare:outbox}_written_lsn" ON {outbox};
CREATE TRIGGER "{bare:outbox}_written_lsn"
    BEFORE INSERT OR UPDATE OF written_lsn ON {outbox} FOR EACH ROW
    EXECUTE FUNCTION {outbox_stamp_lsn}();
