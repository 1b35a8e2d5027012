-- Ceiling, relay: claims the $1 oldest pending rows (SKIP LOCKED: never waits for another
-- claimer) and marks them published in one autocommit statement, returning what a relay
-- produces. Lean SQL of the bench, not idem's claim.
WITH claimed AS (
    SELECT id FROM idem_outbox
    WHERE status = 'pending'
    ORDER BY id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE idem_outbox o
SET status = 'published', published_at = now()
FROM claimed
WHERE o.id = claimed.id
RETURNING o.id, o.event_id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload::text,
          o.headers::text
