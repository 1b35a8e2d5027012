#!/usr/bin/env bash
# The whole measurement, in order: Kafka up, raw produce, Debezium tuning runs, three interleaved
# rounds (idem-cdc with marks, idem-cdc with --delete-published, debezium, idem-poll), raw produce
# again, Kafka down. Creates
# $SCRATCH/dbz-done at the end whatever happened.
ROOT=${ROOT:-$PWD}  # the idem checkout; run from it
SCRATCH=${SCRATCH:-${TMPDIR:-/tmp}}
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK=${WORK:-$SCRATCH/dbz-run}
export WORK
mkdir -p "$WORK"
done_flag() { mkdir -p "$SCRATCH"; touch $SCRATCH/dbz-done; }
trap done_flag EXIT
R="$HERE/run.sh"
step() { echo "=== $(date -u +%H:%M:%S) $* (load $(cut -d' ' -f1-3 /proc/loadavg))"; "$R" "$@" || echo "!!! $* failed with $?"; }

{ echo "start $(date -u)"; uptime; nproc; psql -h 127.0.0.1 -U postgres -Atc 'select version()'; java -version 2>&1 | head -1; "${IDEM:-$ROOT/target/release/idem}" --version; } > "$WORK/env.txt" 2>&1
"$R" kafka-up > "$WORK/kafka-up.out" 2> "$WORK/kafka-up.log" || { echo "kafka up failed"; tail "$WORK/kafka-up.log"; exit 1; }
echo "bootstrap $(cat $SCRATCH/dbz-kafka/bootstrap)"

step produce 1
# Debezium tuning: its defaults, then larger batches and queue with a short poll interval.
step dbz t1 2048 8192 500
step dbz t2 8192 32768 50
step dbz t3 20480 81920 50
best=$(awk -F'\t' '$1 == "debezium" && $2 ~ /^t/ { print $4, $3 }' "$WORK/results.tsv" | sort -n | tail -1 | cut -d' ' -f2)
echo "best debezium config: $best"
b=$(echo "$best" | sed 's/.*batch=\([0-9]*\).*/\1/'); q=$(echo "$best" | sed 's/.*queue=\([0-9]*\).*/\1/'); p=$(echo "$best" | sed 's/.*poll=\([0-9]*\).*/\1/')
for r in 1 2 3; do
  step cdc "$r"
  step cdc "d$r" 500 delete
  step dbz "$r" "$b" "$q" "$p"
  step poll "$r"
done
step produce 2
"$R" kafka-down >> "$WORK/kafka-up.log" 2>&1
echo "end $(date -u)" >> "$WORK/env.txt"
echo "=== done $(date -u +%H:%M:%S)"
