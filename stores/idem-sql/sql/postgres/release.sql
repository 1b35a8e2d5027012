-- Releases failed rows of claim $6 for a later attempt, or parks them.
UPDATE {outbox} u
SET claim_id = NULL, claimed_by = NULL, claimed_until = NULL,
    last_error = f.reason,
    next_attempt_at = now() + f.backoff_ms * interval '1 millisecond',
    status = CASE WHEN f.park THEN 'parked' ELSE 'pending' END,
    attempts = CASE WHEN f.attempted THEN u.attempts ELSE u.attempts - 1 END,
    permanent_failures = CASE WHEN f.permanent THEN u.permanent_failures + 1 ELSE u.permanent_failures END
FROM UNNEST($1::bigint[], $2::text[], $3::bigint[], $4::bool[], $5::bool[], $7::bool[])
     AS f(id, reason, backoff_ms, park, attempted, permanent)
WHERE u.id = f.id AND u.claim_id = $6
