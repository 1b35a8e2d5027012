-- Leases up to $1 rows to claim $2 (relay $3) for $4 milliseconds.
-- $5 bounds how many claimable heads, oldest first, are looked at (NULL: all of them; the store
-- falls back to that when the bounded look finds nothing).
--
-- A head is the earliest pending row (in aggregate commit order) of its aggregate. Only heads
-- that are not leased and are past their backoff are locked (SKIP LOCKED: two relays never
-- wait for each other); the claim then takes a prefix of each locked head's pending rows.
-- Another relay cannot take a later row of a locked aggregate: that row is not a head.
--
-- The window is made of claimable heads, not of the oldest pending rows: one aggregate whose
-- head backs off (or is leased) and whose rows fill the oldest positions must not hide every
-- other aggregate (review §6: the outbox then moved one batch per second). Walking past such a
-- backlog costs one index probe per row it skips. The conditions are checked again in `heads`,
-- on the locked row.
WITH window_rows AS (
    SELECT o.id FROM {outbox} o
    WHERE o.status = 'pending'
      AND o.next_attempt_at <= now()
      AND (o.claimed_until IS NULL OR o.claimed_until < clock_timestamp())
      AND NOT EXISTS (
          SELECT 1 FROM {outbox} p
          WHERE p.status = 'pending'
            AND p.aggregate_type = o.aggregate_type
            AND p.aggregate_id = o.aggregate_id
            AND p.aggregate_seq < o.aggregate_seq)
      AND NOT EXISTS (
          SELECT 1 FROM {outbox} q
          WHERE q.status = 'pending'
            AND q.claim_id IS NOT NULL
            AND q.aggregate_type = o.aggregate_type
            AND q.aggregate_id = o.aggregate_id
            AND q.claimed_until >= clock_timestamp())
    ORDER BY o.id
    LIMIT $5
),
heads AS (
    SELECT o.id, o.aggregate_type, o.aggregate_id, o.aggregate_seq
    FROM {outbox} o
    WHERE o.id IN (SELECT id FROM window_rows)
      AND o.status = 'pending'
      AND o.next_attempt_at <= now()
      AND (o.claimed_until IS NULL OR o.claimed_until < clock_timestamp())
      AND NOT EXISTS (
          SELECT 1 FROM {outbox} p
          WHERE p.status = 'pending'
            AND p.aggregate_type = o.aggregate_type
            AND p.aggregate_id = o.aggregate_id
            AND p.aggregate_seq < o.aggregate_seq)
      -- No row of the aggregate may be leased to anyone (e.g. after a parked head was retried).
      AND NOT EXISTS (
          SELECT 1 FROM {outbox} q
          WHERE q.status = 'pending'
            AND q.claim_id IS NOT NULL
            AND q.aggregate_type = o.aggregate_type
            AND q.aggregate_id = o.aggregate_id
            AND q.claimed_until >= clock_timestamp())
    ORDER BY o.id
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED
),
members AS (
    SELECT r.id,
           row_number() OVER (PARTITION BY r.aggregate_type, r.aggregate_id ORDER BY r.aggregate_seq) AS rank,
           h.id AS head_id
    FROM heads h
    JOIN {outbox} r
      ON r.status = 'pending'
     AND r.aggregate_type = h.aggregate_type
     AND r.aggregate_id = h.aggregate_id
     AND r.aggregate_seq >= h.aggregate_seq
),
chosen AS (
    SELECT id FROM members ORDER BY rank, head_id LIMIT $1
)
UPDATE {outbox} u
SET claim_id = $2,
    claimed_by = $3,
    claimed_until = clock_timestamp() + $4 * interval '1 millisecond',
    attempts = u.attempts + 1
FROM chosen
-- Only the heads are locked: a member row may have been leased by a claim that committed while
-- this one waited for it (after `idem outbox retry` made an earlier row the head). Re-checked
-- on the row as committed, so two claims never hold rows of one aggregate.
WHERE u.id = chosen.id AND u.status = 'pending'
  AND (u.claimed_until IS NULL OR u.claimed_until < clock_timestamp())
RETURNING u.id, u.event_id, u.aggregate_type, u.aggregate_id, u.aggregate_seq, u.event_type,
          u.payload::text AS payload, u.headers, u.topic, u.traceparent, u.occurred_at, u.created_at,
          u.attempts, u.permanent_failures
