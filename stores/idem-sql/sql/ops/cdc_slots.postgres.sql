-- Logical replication slots: their confirmed position, the WAL they hold, whether a reader is
-- attached.
SELECT slot_name::text AS name, COALESCE(plugin::text, '') AS plugin, active,
       confirmed_flush_lsn::text AS confirmed,
       pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint AS wal_held
FROM pg_replication_slots
WHERE slot_type = 'logical'
ORDER BY slot_name
