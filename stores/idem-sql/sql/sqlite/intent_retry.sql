UPDATE {effect_intents}
SET status = 'pending', next_attempt_at = 0, claimed_until = NULL, sending_attempt = NULL, updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE status IN ('parked', 'unknown')
