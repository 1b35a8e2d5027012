-- Message mode's enqueue: one transactional logical decoding message per envelope, in array
-- order, written into the caller's transaction (a rollback removes them). $1: the prefix the
-- relay reads, $2: the envelopes (idem_core::envelope::encode). Returns how many were emitted.
SELECT count(pg_catalog.pg_logical_emit_message(true, $1::text, m.content)) AS emitted
FROM unnest($2::text[]) AS m(content)
