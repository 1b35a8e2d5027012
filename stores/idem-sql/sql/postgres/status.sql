SELECT count(*) FILTER (WHERE status = 'pending')   AS pending,
       count(*) FILTER (WHERE status = 'parked')    AS parked,
       count(*) FILTER (WHERE status = 'published') AS published,
       EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8 AS oldest_pending_age
FROM {outbox}
