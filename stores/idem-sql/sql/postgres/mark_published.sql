-- Marks rows published; fenced by the claim id ($2) so a relay that lost its lease changes nothing.
UPDATE {outbox}
SET status = 'published', published_at = now(), claim_id = NULL, claimed_by = NULL,
    claimed_until = NULL, last_error = NULL
WHERE id = ANY($1) AND claim_id = $2
