-- Inserts events in array order; the BEFORE INSERT trigger assigns aggregate_seq.
INSERT INTO {outbox}
    (event_id, aggregate_type, aggregate_id, event_type, payload, headers, topic, traceparent, occurred_at)
SELECT e.event_id, e.aggregate_type, e.aggregate_id, e.event_type, e.payload::jsonb, e.headers::jsonb,
       e.topic, e.traceparent, e.occurred_at
FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[],
            $9::timestamptz[])
     WITH ORDINALITY AS e(event_id, aggregate_type, aggregate_id, event_type, payload, headers, topic,
                          traceparent, occurred_at, ord)
ORDER BY e.ord
