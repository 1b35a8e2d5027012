-- One consumer group's inbox: events, deliveries (duplicates included) and dead letters.
SELECT count(*){::bigint} AS events,
       COALESCE(sum(delivery_count), 0){::bigint} AS deliveries,
       count(*) FILTER (WHERE status = 'dead_lettered'){::bigint} AS dead_lettered
FROM {inbox}
WHERE consumer_group = $1
