-- Refreshes the outbox's statistics after a claim ran past its timeout (a plan built on
-- statistics from before a mass re-pend) or after a mass `idem outbox retry`.
ANALYZE {outbox}
