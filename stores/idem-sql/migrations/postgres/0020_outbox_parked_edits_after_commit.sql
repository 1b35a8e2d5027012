-- idem outbox, PostgreSQL, version 20: a parked row is corrected in a later transaction.
--
-- Version 19 lets a parked row's event columns change, so that an operator can correct it
-- and retry it. Within the transaction that wrote the row, that opening would undo the rule:
-- INSERT, park, edit, unpark and COMMIT publishes, through the CDC relay (which streams the
-- INSERT), the inserted event while the edited one committed. A parked row's event columns
-- may change only when its current version was written by an earlier, committed transaction:
-- a row version written by this transaction or one of its subtransactions carries an xmin whose
-- transaction lock this backend holds (PostgreSQL keeps a subtransaction's lock with its parent
-- until the top transaction ends). The refusal names `<outbox>_written_once_check`, 23514.
DO $mig$
BEGIN
    EXECUTE $fn$
CREATE OR REPLACE FUNCTION {outbox_keep_event}() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $idem$
DECLARE
    changed boolean := NEW.event_id IS DISTINCT FROM OLD.event_id
        OR NEW.aggregate_type IS DISTINCT FROM OLD.aggregate_type
        OR NEW.aggregate_id IS DISTINCT FROM OLD.aggregate_id
        OR NEW.event_type IS DISTINCT FROM OLD.event_type
        OR NEW.payload IS DISTINCT FROM OLD.payload
        OR NEW.headers IS DISTINCT FROM OLD.headers
        OR NEW.topic IS DISTINCT FROM OLD.topic
        OR NEW.traceparent IS DISTINCT FROM OLD.traceparent
        OR NEW.occurred_at IS DISTINCT FROM OLD.occurred_at
        OR NEW.created_at IS DISTINCT FROM OLD.created_at;
BEGIN
    IF NOT changed THEN
        RETURN NEW;
    END IF;
    IF OLD.status <> 'parked' THEN
        RAISE EXCEPTION 'new row for relation "%" violates check constraint "%"',
                TG_TABLE_NAME, TG_TABLE_NAME || '_written_once_check'
            USING ERRCODE = 'check_violation',
                  DETAIL = pg_catalog.format(
                      'An event cannot change once written (this one is %s): a relay may '
                      'already have published what the INSERT wrote. Write a new event instead; '
                      'only a parked row may be corrected, then `idem outbox retry`.', OLD.status),
                  SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
                  CONSTRAINT = TG_TABLE_NAME || '_written_once_check';
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_locks l
                WHERE l.locktype = 'transactionid' AND l.pid = pg_catalog.pg_backend_pid()
                  AND l.transactionid = OLD.xmin) THEN
        RAISE EXCEPTION 'new row for relation "%" violates check constraint "%"',
                TG_TABLE_NAME, TG_TABLE_NAME || '_written_once_check'
            USING ERRCODE = 'check_violation',
                  DETAIL = 'This transaction wrote or parked the row: a relay may publish what '
                      'its INSERT wrote. Commit the park first, then correct the row in a later '
                      'transaction and `idem outbox retry` it.',
                  SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME,
                  CONSTRAINT = TG_TABLE_NAME || '_written_once_check';
    END IF;
    RETURN NEW;
END
$idem$;
$fn$;
END
$mig$;
