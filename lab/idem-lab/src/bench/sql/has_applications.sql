-- Whether the reference schema has `settlement_applications` (the ceiling writes the rows the
-- handler writes, no more).
SELECT to_regclass('settlement_applications') IS NOT NULL
