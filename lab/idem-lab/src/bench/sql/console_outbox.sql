-- Console bench: $1 outbox rows written over the 30 days before now, of five aggregate types
-- (200 000 aggregates, five events each at most). The newest $2 are pending; $3 are parked,
-- spread evenly over the older ones, each with one of four reasons (half, 30 %, 15 % and 5 % of
-- them); the rest are published. Each row is inserted with the status and the columns the relay
-- leaves it with: the writer's triggers check, number and stamp every row as at any insert.
INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, occurred_at,
                         created_at, status, attempts, last_error, published_at)
SELECT md5('outbox-' || n)::uuid, a.t, a.t || '-' || (n % 200000), a.t || '.' || a.verb,
       jsonb_build_object('id', n, 'amount_minor', 100 + n % 9900, 'currency', 'EUR',
                          'note', repeat('x', 120)),
       w.at, w.at, s.status,
       CASE s.status WHEN 'published' THEN 1 WHEN 'parked' THEN 5 ELSE 0 END,
       CASE WHEN s.status = 'parked' THEN (ARRAY[
           'the broker refused the record for good: Broker: Message size too large',
           'the broker refused the record for good: Broker: Topic authorization failed',
           'the row cannot be encoded: its traceparent is not a W3C traceparent',
           'the broker refused the record for good: Broker: Invalid record'
       ])[CASE WHEN (n / k.stride) % 20 < 10 THEN 1 WHEN (n / k.stride) % 20 < 16 THEN 2
               WHEN (n / k.stride) % 20 < 19 THEN 3 ELSE 4 END] END,
       CASE WHEN s.status = 'published' THEN w.at + interval '40 milliseconds' END
FROM generate_series(1, $1::bigint) n
CROSS JOIN (SELECT greatest(($1::bigint - $2::bigint) / greatest($3::bigint, 1), 1) AS stride) k
CROSS JOIN LATERAL (SELECT now() - interval '30 days' * (1 - n::float8 / $1::bigint) AS at) w
CROSS JOIN LATERAL (
    SELECT CASE WHEN n > $1::bigint - $2::bigint THEN 'pending'
                WHEN n % k.stride = 0 AND n / k.stride <= $3::bigint THEN 'parked'
                ELSE 'published' END AS status) s
CROSS JOIN LATERAL (
    SELECT (ARRAY['order', 'order', 'order', 'order', 'payment', 'payment', 'customer',
                  'customer', 'invoice', 'shipment'])[n % 10 + 1] AS t,
           (ARRAY['created', 'updated', 'closed'])[n % 3 + 1] AS verb) a
