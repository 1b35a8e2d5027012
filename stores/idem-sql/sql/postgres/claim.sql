-- Leases up to $1 rows to claim $2 (relay $3) for $4 milliseconds, from a window of the $6
-- oldest pending rows after id $5. Runs after claim_guard.sql, in the same transaction; the
-- relay runs it again on the next window (after `walked_to`) while the claim has room and the
-- window was full (`walked` = $6).
--
-- A head is the earliest pending row (in aggregate order) of its aggregate. The window names
-- the aggregates to look at; each is probed once in `pending_aggregate_idx`, from its head on,
-- for as many rows as it has in the window: the head, and the members a claim may take after
-- it. An aggregate is taken only when its head is past its backoff, none of these rows is
-- leased, and its head can be locked (SKIP LOCKED: two relays never wait for each other);
-- another relay cannot take a later row of a locked aggregate, since that row is not a head.
-- The claim then takes a prefix of each locked aggregate's members, in rank order.
--
-- The work is bounded by the window, whatever the backlog's shape: an aggregate with many rows
-- costs one probe per window it appears in, not one per row, and rows of aggregates that
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
members AS (
    SELECT m.id, m.rank, m.head_id, m.next_attempt_at, m.blocked
    FROM aggregates a
    CROSS JOIN LATERAL (
        SELECT f.id, f.next_attempt_at,
               row_number() OVER (ORDER BY f.aggregate_seq) AS rank,
               first_value(f.id) OVER (ORDER BY f.aggregate_seq) AS head_id,
               -- No row of the aggregate that a claim could take may be leased to anyone (e.g.
               -- after a parked head was retried while later rows were in flight).
               bool_or(f.leased) OVER () AS blocked
        FROM (
            SELECT r.id, r.aggregate_seq, r.next_attempt_at,
                   (r.claim_id IS NOT NULL AND r.claimed_until >= clock_timestamp()) AS leased
            FROM {outbox} r
            WHERE r.status = 'pending'
              AND r.aggregate_type = a.aggregate_type
              AND r.aggregate_id = a.aggregate_id
            ORDER BY r.aggregate_seq
            LIMIT a.n
        ) f
    ) m
),
locked AS (
    SELECT o.id
    FROM {outbox} o
    WHERE o.id = ANY (ARRAY(
              SELECT h.id FROM members h
              WHERE h.rank = 1 AND h.next_attempt_at <= now() AND NOT h.blocked))
      AND CASE o.status WHEN 'pending' THEN true ELSE false END
      AND o.next_attempt_at <= now()
      AND (o.claimed_until IS NULL OR o.claimed_until < clock_timestamp())
    FOR UPDATE OF o SKIP LOCKED
),
chosen AS (
    SELECT m.id
    FROM members m
    JOIN locked l ON l.id = m.head_id
    ORDER BY m.rank, m.head_id
    LIMIT $1
),
leased AS (
    UPDATE {outbox} u
    SET claim_id = $2,
        claimed_by = $3,
        claimed_until = clock_timestamp() + $4 * interval '1 millisecond',
        attempts = u.attempts + 1
    -- Only the heads are locked: a member row may have been leased by a claim that committed
    -- while this one waited for it (after `idem outbox retry` made an earlier row the head).
    -- Re-checked on the row as committed, so two claims never hold rows of one aggregate.
    WHERE u.id = ANY (ARRAY(SELECT id FROM chosen))
      AND CASE u.status WHEN 'pending' THEN true ELSE false END
      AND (u.claimed_until IS NULL OR u.claimed_until < clock_timestamp())
    RETURNING u.id, u.event_id, u.aggregate_type, u.aggregate_id, u.aggregate_seq, u.event_type,
              u.payload::text AS payload, u.headers, u.topic, u.traceparent, u.occurred_at,
              u.created_at, u.attempts, u.permanent_failures
),
walk AS (
    SELECT max(w.id) AS walked_to, count(*) AS walked FROM win w
)
-- One row per leased row, each with the window's extent; a single row with a null `id` when
-- none was leased.
SELECT k.walked_to, k.walked, l.*
FROM walk k
LEFT JOIN leased l ON true
