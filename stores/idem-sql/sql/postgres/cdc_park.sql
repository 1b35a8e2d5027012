-- Parks outbox row $1 with reason $2: the CDC relay could not publish it (the row does not
-- decode, or Kafka refused it for good). `idem outbox parked` lists it.
UPDATE {outbox}
SET status = 'parked', last_error = $2, permanent_failures = LEAST(permanent_failures, 2147483646) + 1
WHERE id = $1 AND status = 'pending'
