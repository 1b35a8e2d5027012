-- Pending and parked rows (each counted up to $1), the newest row id (the writers' progress) and
-- the age in seconds of the oldest pending row, through the partial indexes on status.
SELECT (SELECT count(*) FROM (SELECT 1 FROM {outbox} WHERE status = 'pending' LIMIT $1) p) AS pending,
       (SELECT count(*) FROM (SELECT 1 FROM {outbox} WHERE status = 'parked' LIMIT $1) k) AS parked,
       (SELECT COALESCE(max(id), 0) FROM {outbox}) AS last_id,
       (SELECT EXTRACT(EPOCH FROM now() - created_at)::float8
          FROM {outbox} WHERE status = 'pending' ORDER BY id LIMIT 1) AS oldest_pending_age
