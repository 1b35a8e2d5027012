-- idem dead-letter replay bookkeeping, PostgreSQL, version 9.
--
-- `idem dead-letters replay` re-applies a dead letter through the handler and records here who
-- replayed it, when, and how it ended. A letter is open (replayable) while replay_outcome is
-- NULL or 'failed'; 'applied' and 'already_applied' close it (the inbox row says processed).
ALTER TABLE {dead_letters}
    ADD COLUMN replayed_at     timestamptz,
    ADD COLUMN replayed_by     text,
    ADD COLUMN replay_outcome  text,
    ADD COLUMN replay_attempts integer NOT NULL DEFAULT 0,
    ADD CONSTRAINT "{bare:dead_letters}_replay_outcome_check"
        CHECK (replay_outcome IN ('applied', 'already_applied', 'failed'));
