UPDATE {inbox} SET status = 'dead_lettered' WHERE consumer_group = $1 AND event_id = ANY($2)
