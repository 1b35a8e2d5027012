-- Outbox rows of one event type by state.
SELECT count(*) AS total,
       COALESCE(sum(status = 'pending'), 0) AS pending,
       COALESCE(sum(status = 'published'), 0) AS published,
       COALESCE(sum(status = 'parked'), 0) AS parked,
       COALESCE(sum(attempts), 0) AS attempts
FROM {outbox}
WHERE aggregate_type = ?1 AND event_type = ?2
