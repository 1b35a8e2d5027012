-- Marks attempt ?2 of intent ?1 as sending, only while that attempt's lease ends at or after
-- ?3 (Unix ms: now plus the time the request needs). Committed before the request goes out.
UPDATE {effect_intents}
SET sending_attempt = ?2, updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE id = ?1 AND attempts = ?2 AND status = 'pending' AND claimed_until >= ?3
