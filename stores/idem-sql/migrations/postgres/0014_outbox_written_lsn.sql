-- idem outbox, PostgreSQL, version 14: each row records where in the WAL it was written.
--
-- `written_lsn` is the server's WAL insert position when the row was inserted, set by a BEFORE
-- INSERT trigger whatever the writer supplied (a writer cannot move it). The row's transaction
-- commits after that position, so a row whose `written_lsn` is at or past a logical slot's
-- confirmed position is in that slot's stream. The CDC relay's session-start drain publishes
-- only the other pending rows (written before the slot's confirmed position: rows older than
-- the slot, retried rows, rows whose mark was lost), so a relay restarted after an outage
-- streams its backlog instead of publishing it twice (engines/idem-cdc/src/drain.rs). Rows
-- written before this version have NULL: the drain treats them as written before any slot.
-- Adding a column without a default rewrites nothing. The archive gets it too, in the same
-- place (last), so that `prune --archive` still moves rows with `SELECT *`.
ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS written_lsn pg_lsn;
ALTER TABLE {outbox_archive} ADD COLUMN IF NOT EXISTS written_lsn pg_lsn;

CREATE OR REPLACE FUNCTION {outbox_stamp_lsn}() RETURNS trigger
LANGUAGE plpgsql AS $idem$
BEGIN
    NEW.written_lsn := pg_current_wal_insert_lsn();
    RETURN NEW;
END
$idem$;

DROP TRIGGER IF EXISTS "{bare:outbox}_written_lsn" ON {outbox};
CREATE TRIGGER "{bare:outbox}_written_lsn"
    BEFORE INSERT ON {outbox} FOR EACH ROW EXECUTE FUNCTION {outbox_stamp_lsn}();
