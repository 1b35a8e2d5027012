-- Deletes the outbox rows $1, whose events Kafka acknowledged (`--delete-published`): the
-- table keeps only what is pending or parked, as when writers delete their rows in the inserting
-- transaction. A delete lost to a crash leaves a published row looking pending: it is
-- published again (a copy the inbox absorbs). Commits without waiting for the
-- WAL flush, as the mark does.
WITH deleted AS (
    DELETE FROM {outbox}
    WHERE id = ANY($1) AND status = 'pending'
    RETURNING id
)
SELECT (SELECT count(*) FROM deleted) AS marked,
       set_config('synchronous_commit', 'off', true) AS synchronous_commit
