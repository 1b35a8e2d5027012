-- Console bench: $1 inbox rows of three consumer groups (60 %, 25 % and 15 % of them), one per
-- event processed over the 30 days before now, one in 50 delivered twice.
INSERT INTO idem_inbox (consumer_group, event_id, event_type, aggregate_type, aggregate_id,
                        payload_hash, delivery_count, processed_at, last_delivered_at)
SELECT g.name, md5('inbox-' || n)::uuid, 'order.paid', 'order', 'order-' || (n % 200000),
       md5('payload-' || n) || md5('hash-' || n),
       CASE WHEN n % 50 = 0 THEN 2 ELSE 1 END, w.at, w.at
FROM generate_series(1, $1::bigint) n
CROSS JOIN LATERAL (SELECT now() - interval '30 days' * (1 - n::float8 / $1::bigint) AS at) w
CROSS JOIN LATERAL (
    SELECT CASE WHEN n % 20 < 12 THEN 'settlement' WHEN n % 20 < 17 THEN 'notifications'
                ELSE 'analytics' END AS name) g
