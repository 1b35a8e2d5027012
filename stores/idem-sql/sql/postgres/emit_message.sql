-- Message mode's enqueue of one event: emit_messages.sql without the array (cheaper on the
-- server: no array to read, no function scan). $1: the prefix, $2: the envelope. Returns 1.
SELECT count(pg_catalog.pg_logical_emit_message(true, $1::text, $2::text)) AS emitted
