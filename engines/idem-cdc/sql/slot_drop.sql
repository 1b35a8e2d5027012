-- Drops slot $1 (it must not be in use): the WAL it held is released.
SELECT pg_drop_replication_slot($1)
