-- Ends attempt ?2 of intent ?1 (see the PostgreSQL version, which takes a batch as arrays): run
-- once per attempt inside one BEGIN IMMEDIATE; ?7 is the next attempt time (Unix ms).
UPDATE {effect_intents}
SET status = ?3, response_status = ?4, response_body = ?5, last_error = ?6,
    sending_attempt = CASE WHEN ?3 <> 'pending' OR sending_attempt = ?2 THEN NULL ELSE sending_attempt END,
    next_attempt_at = ?7, claimed_until = NULL, updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE id = ?1 AND attempts = ?2 AND status = 'pending'
