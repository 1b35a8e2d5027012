-- Leases up to $1 due intents for $2 ms; the attempt number is the fencing token.
WITH due AS (
    SELECT id FROM {effect_intents}
    WHERE status = 'pending' AND next_attempt_at <= now()
      AND (claimed_until IS NULL OR claimed_until < clock_timestamp())
    ORDER BY next_attempt_at, id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE {effect_intents} i
SET attempts = i.attempts + 1, claimed_until = clock_timestamp() + $2 * interval '1 millisecond', updated_at = now()
FROM due WHERE i.id = due.id
RETURNING i.id, i.idem_key, i.effect, i.target, i.event_id, i.body::text AS body, i.traceparent, i.attempts,
          i.sending_attempt
