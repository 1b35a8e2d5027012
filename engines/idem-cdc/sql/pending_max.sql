-- The newest row still pending in the outbox (NULL when none is).
SELECT max(id) FROM {outbox} WHERE status = 'pending'
