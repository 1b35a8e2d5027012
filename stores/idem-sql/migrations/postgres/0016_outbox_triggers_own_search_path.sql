-- idem outbox, PostgreSQL, version 16: the trigger functions resolve names through their own
-- search_path, never the writer's.
--
-- A trigger function runs with the inserting session's search_path. The three outbox triggers
-- named their tables unqualified (the default configuration has no schema) and called
-- PostgreSQL's functions unqualified, so a writer could shadow them: a TEMP table named like the
-- counter (pg_temp is searched first for relations, and TEMP is granted to PUBLIC) gave its
-- event any aggregate_seq, a second copy of the next legitimate number among them; a function
-- named pg_current_wal_insert_lsn() in a schema the writer puts ahead of pg_catalog set
-- written_lsn past every slot's position, hiding the row from the CDC relay's drain; shadowed
-- length(), octet_length() or jsonb_typeof() let a row break the writer's rules. Each function
-- now pins `SET search_path = pg_catalog, pg_temp` (PostgreSQL's advice for SECURITY DEFINER and
-- trigger functions: pg_temp explicitly last, where functions and operators are never looked
-- up), names its tables with the schema they are in (read from the catalog here, at migration
-- time, when no schema is configured) and calls functions as pg_catalog.<name>. The bodies are
-- otherwise those of versions 10, 12 and 15.
DO $mig$
DECLARE
    home text := (
        SELECT pg_catalog.quote_ident(n.nspname)
        FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE c.oid = '{outbox}'::pg_catalog.regclass);
BEGIN
    EXECUTE pg_catalog.replace($fn$
CREATE OR REPLACE FUNCTION {outbox_assign_seq}() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $idem$
BEGIN
    INSERT INTO @home@."{bare:outbox_aggregates}" AS a (aggregate_type, aggregate_id, last_seq)
    VALUES (NEW.aggregate_type, NEW.aggregate_id, 1)
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = a.last_seq + 1
    RETURNING a.last_seq INTO NEW.aggregate_seq;
    PERFORM 1 FROM @home@."{bare:outbox}" o WHERE o.event_id = NEW.event_id FOR KEY SHARE OF o;
    IF FOUND THEN
        UPDATE @home@."{bare:outbox_aggregates}" SET last_seq = last_seq - 1
        WHERE aggregate_type = NEW.aggregate_type AND aggregate_id = NEW.aggregate_id;
        NEW.aggregate_seq := 0;
    END IF;
    RETURN NEW;
END
$idem$;
$fn$, '@home@', home);

    EXECUTE $fn$
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
$fn$;

    EXECUTE $fn$
CREATE OR REPLACE FUNCTION {outbox_stamp_lsn}() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $idem$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.written_lsn := pg_catalog.pg_current_wal_insert_lsn();
    ELSE
        NEW.written_lsn := OLD.written_lsn;
    END IF;
    RETURN NEW;
END
$idem$;
$fn$;
END
$mig$;
