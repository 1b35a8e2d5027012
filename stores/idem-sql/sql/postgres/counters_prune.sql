-- Deletes the counter rows counters_lock.sql locked ($1 aggregate types, $2 ids) whose aggregate
-- still has no pending or parked outbox row. Runs in the same READ COMMITTED transaction, in a
-- snapshot taken after the locks: a writer that committed a row of the aggregate before the
-- lock is seen here and its counter stays; a writer that comes later waits for this
-- transaction, then finds no counter and numbers the aggregate from 1 again, above every
-- pending row of it (there is none).
DELETE FROM {outbox_aggregates} a
USING unnest($1::text[], $2::text[]) AS l(aggregate_type, aggregate_id)
WHERE a.aggregate_type = l.aggregate_type AND a.aggregate_id = l.aggregate_id
  AND NOT EXISTS (SELECT 1 FROM {outbox} o
                  WHERE o.aggregate_type = l.aggregate_type AND o.aggregate_id = l.aggregate_id
                    AND o.status = 'pending')
  AND NOT EXISTS (SELECT 1 FROM {outbox} o
                  WHERE o.aggregate_type = l.aggregate_type AND o.aggregate_id = l.aggregate_id
                    AND o.status = 'parked')
