-- One event's inbox row in one consumer group: whether the consumer applied it.
SELECT status FROM {inbox} WHERE consumer_group = $1 AND event_id = $2{::uuid}
