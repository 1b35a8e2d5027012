-- Marks attempt ?2 of intent ?1 as sending, only while that attempt's lease ends at or after
-- ?3 (Unix ms: now plus the time the request needs). Committed before the request goes out. No
-- later attempt claims the intent before ?4 (Unix ms: now plus the policy's settle): the remote
-- may still be processing this request if its sender dies, and a probe asked sooner would miss
-- it.
UPDATE {effect_intents}
SET sending_attempt = ?2, next_attempt_at = ?4,
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE id = ?1 AND attempts = ?2 AND status = 'pending' AND claimed_until >= ?3
