-- Deletes up to $2 done effect intents finished more than $1 seconds ago (database clock).
-- Pending, parked and unknown intents stay whatever their age; a claimed row is skipped.
WITH doomed AS (
    SELECT id FROM {effect_intents}
    WHERE status = 'done' AND updated_at < now() - $1 * interval '1 second'
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {effect_intents} e USING doomed d WHERE e.id = d.id
