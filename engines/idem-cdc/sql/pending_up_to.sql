-- How many rows up to id $1 are still pending.
SELECT count(*) FROM {outbox} WHERE status = 'pending' AND id <= $1
