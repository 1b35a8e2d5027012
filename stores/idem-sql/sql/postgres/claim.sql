-- Leases up to $1 rows to claim $2 (relay $3) for $4 milliseconds. Runs after claim_guard.sql,
-- in the same transaction.
--
-- A head is the earliest pending row (in aggregate commit order) of its aggregate. Only heads
-- that are not leased and are past their backoff are locked (SKIP LOCKED: two relays never
-- wait for each other); the claim then takes a prefix of each locked head's pending rows.
-- Another relay cannot take a later row of a locked aggregate: that row is not a head.
--
-- `heads` walks `pending_idx` in id order and stops at the $1-th lockable head: the probes run
-- for the rows walked, not for a window filtered before its limit. Rows that are not
-- claimable heads (one aggregate whose head backs off or is leased, and whose rows fill the
-- oldest positions; heads another relay is locking) are walked past at one index probe each,
-- so they never hide the other aggregates.
--
-- Every lookup is written so that an index drives it whatever the statistics say (after a mass
-- re-pend they can claim that no row is pending, and a nested loop over a whole index would be
-- quadratic): the probes are correlated subqueries (OFFSET 0 keeps them from becoming joins)
-- ordered by aggregate_seq, which only `pending_aggregate_idx` gives without a sort (rows
-- written after the last ANALYZE make `pending_idx` look empty, and a probe through it walks
-- every pending row: 500 probes of 20 000 rows, 7 s a claim),
-- each head's members come from a LATERAL scan of `pending_aggregate_idx` in aggregate order,
-- and the leased rows are found by primary key (the status test is a CASE so that no partial
-- index on status can be chosen instead). claim_guard.sql rules out the sorts and bounds the rest.
WITH heads AS (
    SELECT o.id, o.aggregate_type, o.aggregate_id, o.aggregate_seq
    FROM {outbox} o
    WHERE o.status = 'pending'
      AND o.next_attempt_at <= now()
      AND (o.claimed_until IS NULL OR o.claimed_until < clock_timestamp())
      AND NOT EXISTS (
          SELECT 1 FROM {outbox} p
          WHERE p.status = 'pending'
            AND p.aggregate_type = o.aggregate_type
            AND p.aggregate_id = o.aggregate_id
            AND p.aggregate_seq < o.aggregate_seq
          ORDER BY p.aggregate_seq
          OFFSET 0)
      -- No row of the aggregate may be leased to anyone (e.g. after a parked head was retried).
      AND NOT EXISTS (
          SELECT 1 FROM {outbox} q
          WHERE q.status = 'pending'
            AND q.aggregate_type = o.aggregate_type
            AND q.aggregate_id = o.aggregate_id
            AND q.claim_id IS NOT NULL
            AND q.claimed_until >= clock_timestamp()
          ORDER BY q.aggregate_seq
          OFFSET 0)
    ORDER BY o.id
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED
),
members AS (
    SELECT m.id, m.rank, h.id AS head_id
    FROM heads h
    CROSS JOIN LATERAL (
        SELECT r.id, row_number() OVER (ORDER BY r.aggregate_seq) AS rank
        FROM {outbox} r
        WHERE r.status = 'pending'
          AND r.aggregate_type = h.aggregate_type
          AND r.aggregate_id = h.aggregate_id
          AND r.aggregate_seq >= h.aggregate_seq
        ORDER BY r.aggregate_seq
        LIMIT $1
    ) m
),
chosen AS (
    SELECT id FROM members ORDER BY rank, head_id LIMIT $1
)
UPDATE {outbox} u
SET claim_id = $2,
    claimed_by = $3,
    claimed_until = clock_timestamp() + $4 * interval '1 millisecond',
    attempts = u.attempts + 1
-- Only the heads are locked: a member row may have been leased by a claim that committed while
-- this one waited for it (after `idem outbox retry` made an earlier row the head). Re-checked
-- on the row as committed, so two claims never hold rows of one aggregate.
WHERE u.id = ANY (ARRAY(SELECT id FROM chosen))
  AND CASE u.status WHEN 'pending' THEN true ELSE false END
  AND (u.claimed_until IS NULL OR u.claimed_until < clock_timestamp())
RETURNING u.id, u.event_id, u.aggregate_type, u.aggregate_id, u.aggregate_seq, u.event_type,
          u.payload::text AS payload, u.headers, u.topic, u.traceparent, u.occurred_at, u.created_at,
          u.attempts, u.permanent_failures
