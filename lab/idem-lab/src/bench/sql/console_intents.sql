-- Console bench: $1 effect intents recorded over the 30 days before now, three effects. The
-- newest 1 % wait for the dispatcher; $2 of unknown outcome and $3 parked are spread evenly
-- over the older ones, each with the remote's last answer and the reason; the rest are done.
INSERT INTO idem_effect_intents (idem_key, effect, target, event_id, body, status, attempts,
                                 response_status, response_body, last_error, created_at,
                                 updated_at)
SELECT 'settlement:' || md5('intent-' || n), e.effect, e.target, md5('inbox-' || n)::uuid,
       jsonb_build_object('payment_id', 'pay-' || n, 'points', n % 500),
       s.status,
       CASE s.status WHEN 'done' THEN 1 WHEN 'unknown' THEN 3 WHEN 'parked' THEN 8 ELSE 0 END,
       CASE s.status WHEN 'done' THEN 201 WHEN 'parked' THEN 422 END,
       CASE s.status WHEN 'done' THEN '{"awarded":true}'
                     WHEN 'parked' THEN '{"error":"the account is closed"}' END,
       CASE s.status WHEN 'unknown' THEN 'timed out after 10 s; the probe found no answer'
                     WHEN 'parked' THEN 'the remote refused for good: HTTP 422' END,
       w.at, w.at + interval '2 seconds'
FROM generate_series(1, $1::bigint) n
CROSS JOIN (SELECT greatest(($1::bigint - $1::bigint / 100) / greatest($2::bigint, $3::bigint, 1), 2)
                AS stride) k
CROSS JOIN LATERAL (SELECT now() - interval '30 days' * (1 - n::float8 / $1::bigint) AS at) w
CROSS JOIN LATERAL (
    SELECT CASE WHEN n > $1::bigint - $1::bigint / 100 THEN 'pending'
                WHEN n % k.stride = 0 AND n / k.stride BETWEEN 1 AND $2::bigint THEN 'unknown'
                WHEN n % k.stride = 1 AND n / k.stride BETWEEN 1 AND $3::bigint THEN 'parked'
                ELSE 'done' END AS status) s
CROSS JOIN LATERAL (
    SELECT (ARRAY['points.award', 'receipt.email', 'ledger.post'])[n % 3 + 1] AS effect,
           (ARRAY['http://127.0.0.1:8088/awards', 'http://127.0.0.1:8089/receipts',
                  'http://127.0.0.1:8090/entries'])[n % 3 + 1] AS target) e
