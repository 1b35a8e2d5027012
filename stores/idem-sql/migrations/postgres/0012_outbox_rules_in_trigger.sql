-- idem outbox, PostgreSQL, version 12: the writer's rules are checked by the trigger.
--
-- The seven CHECK constraints on what a writer sets (aggregate_type, event_type, aggregate_id,
-- headers, topic, occurred_at, created_at) were a quarter of a one-row outbox insert: PostgreSQL
-- reads and plans a table's CHECK expressions again for every statement, and a business
-- transaction writes its event in a statement of its own (minimum 131-144 µs per insert with
-- them, 89-92 µs without, on the 2-core development machine; docs/operating/performance.md,
-- "Writer's outbox row, profiled"). A row trigger now checks the same rules, as plpgsql
-- expressions compiled once per session (106-117 µs in all), and refuses a row with the same
-- SQLSTATE (23514, check_violation) and the same constraint name as before. It fires on INSERT
-- and on an UPDATE that sets any of these columns (idem's own updates set none of them), and
-- before the numbering trigger: PostgreSQL fires a table's BEFORE triggers in name order, and
-- "_accept" sorts before "_assign_seq", so a refused row takes no number. The status check stays
-- a constraint: the relay's updates set it.
--
-- A row stored before version 6 with a timestamp no client can hold is no longer re-checked
-- when the relay leases or parks it (a NOT VALID constraint still checked every update of such
-- a row, so the claim that should park it failed, again and again).
CREATE OR REPLACE FUNCTION {outbox_check_row}() RETURNS trigger
LANGUAGE plpgsql AS $idem$
DECLARE
    broken text;
    rule text;
BEGIN
    IF NOT (length(NEW.aggregate_type) <= 200 AND NEW.aggregate_type ~ '^[A-Za-z0-9][A-Za-z0-9._-]*$') THEN
        broken := 'aggregate_type';
        rule := 'one to 200 of [A-Za-z0-9._-], starting with a letter or digit';
    ELSIF NOT (length(NEW.event_type) <= 255 AND NEW.event_type ~ '^[A-Za-z0-9][A-Za-z0-9._-]*$') THEN
        broken := 'event_type';
        rule := 'one to 255 of [A-Za-z0-9._-], starting with a letter or digit';
    ELSIF NOT (NEW.aggregate_id <> '' AND octet_length(NEW.aggregate_id) <= 512
               AND NEW.aggregate_id !~ '[[:cntrl:]]') THEN
        broken := 'aggregate_id';
        rule := 'non-empty, at most 512 bytes, no control characters';
    ELSIF NOT (jsonb_typeof(NEW.headers) = 'object') THEN
        broken := 'headers';
        rule := 'a JSON object';
    ELSIF NOT (NEW.topic IS NULL OR (length(NEW.topic) BETWEEN 1 AND 249 AND NEW.topic ~ '^[A-Za-z0-9._-]+$')) THEN
        broken := 'topic';
        rule := 'NULL, or one to 249 of [A-Za-z0-9._-]';
    ELSIF NOT (NEW.occurred_at >= '0001-01-01 00:00:00+00' AND NEW.occurred_at < '10000-01-01 00:00:00+00') THEN
        broken := 'occurred_at';
        rule := 'from year 1 to year 9999 (not infinity)';
    ELSIF NOT (NEW.created_at >= '0001-01-01 00:00:00+00' AND NEW.created_at < '10000-01-01 00:00:00+00') THEN
        broken := 'created_at';
        rule := 'from year 1 to year 9999 (not infinity)';
    END IF;
    IF broken IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "%" violates check constraint "%"',
                TG_TABLE_NAME, TG_TABLE_NAME || '_' || broken || '_check'
            USING ERRCODE = 'check_violation',
                  DETAIL = format('%s must be %s.', broken, rule),
                  SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = broken,
                  CONSTRAINT = TG_TABLE_NAME || '_' || broken || '_check';
    END IF;
    RETURN NEW;
END
$idem$;

DROP TRIGGER IF EXISTS "{bare:outbox}_accept" ON {outbox};
CREATE TRIGGER "{bare:outbox}_accept"
    BEFORE INSERT OR UPDATE OF aggregate_type, aggregate_id, event_type, headers, topic, occurred_at, created_at
    ON {outbox} FOR EACH ROW EXECUTE FUNCTION {outbox_check_row}();

ALTER TABLE {outbox}
    DROP CONSTRAINT IF EXISTS "{bare:outbox}_aggregate_type_check",
    DROP CONSTRAINT IF EXISTS "{bare:outbox}_event_type_check",
    DROP CONSTRAINT IF EXISTS "{bare:outbox}_aggregate_id_check",
    DROP CONSTRAINT IF EXISTS "{bare:outbox}_headers_check",
    DROP CONSTRAINT IF EXISTS "{bare:outbox}_topic_check",
    DROP CONSTRAINT IF EXISTS "{bare:outbox}_occurred_at_check",
    DROP CONSTRAINT IF EXISTS "{bare:outbox}_created_at_check";
