-- Leases up to ?1 rows to claim ?2 (relay ?3) until ?4 (Unix ms); ?5 is now (Unix ms);
-- ?6 bounds how many claimable heads, oldest first, are looked at (-1: all).
-- Runs inside BEGIN IMMEDIATE, so no other writer interleaves. The same rules as the PostgreSQL
-- claim: heads, then a prefix of each head's aggregate (PostgreSQL walks lazily and needs no
-- window: it skips the heads other relays lock as it goes). The window is made of
-- claimable heads, not of the oldest pending rows, so that one aggregate's backlog behind a
-- backing-off head never hides the others (see the PostgreSQL claim).
WITH window_rows AS (
    SELECT o.id FROM {outbox} o
    WHERE o.status = 'pending'
      AND o.next_attempt_at <= ?5
      AND (o.claimed_until IS NULL OR o.claimed_until < ?5)
      AND NOT EXISTS (
          SELECT 1 FROM {outbox} p
          WHERE p.status = 'pending'
            AND p.aggregate_type = o.aggregate_type
            AND p.aggregate_id = o.aggregate_id
            AND p.id < o.id)
      AND NOT EXISTS (
          SELECT 1 FROM {outbox} q
          WHERE q.status = 'pending'
            AND q.claim_id IS NOT NULL
            AND q.aggregate_type = o.aggregate_type
            AND q.aggregate_id = o.aggregate_id
            AND q.claimed_until >= ?5)
    ORDER BY o.id
    LIMIT ?6
),
heads AS (
    SELECT o.id, o.aggregate_type, o.aggregate_id
    FROM {outbox} o
    WHERE o.id IN (SELECT id FROM window_rows)
      AND o.status = 'pending'
      AND o.next_attempt_at <= ?5
      AND (o.claimed_until IS NULL OR o.claimed_until < ?5)
      AND NOT EXISTS (
          SELECT 1 FROM {outbox} p
          WHERE p.status = 'pending'
            AND p.aggregate_type = o.aggregate_type
            AND p.aggregate_id = o.aggregate_id
            AND p.id < o.id)
      AND NOT EXISTS (
          SELECT 1 FROM {outbox} q
          WHERE q.status = 'pending'
            AND q.claim_id IS NOT NULL
            AND q.aggregate_type = o.aggregate_type
            AND q.aggregate_id = o.aggregate_id
            AND q.claimed_until >= ?5)
    ORDER BY o.id
    LIMIT ?1
),
members AS (
    SELECT r.id,
           row_number() OVER (PARTITION BY r.aggregate_type, r.aggregate_id ORDER BY r.id) AS rank,
           h.id AS head_id
    FROM heads h
    JOIN {outbox} r
      ON r.status = 'pending'
     AND r.aggregate_type = h.aggregate_type
     AND r.aggregate_id = h.aggregate_id
     AND r.id >= h.id
),
chosen AS (
    SELECT id FROM members ORDER BY rank, head_id LIMIT ?1
)
UPDATE {outbox}
SET claim_id = ?2, claimed_by = ?3, claimed_until = ?4, attempts = attempts + 1
WHERE id IN (SELECT id FROM chosen) AND status = 'pending'
  AND (claimed_until IS NULL OR claimed_until < ?5)
RETURNING id, event_id, aggregate_type, aggregate_id, id AS aggregate_seq, event_type, payload, headers,
          topic, traceparent, occurred_at, created_at, attempts, permanent_failures
