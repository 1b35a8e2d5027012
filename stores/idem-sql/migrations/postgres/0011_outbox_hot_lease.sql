-- idem outbox, PostgreSQL, version 11: a lease is a HOT update.
--
-- `leased_idx` (aggregate_type, aggregate_id) WHERE status = 'pending' AND claim_id IS NOT NULL
-- made `claim_id` an indexed column, so every lease and every release rewrote the row's entries
-- in all five indexes. The claim's probe for a leased row of the aggregate now reads
-- `pending_aggregate_idx` and filters on claim_id (an aggregate's pending rows are few, or the
-- probe is made once per head). A lower fillfactor leaves room on each page for the leased
-- version of its rows: at 90 only 12-15 % of leases found room, at 50 almost all did
-- (docs/operating/relay.md). The setting applies to pages written from now on; the price is a
-- heap about twice as large per retained row (published rows until `prune`).
DO $idem$
DECLARE
    leased regclass;
BEGIN
    SELECT i.indexrelid::regclass INTO leased
    FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
    WHERE i.indrelid = '{outbox}'::regclass AND c.relname = '{bare:outbox}_leased_idx';
    IF leased IS NOT NULL THEN
        EXECUTE format('DROP INDEX %s', leased);
    END IF;
END
$idem$;

ALTER TABLE {outbox} SET (fillfactor = 50);
