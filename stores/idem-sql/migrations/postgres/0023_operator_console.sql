-- idem operator console, PostgreSQL, version 23.
--
-- Every operator action (the console's buttons, and the same actions on the command line) is
-- written to the audit table: who, when, what, on which rows, why, and how many rows changed.
-- Rows are only inserted: nothing in idem updates or deletes them.
CREATE TABLE IF NOT EXISTS {audit} (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT now(),
    actor     text        NOT NULL,
    action    text        NOT NULL,
    target    text        NOT NULL,
    reason    text        NOT NULL,
    affected  bigint      NOT NULL,
    outcome   text        NOT NULL
);

-- The console pages a group's dead letters by id, and lists parked and unknown effect intents,
-- without walking the rows of other groups or the done intents.
CREATE INDEX IF NOT EXISTS "{bare:dead_letters}_group_idx" ON {dead_letters} (consumer_group, id);
CREATE INDEX IF NOT EXISTS "{bare:effect_intents}_stuck_idx" ON {effect_intents} (id)
    WHERE status IN ('parked', 'unknown');
