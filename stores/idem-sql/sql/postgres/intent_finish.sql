-- Ends attempt $2 of intent $1: $3 new status, $4 response status, $5 response body, $6 error,
-- $7 ms until the next attempt. Fenced by the attempt number. Clears this attempt's sending
-- mark, and any mark once the intent leaves 'pending'; a retry of an attempt that sent nothing
-- keeps an earlier attempt's mark.
UPDATE {effect_intents}
SET status = $3, response_status = $4, response_body = $5, last_error = $6,
    sending_attempt = CASE WHEN $3 <> 'pending' OR sending_attempt = $2 THEN NULL ELSE sending_attempt END,
    next_attempt_at = now() + $7 * interval '1 millisecond', claimed_until = NULL, updated_at = now()
WHERE id = $1 AND attempts = $2 AND status = 'pending'
