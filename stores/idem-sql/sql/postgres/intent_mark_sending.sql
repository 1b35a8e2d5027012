-- Marks attempt $2 of intent $1 as sending, only while that attempt holds the lease for at
-- least $3 ms more (by this server's clock). Committed before the request goes out. No later
-- attempt claims the intent before $4 ms from now (the policy's settle): the remote may still
-- be processing this request if its sender dies, and a probe asked sooner would miss it.
UPDATE {effect_intents}
SET sending_attempt = $2,
    next_attempt_at = clock_timestamp() + $4 * interval '1 millisecond',
    updated_at = now()
WHERE id = $1 AND attempts = $2 AND status = 'pending'
  AND claimed_until >= clock_timestamp() + $3 * interval '1 millisecond'
