-- idem outbox, PostgreSQL, version 21: a parked row returns to pending only if the writer's
-- rules accept it, and aggregate_seq is numbered at insert only.
--
-- The rules of the accept trigger run at INSERT and at an UPDATE of the columns they read, not
-- at a status change. A row the rules refuse, parked by a migration because it was stored
-- before its rule (a byte that does not convert to UTF-8, version 17; an infinite timestamp,
-- version 6), went back to pending through `idem outbox retry --all`, and no relay could read it
-- again: every claim failed for every aggregate. The same rules now run when a parked row
-- becomes pending: the UPDATE is refused with the rule's name, the row stays parked with its
-- reason, and nothing else changes (correct the row, then retry it).
--
-- aggregate_seq is the commit order the numbering trigger gives at INSERT; an UPDATE of it (in
-- the inserting transaction, which the CDC relay streams as inserted) would publish one number
-- and commit another. It is refused as `<outbox>_written_once_check`, parked or not.
DROP TRIGGER IF EXISTS "{bare:outbox}_unpark" ON {outbox};
CREATE TRIGGER "{bare:outbox}_unpark"
    BEFORE UPDATE OF status ON {outbox}
    FOR EACH ROW WHEN (OLD.status = 'parked' AND NEW.status = 'pending')
    EXECUTE FUNCTION {outbox_check_row}();

DO $mig$
BEGIN
    EXECUTE $fn$
CREATE OR REPLACE FUNCTION {outbox_keep_seq}() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $idem$
BEGIN
    IF NEW.aggregate_seq IS DISTINCT FROM OLD.aggregate_seq THEN
        RAISE EXCEPTION 'new row for relation "%" violates check constraint "%"',
                TG_TABLE_NAME, TG_TABLE_NAME || '_written_once_check'
            USING ERRCODE = 'check_violation',
                  DETAIL = 'aggregate_seq is the commit order the outbox numbers at INSERT; it '
                      'never changes.',
                  SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'aggregate_seq',
                  CONSTRAINT = TG_TABLE_NAME || '_written_once_check';
    END IF;
    RETURN NEW;
END
$idem$;
$fn$;
END
$mig$;

DROP TRIGGER IF EXISTS "{bare:outbox}_seq_once" ON {outbox};
CREATE TRIGGER "{bare:outbox}_seq_once"
    BEFORE UPDATE OF aggregate_seq ON {outbox}
    FOR EACH ROW EXECUTE FUNCTION {outbox_keep_seq}();
