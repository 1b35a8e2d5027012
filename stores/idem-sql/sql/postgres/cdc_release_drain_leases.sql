-- Ends the leases relay $1's drain still holds: a drain whose mark failed ended its session
-- with its rows leased, and this relay's sessions run one after another, so that drain is over.
-- Without this the next session's drain would wait out the lease (twice the longest publish,
-- plus 10 s) while the stream waits behind it. Leases of any other relay are left to expire.
UPDATE {outbox}
SET claim_id = NULL, claimed_by = NULL, claimed_until = NULL
WHERE status = 'pending' AND claimed_by = $1 AND claimed_until >= clock_timestamp()
