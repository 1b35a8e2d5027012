-- The same for the application rows, when the reference schema has the table.
TRUNCATE settlement_applications
