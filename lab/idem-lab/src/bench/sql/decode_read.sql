-- The CDC decode ceiling: the server decodes everything the slot holds with pgoutput (the
-- publication of the outbox's inserts, as the relay's) and hands each message back, consumed.
SELECT count(*) FROM pg_logical_slot_get_binary_changes($1, NULL, NULL,
    'proto_version', '1', 'publication_names', $2)
