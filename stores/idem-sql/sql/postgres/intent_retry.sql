UPDATE {effect_intents}
SET status = 'pending', next_attempt_at = '-infinity', claimed_until = NULL, sending_attempt = NULL, updated_at = now()
WHERE status IN ('parked', 'unknown') AND ($1::bigint[] IS NULL OR id = ANY($1))
