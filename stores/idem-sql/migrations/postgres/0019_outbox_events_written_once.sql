-- idem outbox, PostgreSQL, version 19: an event is what its INSERT wrote.
--
-- The columns that make the event (its id, aggregate, type, payload, headers, topic,
-- traceparent and times) cannot change while the row is pending or published. The CDC relay
-- streams the INSERT (its publication publishes inserts only), so an UPDATE in the inserting
-- transaction, as an ORM's flush-then-update does, would commit one event while the CDC relay
-- published another and marked the row published; the polling relay, which reads the committed
-- row, would publish the updated one. Refusing the UPDATE keeps what every relay publishes equal
-- to what committed. A parked row may still be corrected, then `idem outbox retry` returns it
-- to pending (the CDC relay's drain and the polling relay read the table). The refusal names the
-- rule `<outbox>_written_once_check`, SQLSTATE 23514 like the other writer rules.
DO $mig$
BEGIN
    EXECUTE $fn$
CREATE OR REPLACE FUNCTION {outbox_keep_event}() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $idem$
BEGIN
    IF OLD.status <> 'parked' AND (
           NEW.event_id IS DISTINCT FROM OLD.event_id
        OR NEW.aggregate_type IS DISTINCT FROM OLD.aggregate_type
        OR NEW.aggregate_id IS DISTINCT FROM OLD.aggregate_id
        OR NEW.event_type IS DISTINCT FROM OLD.event_type
        OR NEW.payload IS DISTINCT FROM OLD.payload
        OR NEW.headers IS DISTINCT FROM OLD.headers
        OR NEW.topic IS DISTINCT FROM OLD.topic
        OR NEW.traceparent IS DISTINCT FROM OLD.traceparent
        OR NEW.occurred_at IS DISTINCT FROM OLD.occurred_at
        OR NEW.created_at IS DISTINCT FROM OLD.created_at) THEN
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
    RETURN NEW;
END
$idem$;
$fn$;
END
$mig$;

DROP TRIGGER IF EXISTS "{bare:outbox}_written_once" ON {outbox};
CREATE TRIGGER "{bare:outbox}_written_once"
    BEFORE UPDATE OF event_id, aggregate_type, aggregate_id, event_type, payload, headers, topic,
        traceparent, occurred_at, created_at
    ON {outbox} FOR EACH ROW EXECUTE FUNCTION {outbox_keep_event}();
