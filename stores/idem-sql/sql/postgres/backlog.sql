-- The relay's periodic gauges: pending and parked rows per aggregate type. Reads only pending
-- and parked rows (the partial indexes on status), never the published ones waiting for pruning.
SELECT aggregate_type,
       count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'parked')  AS parked,
       EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8 AS oldest_pending_age
FROM {outbox}
WHERE status = 'pending' OR status = 'parked'
GROUP BY aggregate_type
ORDER BY aggregate_type
