-- Settles parked or unknown intent ?1 as ?2 ('done', 'pending' or 'parked') with the note ?3.
UPDATE {effect_intents}
SET status = ?2, last_error = ?3, next_attempt_at = 0, claimed_until = NULL, sending_attempt = NULL, updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE id = ?1 AND status IN ('parked', 'unknown')
