-- idem outbox, PostgreSQL, version 6: timestamps every client can hold.
--
-- timestamptz accepts 'infinity', '-infinity' and years up to 294276; client libraries hold far
-- less (chrono, which sqlx uses, ends at year 262143; java.time and Python's datetime at 9999).
-- Such a row passed every check of version 1, and sqlx's decoder then panicked in every relay
-- that claimed it, after the claim had committed, so that no aggregate moved any more. Writers
-- of the SQL contract now get an error at insert instead. NOT VALID: rows stored before this
-- version are not re-checked here; the relay parks any it cannot decode, with the reason.
ALTER TABLE {outbox}
    ADD CONSTRAINT "{bare:outbox}_occurred_at_check"
        CHECK (occurred_at >= '0001-01-01 00:00:00+00' AND occurred_at < '10000-01-01 00:00:00+00')
        NOT VALID,
    ADD CONSTRAINT "{bare:outbox}_created_at_check"
        CHECK (created_at >= '0001-01-01 00:00:00+00' AND created_at < '10000-01-01 00:00:00+00')
        NOT VALID;
