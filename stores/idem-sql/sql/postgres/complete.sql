-- Marks the rows of claim $2 in one autocommit statement: $1 are published; the rows of
-- UNNEST($3..$8) are released for a later attempt or parked. Both are fenced by the claim id, so
-- a relay that lost its lease changes nothing; the counts say how many rows each part changed
-- (the rest were fenced). A row listed in both is only marked published. The statement's
-- transaction commits without waiting for the WAL flush (`synchronous_commit = off`, local to it):
-- a mark lost to a PostgreSQL crash leaves the rows leased until the lease ends, then they are
-- published again and the consumer's inbox absorbs the copies, as after a relay crash before the
-- mark. WAL is replayed in order, so a lost mark takes every later claim and mark with it.
WITH marked AS (
    UPDATE {outbox}
    SET status = 'published', published_at = now(), claim_id = NULL, claimed_by = NULL,
        claimed_until = NULL, last_error = NULL
    WHERE id = ANY($1) AND claim_id = $2
    RETURNING id
),
released AS (
    UPDATE {outbox} u
    SET claim_id = NULL, claimed_by = NULL, claimed_until = NULL,
        last_error = f.reason,
        next_attempt_at = now() + f.backoff_ms * interval '1 millisecond',
        status = CASE WHEN f.park THEN 'parked' ELSE 'pending' END,
        attempts = CASE WHEN f.attempted THEN u.attempts ELSE u.attempts - 1 END,
        -- Saturating, like the claim's count: a writer may insert any value.
        permanent_failures = CASE WHEN f.permanent THEN LEAST(u.permanent_failures, 2147483646) + 1
                                  ELSE u.permanent_failures END
    FROM UNNEST($3::bigint[], $4::text[], $5::bigint[], $6::bool[], $7::bool[], $8::bool[])
         AS f(id, reason, backoff_ms, park, attempted, permanent)
    WHERE u.id = f.id AND u.claim_id = $2 AND NOT (u.id = ANY($1))
    RETURNING u.id
)
SELECT (SELECT count(*) FROM marked) AS marked, (SELECT count(*) FROM released) AS released,
       set_config('synchronous_commit', 'off', true) AS synchronous_commit
