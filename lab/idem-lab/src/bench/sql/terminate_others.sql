-- Ends the sessions on this database that are not the bench's own (a child killed
-- mid-statement leaves its backend running the statement to its end).
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND backend_type = 'client backend' AND application_name <> 'idem-bench'
