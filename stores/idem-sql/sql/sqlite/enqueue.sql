INSERT INTO {outbox}
    (event_id, aggregate_type, aggregate_id, event_type, payload, headers, topic, traceparent, occurred_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
