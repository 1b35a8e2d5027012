-- idem outbox, SQLite, version 10: nothing to change, the version keeps both engines in step.
-- On PostgreSQL this version stops `INSERT … ON CONFLICT (event_id)` from burning an
-- aggregate_seq number. SQLite has no per-aggregate counter: the relay's aggregate_seq is the
-- row id (AUTOINCREMENT, commit order), which increases within an aggregate but is not
-- contiguous per aggregate, whatever the conflict clause (docs/outbox-contract.md).
SELECT 1;
