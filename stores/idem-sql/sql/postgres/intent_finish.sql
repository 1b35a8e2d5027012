-- Ends a batch of attempts, one row per element of the arrays: intent id, attempt number, new
-- status, response status, response body, error, ms until the next attempt. Fenced by the
-- attempt number: an attempt whose claim expired and was taken again changes nothing, and its
-- id is not returned. Clears the attempt's sending mark, and any mark once the intent leaves
-- 'pending'; a retry of an attempt that sent nothing keeps an earlier attempt's mark.
UPDATE {effect_intents} i
SET status = f.status, response_status = f.response_status, response_body = f.response_body,
    last_error = f.error,
    sending_attempt = CASE WHEN f.status <> 'pending' OR i.sending_attempt = f.attempt
                           THEN NULL ELSE i.sending_attempt END,
    next_attempt_at = now() + f.backoff_ms * interval '1 millisecond', claimed_until = NULL,
    updated_at = now()
FROM unnest($1::bigint[], $2::int[], $3::text[], $4::int[], $5::text[], $6::text[], $7::bigint[])
     AS f(id, attempt, status, response_status, response_body, error, backoff_ms)
WHERE i.id = f.id AND i.attempts = f.attempt AND i.status = 'pending'
RETURNING i.id
