-- The logical pgoutput slots of the current database (the CDC relays' slots), by name.
SELECT slot_name::text FROM pg_replication_slots
WHERE database = current_database() AND slot_type = 'logical' AND plugin = 'pgoutput'
ORDER BY slot_name
