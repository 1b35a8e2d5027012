SELECT id, idem_key, effect, status, attempts, last_error
FROM {effect_intents} WHERE status IN ('parked', 'unknown') ORDER BY id LIMIT $1
