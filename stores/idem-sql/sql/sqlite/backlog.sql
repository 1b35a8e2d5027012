-- The relay's periodic gauges: pending and parked rows per aggregate type. Reads only pending
-- and parked rows (the partial indexes on status), never the published ones waiting for pruning.
SELECT aggregate_type,
       coalesce(sum(status = 'pending'), 0) AS pending,
       coalesce(sum(status = 'parked'), 0)  AS parked,
       min(CASE WHEN status = 'pending' THEN created_at END) AS oldest_pending
FROM {outbox}
WHERE status = 'pending' OR status = 'parked'
GROUP BY aggregate_type
ORDER BY aggregate_type
