-- Console bench: what the filtered pages ask for. The rarest reason of the parked outbox rows,
-- an id 90 % into the outbox, the group with the most open dead letters, its rarest open
-- reason, and an id 90 % into its letters.
WITH parked AS (
    SELECT COALESCE(last_error, '') AS reason FROM idem_outbox WHERE status = 'parked'
    GROUP BY 1 ORDER BY count(*), 1 LIMIT 1
), open_letters AS (
    SELECT id, consumer_group, reason FROM idem_dead_letters
    WHERE replay_outcome IS NULL OR replay_outcome = 'failed'
), grp AS (
    SELECT consumer_group FROM open_letters GROUP BY 1 ORDER BY count(*) DESC, 1 LIMIT 1
), letter_reason AS (
    SELECT reason FROM open_letters WHERE consumer_group = (SELECT consumer_group FROM grp)
    GROUP BY 1 ORDER BY count(*), 1 LIMIT 1
)
SELECT (SELECT reason FROM parked) AS parked_reason,
       (SELECT COALESCE(max(id), 0) * 9 / 10 FROM idem_outbox) AS outbox_after,
       (SELECT consumer_group FROM grp) AS letter_group,
       (SELECT reason FROM letter_reason) AS letter_reason,
       (SELECT COALESCE(max(id), 0) * 9 / 10 FROM idem_dead_letters
        WHERE consumer_group = (SELECT consumer_group FROM grp)) AS letters_after
