-- Empties the consumer ceiling's tables on the scratch database before a run, so each run starts
-- from tables as empty as the system's drain does.
TRUNCATE idem_inbox, settlements
