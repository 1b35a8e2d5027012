SELECT status FROM {inbox} WHERE consumer_group = ?1 AND event_id = ?2
