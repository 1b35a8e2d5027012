-- idem, PostgreSQL, version 13: pg_logical_emit_message is revoked from PUBLIC.
--
-- In the CDC relay's message mode (idem cdc relay --messages) an outbox event is a
-- transactional logical decoding message with the relay's prefix. PostgreSQL grants
-- pg_logical_emit_message to PUBLIC, so any role that can connect could inject events that
-- the relay publishes with the wire contract of a real event. This version takes EXECUTE away
-- from PUBLIC on every overload present (text and bytea content, and PostgreSQL 17's overloads
-- with a flush argument); a writing role is then granted it by name:
--
--   GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) TO app_writer;
--
-- The functions belong to the bootstrap superuser, so only a superuser (or that owner) can
-- revoke: run by another role, the migration does not fail but raises a WARNING with the
-- statements to run as a superuser, and `idem cdc relay --messages` warns at start and sets the
-- gauge idem_cdc_emit_open_to_public to 1 while PUBLIC can still call the function. The
-- privileges are per database; every table prefix migrated in the database repeats this, which
-- changes nothing the second time.
DO $idem$
DECLARE
    signature text;
    f regprocedure;
    open_to_public text := '';
BEGIN
    FOREACH signature IN ARRAY ARRAY[
        'pg_catalog.pg_logical_emit_message(boolean,text,text)',
        'pg_catalog.pg_logical_emit_message(boolean,text,bytea)',
        'pg_catalog.pg_logical_emit_message(boolean,text,text,boolean)',
        'pg_catalog.pg_logical_emit_message(boolean,text,bytea,boolean)'
    ] LOOP
        f := to_regprocedure(signature);
        CONTINUE WHEN f IS NULL;
        BEGIN
            EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
        EXCEPTION WHEN insufficient_privilege THEN
            NULL; -- reported below with the other overloads PUBLIC can still call
        END;
        -- A REVOKE by a role that holds no grant option changes nothing and only warns:
        -- check the outcome, not the statement.
        IF EXISTS (
            SELECT 1
            FROM pg_catalog.pg_proc p, LATERAL aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
            WHERE p.oid = f AND a.grantee = 0 AND a.privilege_type = 'EXECUTE'
        ) THEN
            open_to_public := open_to_public || format(E'\n  REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC;', f);
        END IF;
    END LOOP;
    IF open_to_public <> '' THEN
        RAISE WARNING 'idem: PUBLIC can still execute pg_logical_emit_message, so any role can write events for the CDC relay''s message mode; role % may not revoke it. Run as a superuser in database %:%',
            current_user, current_database(), open_to_public;
    END IF;
END
$idem$;
