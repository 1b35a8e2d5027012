-- The newest row still pending in the outbox and written before the slot's confirmed position
-- $1 (NULL: any pending row), or NULL when there is none. A row written at or after $1 is in
-- the slot's stream (drain.rs).
SELECT max(id) FROM {outbox}
WHERE status = 'pending'
  AND ($1::text IS NULL OR written_lsn IS NULL OR written_lsn < $1::text::pg_lsn)
