UPDATE {idempotency_keys}
SET status = 'completed', response_status = $3, response_headers = $4::jsonb, response_body = $5
WHERE scope = $1 AND idem_key = $2 AND status = 'in_flight'
