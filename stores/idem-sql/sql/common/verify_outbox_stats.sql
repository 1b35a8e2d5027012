-- Outbox rows of one event type by state.
SELECT count(*){::bigint} AS total,
       count(*) FILTER (WHERE status = 'pending'){::bigint} AS pending,
       count(*) FILTER (WHERE status = 'published'){::bigint} AS published,
       count(*) FILTER (WHERE status = 'parked'){::bigint} AS parked,
       COALESCE(sum(attempts), 0){::bigint} AS attempts
FROM {outbox}
WHERE aggregate_type = $1 AND event_type = $2
