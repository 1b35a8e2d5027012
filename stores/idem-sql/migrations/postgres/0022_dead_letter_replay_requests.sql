-- idem dead-letter replay requests, PostgreSQL, version 22.
--
-- `idem dead-letters replay --confirm` (and the console's replay button) cannot run a user's
-- handler: it records a request on the letter, and the group's running consumer serves it
-- through its own handler (`idem_consumer::replay`), in one transaction with the event's inbox
-- row. Serving a request clears it, whatever the outcome; a request made while no consumer of
-- the group runs waits for the next one to start.
ALTER TABLE {dead_letters}
    ADD COLUMN IF NOT EXISTS replay_requested_at timestamptz,
    ADD COLUMN IF NOT EXISTS replay_requested_by text;

-- The consumers of a group look for requests every second: only requested letters are indexed.
CREATE INDEX IF NOT EXISTS "{bare:dead_letters}_requested_idx"
    ON {dead_letters} (consumer_group, id)
    WHERE replay_requested_at IS NOT NULL;
