-- Pending and parked rows per aggregate type among the oldest $1 of them.
SELECT aggregate_type,
       sum(CASE WHEN status = 'pending' THEN 1 ELSE 0 END){::bigint} AS pending,
       sum(CASE WHEN status = 'parked' THEN 1 ELSE 0 END){::bigint} AS parked
FROM (SELECT aggregate_type, status FROM {outbox}
      WHERE status IN ('pending', 'parked') ORDER BY id LIMIT $1) t
GROUP BY aggregate_type
ORDER BY aggregate_type
