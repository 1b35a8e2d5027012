-- idem outbox, PostgreSQL, version 17: in a database whose encoding is not UTF8, a row's text
-- must convert to UTF-8, the relays' client encoding.
--
-- A SQL_ASCII database stores any byte. A row whose aggregate_id, payload, headers or
-- traceparent held a byte sequence that is not UTF-8 passed every rule, and then no relay could
-- read it: the server refuses to send it to a UTF8 client (SQLSTATE 22021), so the polling
-- relay's claim, whose RETURNING carries the row, failed for every aggregate, and the CDC slot's
-- walsender failed every session on the same transaction. Another server encoding can hold a
-- character with no UTF-8 equivalent (22P05), with the same effect. The accept trigger now
-- refuses such a row at INSERT, and at an UPDATE that sets payload or traceparent as well as the
-- columns of version 12, with the constraint name `<outbox>_<column>_check` like the other
-- rules. In a UTF8 database the check is one comparison of the database's encoding per row: the
-- server has already validated the text. The other columns a writer sets are ASCII by their
-- rules. Pending rows stored before this version that fail the same test are parked with the
-- reason, so the other aggregates flow; `idem outbox parked` lists them.
DO $mig$
DECLARE
    home text := (
        SELECT pg_catalog.quote_ident(n.nspname)
        FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE c.oid = '{outbox}'::pg_catalog.regclass);
BEGIN
    -- The first of the row's text columns that does not convert to UTF-8, or NULL.
    EXECUTE pg_catalog.replace($fn$
CREATE OR REPLACE FUNCTION @home@."{bare:outbox_not_utf8}"(aggregate_id text, payload jsonb, headers jsonb, traceparent text)
RETURNS text LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $idem$
DECLARE
    col text;
    val text;
BEGIN
    FOR col, val IN VALUES ('aggregate_id', aggregate_id), ('payload', payload::text),
                           ('headers', headers::text), ('traceparent', traceparent) LOOP
        BEGIN
            PERFORM pg_catalog.convert_to(val, 'UTF8');
        EXCEPTION WHEN character_not_in_repertoire OR untranslatable_character THEN
            RETURN col;
        END;
    END LOOP;
    RETURN NULL;
END
$idem$;
$fn$, '@home@', home);

    EXECUTE pg_catalog.replace($fn$
CREATE OR REPLACE FUNCTION {outbox_check_row}() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $idem$
DECLARE
    broken text;
    rule text;
BEGIN
    IF NOT (pg_catalog.length(NEW.aggregate_type) <= 200 AND NEW.aggregate_type ~ '^[A-Za-z0-9][A-Za-z0-9._-]*$') THEN
        broken := 'aggregate_type';
        rule := 'one to 200 of [A-Za-z0-9._-], starting with a letter or digit';
    ELSIF NOT (pg_catalog.length(NEW.event_type) <= 255 AND NEW.event_type ~ '^[A-Za-z0-9][A-Za-z0-9._-]*$') THEN
        broken := 'event_type';
        rule := 'one to 255 of [A-Za-z0-9._-], starting with a letter or digit';
    ELSIF NOT (NEW.aggregate_id <> '' AND pg_catalog.octet_length(NEW.aggregate_id) <= 512
               AND NEW.aggregate_id !~ '[[:cntrl:]]') THEN
        broken := 'aggregate_id';
        rule := 'non-empty, at most 512 bytes, no control characters';
    ELSIF NOT (pg_catalog.jsonb_typeof(NEW.headers) = 'object') THEN
        broken := 'headers';
        rule := 'a JSON object';
    ELSIF NOT (NEW.topic IS NULL OR (pg_catalog.length(NEW.topic) BETWEEN 1 AND 249 AND NEW.topic ~ '^[A-Za-z0-9._-]+$')) THEN
        broken := 'topic';
        rule := 'NULL, or one to 249 of [A-Za-z0-9._-]';
    ELSIF NOT (NEW.occurred_at >= '0001-01-01 00:00:00+00' AND NEW.occurred_at < '10000-01-01 00:00:00+00') THEN
        broken := 'occurred_at';
        rule := 'from year 1 to year 9999 (not infinity)';
    ELSIF NOT (NEW.created_at >= '0001-01-01 00:00:00+00' AND NEW.created_at < '10000-01-01 00:00:00+00') THEN
        broken := 'created_at';
        rule := 'from year 1 to year 9999 (not infinity)';
    ELSIF pg_catalog.getdatabaseencoding() <> 'UTF8' THEN
        broken := @home@."{bare:outbox_not_utf8}"(NEW.aggregate_id, NEW.payload, NEW.headers, NEW.traceparent);
        rule := pg_catalog.format('text that converts to UTF-8 (the database encoding is %s)',
                                  pg_catalog.getdatabaseencoding());
    END IF;
    IF broken IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "%" violates check constraint "%"',
                TG_TABLE_NAME, TG_TABLE_NAME || '_' || broken || '_check'
            USING ERRCODE = 'check_violation',
                  DETAIL = pg_catalog.format('%s must be %s.', broken, rule),
                  SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = broken,
                  CONSTRAINT = TG_TABLE_NAME || '_' || broken || '_check';
    END IF;
    RETURN NEW;
END
$idem$;
$fn$, '@home@', home);

    -- Pending rows stored before this version that fail the same test are parked.
    IF pg_catalog.getdatabaseencoding() <> 'UTF8' THEN
        EXECUTE pg_catalog.replace($fn$
        UPDATE {outbox} o
        SET status = 'parked', claim_id = NULL, claimed_by = NULL, claimed_until = NULL,
            last_error = pg_catalog.format(
                'the row cannot be read by a UTF-8 client: its %s does not convert to UTF-8 '
                '(the database encoding is %s); correct it, then `idem outbox retry`',
                @home@."{bare:outbox_not_utf8}"(o.aggregate_id, o.payload, o.headers, o.traceparent),
                pg_catalog.getdatabaseencoding())
        WHERE o.status = 'pending'
          AND @home@."{bare:outbox_not_utf8}"(o.aggregate_id, o.payload, o.headers, o.traceparent) IS NOT NULL
$fn$, '@home@', home);
    END IF;
END
$mig$;

DROP TRIGGER IF EXISTS "{bare:outbox}_accept" ON {outbox};
CREATE TRIGGER "{bare:outbox}_accept"
    BEFORE INSERT OR UPDATE OF aggregate_type, aggregate_id, event_type, payload, headers, topic,
        traceparent, occurred_at, created_at
    ON {outbox} FOR EACH ROW EXECUTE FUNCTION {outbox_check_row}();
