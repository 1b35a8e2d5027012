SELECT coalesce(sum(status = 'pending'), 0)   AS pending,
       coalesce(sum(status = 'parked'), 0)    AS parked,
       coalesce(sum(status = 'published'), 0) AS published,
       min(CASE WHEN status = 'pending' THEN created_at END) AS oldest_pending
FROM {outbox}
