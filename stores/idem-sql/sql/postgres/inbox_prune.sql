-- Deletes up to $2 processed inbox rows processed and last delivered more than $1 seconds ago
-- (database clock). Dead-lettered rows stay: they record what was not applied. Rows a consumer
-- is recording right now are locked and skipped.
WITH doomed AS (
    SELECT consumer_group, event_id FROM {inbox}
    WHERE status = 'processed'
      AND processed_at < now() - $1 * interval '1 second'
      AND last_delivered_at < now() - $1 * interval '1 second'
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {inbox} i USING doomed d
WHERE i.consumer_group = d.consumer_group AND i.event_id = d.event_id
