-- Locks up to $1 per-aggregate counter rows whose aggregate has no pending or parked outbox
-- row, skipping the rows a writer holds (the trigger's upsert keeps the row locked until the
-- writer's transaction ends). This statement's snapshot may predate a writer that committed
-- since, so counters_prune.sql checks again, in a snapshot taken after these locks.
SELECT c.aggregate_type, c.aggregate_id
FROM {outbox_aggregates} c
WHERE NOT EXISTS (SELECT 1 FROM {outbox} o
                  WHERE o.aggregate_type = c.aggregate_type AND o.aggregate_id = c.aggregate_id
                    AND o.status = 'pending')
  AND NOT EXISTS (SELECT 1 FROM {outbox} o
                  WHERE o.aggregate_type = c.aggregate_type AND o.aggregate_id = c.aggregate_id
                    AND o.status = 'parked')
LIMIT $1
FOR UPDATE OF c SKIP LOCKED
