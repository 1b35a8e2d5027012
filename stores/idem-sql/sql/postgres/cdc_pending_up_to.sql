-- How many rows up to id $1 are still pending and were written before the slot's confirmed
-- position $2 (NULL: whatever their position).
SELECT count(*) FROM {outbox}
WHERE status = 'pending' AND id <= $1
  AND ($2::text IS NULL OR written_lsn IS NULL OR written_lsn < $2::text::pg_lsn)
