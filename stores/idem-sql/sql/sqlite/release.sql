-- Releases one failed row of claim ?6 (?2 reason, ?3 next attempt at, ?4 park, ?5 attempted,
-- ?7 permanent failure).
UPDATE {outbox}
SET claim_id = NULL, claimed_by = NULL, claimed_until = NULL,
    last_error = ?2,
    next_attempt_at = ?3,
    status = CASE WHEN ?4 THEN 'parked' ELSE 'pending' END,
    attempts = CASE WHEN ?5 THEN attempts ELSE attempts - 1 END,
    permanent_failures = CASE WHEN ?7 THEN permanent_failures + 1 ELSE permanent_failures END
WHERE id = ?1 AND claim_id = ?6
