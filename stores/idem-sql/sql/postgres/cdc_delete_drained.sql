-- Deletes the outbox rows $1 that the session-start drain has just marked published
-- (`--delete-published`): the table keeps only what is pending or parked. A delete lost to a
-- crash leaves the rows published, as without the flag; `idem prune` removes them.
DELETE FROM {outbox} WHERE id = ANY($1) AND status = 'published'
