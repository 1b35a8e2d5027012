-- One consumer group's inbox: events, deliveries (duplicates included) and dead letters.
SELECT count(*) AS events,
       COALESCE(sum(delivery_count), 0) AS deliveries,
       COALESCE(sum(status = 'dead_lettered'), 0) AS dead_lettered
FROM {inbox}
WHERE consumer_group = ?1
