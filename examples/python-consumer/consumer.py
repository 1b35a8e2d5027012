"""A consumer written without idem: kafka-python and psycopg, reading the events an idem relay
publishes (docs/integrating/wire-contract.md) and writing one ledger row per paid order into
PostgreSQL.

It runs in one of three modes, to put `idem-lab chaos --pipeline` to the test:

  inbox         an inbox row per (consumer group, event id) in the same transaction as the
                ledger row, and the offsets committed after that transaction: a redelivered
                event is skipped. Nothing lost, nothing doubled.
  offset-first  the same inbox, but the offsets committed before the transaction: a consumer
                that dies after the commit and before its transaction loses the batch.
  no-inbox      no inbox: a redelivered event (a relay's republish, a consumer that died after
                its transaction and before its offset commit) is written twice.

Usage: consumer.py --db URL --brokers HOST:PORT[,...] --topic T --group G --mode MODE
"""

import argparse
import decimal
import json
import os
import sys
import time

import psycopg
from kafka import KafkaConsumer
from kafka.errors import CommitFailedError, KafkaError

SCHEMA = """
CREATE TABLE IF NOT EXISTS py_inbox (
    consumer_group text NOT NULL,
    event_id uuid NOT NULL,
    PRIMARY KEY (consumer_group, event_id)
);
CREATE TABLE IF NOT EXISTS py_ledger (
    payment_id text NOT NULL,
    amount_minor bigint NOT NULL,
    event_id uuid NOT NULL
);
"""


def header(record, name):
    """The first header of that name, as text (the wire contract reads the first)."""
    for key, value in record.headers or []:
        if key == name:
            return value.decode("utf-8")
    return None


def ledger_row(record):
    """(payment_id, amount in minor units, event id) of an order.paid record."""
    payload = json.loads(record.value)
    minor = int(decimal.Decimal(payload["amount"]) * 100)
    return payload["payment_id"], minor, header(record, "ce_id")


def apply(conn, group, records, inbox):
    """Writes the batch in one transaction; with `inbox`, each event at most once per group."""
    with conn.transaction():
        with conn.cursor() as cur:
            for record in records:
                if header(record, "ce_type") != "order.paid":
                    continue
                payment_id, minor, event_id = ledger_row(record)
                if inbox:
                    cur.execute(
                        "INSERT INTO py_inbox (consumer_group, event_id) VALUES (%s, %s) "
                        "ON CONFLICT DO NOTHING",
                        (group, event_id),
                    )
                    if cur.rowcount == 0:
                        continue
                cur.execute(
                    "INSERT INTO py_ledger (payment_id, amount_minor, event_id) "
                    "VALUES (%s, %s, %s)",
                    (payment_id, minor, event_id),
                )


def connect(url):
    """A connection, tried again until the database answers."""
    while True:
        try:
            conn = psycopg.connect(url, connect_timeout=5)
            conn.execute(SCHEMA)
            conn.commit()
            return conn
        except psycopg.OperationalError as e:
            print(f"database unreachable ({e}); trying again", file=sys.stderr, flush=True)
            time.sleep(0.5)


def apply_until_done(url, conn, group, records, inbox):
    """Applies the batch, reconnecting while the database is unreachable: the connection."""
    while True:
        try:
            apply(conn, group, records, inbox)
            return conn
        except psycopg.OperationalError as e:
            print(f"the batch failed ({e}); applying it again", file=sys.stderr, flush=True)
            conn.close()
            conn = connect(url)


def commit(consumer):
    try:
        consumer.commit()
    except (CommitFailedError, KafkaError) as e:
        # The partitions moved to another member: it reads from the last committed offsets.
        print(f"offset commit failed ({e})", file=sys.stderr, flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--brokers", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--mode", choices=["inbox", "offset-first", "no-inbox"], default="inbox")
    p.add_argument(
        "--crash-after-commit",
        type=int,
        default=0,
        help="offset-first: exit at once after committing the offsets of the Nth batch",
    )
    args = p.parse_args()
    conn = connect(args.db)
    consumer = KafkaConsumer(
        args.topic,
        bootstrap_servers=args.brokers.split(","),
        group_id=args.group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=10000,
        heartbeat_interval_ms=1000,
        max_poll_interval_ms=60000,
    )
    print(f"consuming {args.topic} as {args.group} ({args.mode})", flush=True)
    inbox = args.mode != "no-inbox"
    batches = 0
    while True:
        try:
            batch = consumer.poll(timeout_ms=500, max_records=200)
        except KafkaError as e:
            # The broker or the way to it failed; the client reconnects on the next poll.
            print(f"poll failed ({e}); polling again", file=sys.stderr, flush=True)
            time.sleep(0.5)
            continue
        records = [r for part in batch.values() for r in part]
        if not records:
            continue
        batches += 1
        if args.mode == "offset-first":
            commit(consumer)
            if batches == args.crash_after_commit:
                # The window this mode opens, hit on purpose: the batch's offsets are
                # committed and its rows are not.
                print("crashing after the offset commit", file=sys.stderr, flush=True)
                os._exit(3)
        conn = apply_until_done(args.db, conn, args.group, records, inbox)
        if args.mode != "offset-first":
            commit(consumer)


if __name__ == "__main__":
    main()
