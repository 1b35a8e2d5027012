-- Slot $1 as the relay and its metrics see it: its plugin and database, whether a session
-- reads it, how far it confirmed, how many bytes of WAL it holds, and whether that WAL is still
-- there (`wal_status` 'lost' means max_slot_wal_keep_size removed WAL the slot needed).
SELECT s.plugin, s.slot_type, s.database, s.active, s.active_pid, s.wal_status,
       s.confirmed_flush_lsn::text AS confirmed_flush_lsn,
       (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint AS lag_bytes,
       s.safe_wal_size
FROM pg_replication_slots s
WHERE s.slot_name = $1
