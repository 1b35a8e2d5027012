-- Marks the outbox rows $1, whose events Kafka acknowledged and whose transactions the slot
-- confirmed, as published (so that `idem outbox status`, pruning and `idem verify` see them).
-- The CDC relay never reads the table: a mark lost to a crash only leaves a published row
-- looking pending. Commits without waiting for the WAL flush, for the same reason.
WITH marked AS (
    UPDATE {outbox}
    SET status = 'published', published_at = now(), attempts = LEAST(attempts, 2147483646) + 1,
        last_error = NULL
    WHERE id = ANY($1) AND status = 'pending'
    RETURNING id
)
SELECT (SELECT count(*) FROM marked) AS marked,
       set_config('synchronous_commit', 'off', true) AS synchronous_commit
