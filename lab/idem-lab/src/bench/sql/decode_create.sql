-- The CDC decode ceiling's slot: temporary (dropped with the session), pgoutput, as the CDC
-- relay creates its own.
SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', true)
