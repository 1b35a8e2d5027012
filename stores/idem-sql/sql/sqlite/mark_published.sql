-- Marks one row published, fenced by the claim id (?2). Run for each row inside one transaction.
UPDATE {outbox}
SET status = 'published', published_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), claim_id = NULL,
    claimed_by = NULL, claimed_until = NULL, last_error = NULL
WHERE id = ?1 AND claim_id = ?2
