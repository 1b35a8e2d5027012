-- Console bench: $1 dead letters of the inbox's three groups (60 %, 25 % and 15 % of them),
-- stored over the 30 days before now, each with one of four reasons (half, 30 %, 15 % and 5 %
-- of a group's letters). The letters of the handler's two reasons decode: a fifth of them were
-- replayed and applied, 3 % found already applied. 3 % of every reason's letters failed their
-- last replay (still open); one open letter in 2 000 has a replay requested. The rest are open,
-- never replayed. A letter keeps the record as it arrived: its headers, and a value that is
-- JSON except for the reason that says it is not.
INSERT INTO idem_dead_letters (consumer_group, topic, record_partition, record_offset, event_id,
                               event_type, reason, record_key, payload, headers, created_at,
                               replayed_at, replayed_by, replay_outcome, replay_attempts,
                               replay_requested_at, replay_requested_by)
SELECT g.name, 'outbox.event.order', (n % 6)::int, n,
       CASE WHEN r.i = 3 THEN NULL ELSE md5('letter-' || n)::uuid END,
       'order.paid', r.reason, 'order-' || (n % 200000),
       CASE WHEN r.i = 2 THEN 'order ' || n || ' {'
            ELSE jsonb_build_object('order_id', 'order-' || n, 'payment_id', 'pay-' || n,
                                    'amount', '12.50', 'currency', 'EUR')::text END,
       jsonb_build_object('ce_specversion', '1.0', 'ce_type', 'order.paid',
                          'ce_source', 'idem/orders', 'content-type', 'application/json',
                          'idem_aggregate_type', 'order', 'idem_aggregate_id', 'order-' || n)
         || CASE WHEN r.i = 3 THEN '{}'::jsonb
                 ELSE jsonb_build_object('ce_id', md5('letter-' || n)::uuid::text) END,
       w.at,
       CASE WHEN o.outcome IS NOT NULL THEN w.at + interval '1 hour' END,
       CASE WHEN o.outcome IS NOT NULL THEN 'ana' END,
       o.outcome, CASE WHEN o.outcome IS NULL THEN 0 ELSE 1 END,
       CASE WHEN o.outcome IS NULL AND n % 2000 = 1 THEN now() - interval '5 minutes' END,
       CASE WHEN o.outcome IS NULL AND n % 2000 = 1 THEN 'bo' END
FROM generate_series(1, $1::bigint) n
CROSS JOIN LATERAL (SELECT now() - interval '30 days' * (1 - n::float8 / $1::bigint) AS at) w
CROSS JOIN LATERAL (
    SELECT CASE WHEN n % 20 < 12 THEN 'settlement' WHEN n % 20 < 17 THEN 'notifications'
                ELSE 'analytics' END AS name) g
CROSS JOIN LATERAL (
    SELECT CASE WHEN (n / 20) % 20 < 10 THEN 1 WHEN (n / 20) % 20 < 16 THEN 2
                WHEN (n / 20) % 20 < 19 THEN 3 ELSE 4 END AS i) ri
CROSS JOIN LATERAL (
    SELECT ri.i AS i, (ARRAY[
        'the handler refused the event: the payment is unknown to the ledger',
        'the record value is not valid JSON: expected value at line 1 column 1',
        'the record has no ce_id header (event id)',
        'the handler refused the event: currency XAU is not settled here'
    ])[ri.i] AS reason) r
CROSS JOIN LATERAL (
    SELECT CASE WHEN r.i IN (1, 4) AND (n / 7) % 100 < 20 THEN 'applied'
                WHEN r.i IN (1, 4) AND (n / 7) % 100 < 23 THEN 'already_applied'
                WHEN (n / 7) % 100 BETWEEN 23 AND 25 THEN 'failed' END AS outcome) o
