-- Leases up to $1 rows to claim $2 (relay $3) for $4 milliseconds, from a window of the $6
-- oldest pending rows after id $5. Runs after claim_guard.sql, in the same transaction; the
-- store runs it again on the next window (after `walked_to`) while the claim has room and the
-- window was full (`walked` = $6), and starts its next claim before `first_left`.
--
-- A head is the earliest pending row (in aggregate order) of its aggregate. The window names
-- the aggregates to look at; each one's head is found in `pending_aggregate_idx`, and the
-- heads past their backoff and not leased are locked (SKIP LOCKED: two relays never wait for
-- each other); another relay cannot take a later row of a locked aggregate, since that row is
-- not a head. Each locked aggregate's members are then read from its head on, as many as the
-- window holds of it; an aggregate one of whose members is leased is left alone, and the
-- claim takes a prefix of each other aggregate's members, in rank order.
--
-- The work is bounded by the window, whatever the backlog's shape: an aggregate with many rows
-- costs two probes per window it appears in, not one per row, and rows of aggregates that
-- cannot be taken (backing off, leased, locked by another relay) are stepped over in
-- `pending_idx` without a probe, so the next window reaches the other aggregates.
--
-- Every lookup is written so that an index drives it whatever the statistics say (after a mass
-- re-pend they can claim that no row is pending, and a nested loop over a whole index would be
-- quadratic): the window walks `pending_idx` in id order with its limit, each aggregate's rows
-- come from a LATERAL scan of `pending_aggregate_idx` in aggregate order (the only index that
-- gives that order without a sort), and heads and members are locked and leased by primary key
-- (the status test is a CASE so that no partial index on status can be chosen instead).
-- claim_guard.sql rules out the sorts and bounds the rest.
WITH win AS (
    SELECT o.id, o.aggregate_type, o.aggregate_id
    FROM {outbox} o
    WHERE o.status = 'pending' AND o.id > $5
    ORDER BY o.id
    LIMIT $6
),
aggregates AS (
    SELECT w.aggregate_type, w.aggregate_id, count(*) AS n
    FROM win w
    GROUP BY w.aggregate_type, w.aggregate_id
),
heads AS (
    SELECT h.id, a.n
    FROM aggregates a
    CROSS JOIN LATERAL (
        SELECT p.id, p.next_attempt_at, p.claimed_until
        FROM {outbox} p
        WHERE p.status = 'pending'
          AND p.aggregate_type = a.aggregate_type
          AND p.aggregate_id = a.aggregate_id
        ORDER BY p.aggregate_seq
        LIMIT 1
    ) h
    WHERE h.next_attempt_at <= now()
      AND (h.claimed_until IS NULL OR h.claimed_until < clock_timestamp())
),
locked AS (
    SELECT o.id, o.aggregate_type, o.aggregate_id, o.aggregate_seq
    FROM {outbox} o
    WHERE o.id = ANY (ARRAY(SELECT id FROM heads))
      AND CASE o.status WHEN 'pending' THEN true ELSE false END
      AND o.next_attempt_at <= now()
      AND (o.claimed_until IS NULL OR o.claimed_until < clock_timestamp())
    -- At most as many heads as rows the claim may take, the oldest first (the primary key
    -- returns them in id order).
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED
),
members AS (
    SELECT m.id, m.rank, m.leased, l.id AS head_id
    FROM locked l
    JOIN heads h ON h.id = l.id
    CROSS JOIN LATERAL (
        SELECT r.id, row_number() OVER (ORDER BY r.aggregate_seq) AS rank,
               -- The negation of the update's test below, so that a row it would not lease
               -- always leaves its aggregate alone here instead.
               coalesce(r.claimed_until >= clock_timestamp(), false) AS leased
        FROM {outbox} r
        WHERE r.status = 'pending'
          AND r.aggregate_type = l.aggregate_type
          AND r.aggregate_id = l.aggregate_id
          AND r.aggregate_seq >= l.aggregate_seq
        ORDER BY r.aggregate_seq
        LIMIT h.n
    ) m
),
chosen AS (
    SELECT m.id
    FROM members m
    -- No row of the aggregate that the claim could take may be leased to anyone (e.g. after a
    -- parked head was retried while later rows were in flight).
    -- A list, not a join: with statistics from before the backlog a planner would loop over
    -- the members once per member.
    WHERE m.head_id <> ALL (ARRAY(SELECT x.head_id FROM members x WHERE x.leased))
    ORDER BY m.rank, m.head_id
    LIMIT $1
),
-- Only the heads are locked: a member may have been leased by a claim that committed after this
-- statement's snapshot (after `idem outbox retry` made an earlier row the head). The update
-- reads each chosen row as committed (waiting for a claim that holds it) and leases the free
-- ones; the statement reports how many it chose, and the store rolls back a claim that leased
-- fewer and claims again, since taking an aggregate's rows on both sides of a row another claim
-- holds would let a later row be published before it. Locking every member instead costs a WAL
-- record per member row on every claim, for a race that needs an operator's retry.
leased AS (
    UPDATE {outbox} u
    SET claim_id = $2,
        claimed_by = $3,
        claimed_until = clock_timestamp() + $4 * interval '1 millisecond',
        -- Saturating: a writer may insert any count, and an overflow would fail every claim.
        attempts = LEAST(u.attempts, 2147483646) + 1
    WHERE u.id = ANY (ARRAY(SELECT id FROM chosen))
      AND CASE u.status WHEN 'pending' THEN true ELSE false END
      AND (u.claimed_until IS NULL OR u.claimed_until < clock_timestamp())
    RETURNING u.id, u.event_id, u.aggregate_type, u.aggregate_id, u.aggregate_seq, u.event_type,
              u.payload::text AS payload, u.headers, u.topic, u.traceparent, u.occurred_at,
              u.created_at, u.attempts, u.permanent_failures
),
walk AS (
    SELECT max(w.id) AS walked_to, count(*) AS walked, (SELECT count(*) FROM chosen) AS chosen,
           min(w.id) FILTER (WHERE x.id IS NULL) AS first_left
    FROM win w
    LEFT JOIN leased x ON x.id = w.id
)
-- One row per leased row, each with the window's extent (its last row, how many rows it saw,
-- the first of them this claim did not lease) and how many rows it chose; a single row with a
-- null `id` when none was leased.
SELECT k.walked_to, k.walked, k.chosen, k.first_left, l.*
FROM walk k
LEFT JOIN leased l ON true
