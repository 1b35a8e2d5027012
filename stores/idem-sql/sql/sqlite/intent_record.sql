INSERT INTO {effect_intents} (idem_key, effect, target, event_id, body, traceparent)
VALUES (?1, ?2, ?3, ?4, ?5, ?6)
ON CONFLICT (idem_key) DO NOTHING
