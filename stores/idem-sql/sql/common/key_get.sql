SELECT fingerprint, status, response_status, response_headers, response_body
FROM {idempotency_keys}
WHERE scope = $1 AND idem_key = $2
