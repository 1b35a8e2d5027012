-- idem outbox, PostgreSQL, version 5: the same name rules as version 1, checked faster.
--
-- PostgreSQL's regular-expression engine expands a bounded repetition such as {0,199} into as
-- many states: the version-1 checks on aggregate_type and event_type cost about 10 and 16 µs
-- per inserted row (measured with `idem bench`/perf on the 2-core development machine), most of
-- the outbox insert's constraint time. An unbounded class plus a length bound accepts exactly
-- the same strings (the classes are ASCII, so characters are bytes) for about 0.3 µs.
ALTER TABLE {outbox}
    DROP CONSTRAINT "{bare:outbox}_aggregate_type_check",
    ADD CONSTRAINT "{bare:outbox}_aggregate_type_check"
        CHECK (length(aggregate_type) <= 200 AND aggregate_type ~ '^[A-Za-z0-9][A-Za-z0-9._-]*$'),
    DROP CONSTRAINT "{bare:outbox}_event_type_check",
    ADD CONSTRAINT "{bare:outbox}_event_type_check"
        CHECK (length(event_type) <= 255 AND event_type ~ '^[A-Za-z0-9][A-Za-z0-9._-]*$'),
    DROP CONSTRAINT "{bare:outbox}_topic_check",
    ADD CONSTRAINT "{bare:outbox}_topic_check"
        CHECK (topic IS NULL OR (length(topic) BETWEEN 1 AND 249 AND topic ~ '^[A-Za-z0-9._-]+$'));
