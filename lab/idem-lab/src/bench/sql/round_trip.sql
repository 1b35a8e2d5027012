-- Ceiling, any per-statement design: one trivial statement's round trip.
SELECT 1
