-- idem, SQLite, version 20: nothing to change, the version keeps both engines in step.
-- On PostgreSQL this version lets a parked row's event columns change only in a transaction
-- after the one that wrote or parked it, which the CDC relay's INSERT stream needs; SQLite's
-- relay reads the committed row.
SELECT 1;
