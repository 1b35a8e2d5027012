SELECT id, idem_key, effect, target, event_id, body::text AS body, traceparent, attempts, sending_attempt, status
FROM {effect_intents} WHERE id = $1
