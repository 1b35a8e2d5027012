-- The newest dead letter of one event in one consumer group: why the consumer gave it up.
SELECT reason FROM {dead_letters}
WHERE consumer_group = $1 AND event_id = $2{::uuid}
ORDER BY id DESC LIMIT 1
