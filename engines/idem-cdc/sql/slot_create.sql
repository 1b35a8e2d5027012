-- Creates logical slot $1 with pgoutput, without an exported snapshot: every transaction that
-- commits after its consistent point is in its stream.
SELECT lsn::text AS lsn FROM pg_create_logical_replication_slot($1, 'pgoutput')
