-- Leases up to ?1 due intents until ?2; ?3 is now (Unix ms). Runs inside BEGIN IMMEDIATE.
UPDATE {effect_intents}
SET attempts = attempts + 1, claimed_until = ?2, updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE id IN (
    SELECT id FROM {effect_intents}
    WHERE status = 'pending' AND next_attempt_at <= ?3 AND (claimed_until IS NULL OR claimed_until < ?3)
    ORDER BY next_attempt_at, id
    LIMIT ?1)
RETURNING id, idem_key, effect, target, event_id, body, traceparent, attempts, sending_attempt
