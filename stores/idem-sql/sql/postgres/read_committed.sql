-- The first statement of a transaction whose later statements must each see what committed
-- before them, whatever default_transaction_isolation says.
SET TRANSACTION ISOLATION LEVEL READ COMMITTED
