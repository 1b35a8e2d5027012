#!/usr/bin/env bash
# Drain a backlog of 100 000 outbox rows into Kafka with (a) Debezium (embedded engine,
# PostgreSQL connector, outbox EventRouter; DbzOutboxRelay.java), (b) idem's CDC relay and
# (c) idem's polling relay, on the same PostgreSQL server and Kafka node.
#
#   run.sh build                 resolve the jars ($SCRATCH/dbz-libs) and compile ($SCRATCH/dbz-classes)
#   run.sh kafka-up | kafka-down our own Kafka node in $SCRATCH/dbz-kafka
#   run.sh cdc RUN [BATCH] [delete]  one idem-cdc run    (database dbz_cdc_RUN; --batch-size, default 500;
#                                "delete": with --delete-published, timed from start to an empty outbox)
#   run.sh dbz RUN BATCH QUEUE POLL_MS   one Debezium run (database dbz_dbz_RUN)
#   run.sh poll RUN              one idem polling-relay run (database dbz_poll_RUN)
#   run.sh produce RUN           raw produce ceiling of the Java client (same producer settings)
#
# Every run: a fresh database (idem migrate), a fresh topic of 3 partitions, replication factor 1;
# for the CDC systems the relay is started once to create its slot and stopped; then psql writes
# 100 000 rows (1 000 aggregates, ~256-byte JSON payloads) in 200 transactions of 500; ANALYZE,
# CHECKPOINT; then the relay is started and timed until its last delivery; the topic is counted
# by an independent consumer; slot and database are dropped. One TSV line per run goes to
# $WORK/results.tsv, the details to $WORK/<system>-<run>/.
ROOT=${ROOT:-$PWD}  # the idem checkout; run from it
SCRATCH=${SCRATCH:-${TMPDIR:-/tmp}}
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
IDEM=${IDEM:-$ROOT/target/release/idem}
KAFKA_SCRIPT=$ROOT/scripts/kafka
KDIR=$SCRATCH/dbz-kafka
WORK=${WORK:-$SCRATCH/dbz-run}
LIBS=$SCRATCH/dbz-libs
CLASSES=${CLASSES:-$SCRATCH/dbz-classes}
PG="postgres://postgres@127.0.0.1:5432"
ROWS=${ROWS:-100000}
PER_TX=500
AGGREGATES=1000
PAD=153
JAVA_CP="$CLASSES:$LIBS/*"
JAVA_OPTS=${JAVA_OPTS:-}
# WARM_AFTER=N: also report the rate of the rows after the N-th delivery (with ROWS > N).
WARM_AFTER=${WARM_AFTER:-0}
mkdir -p "$WORK"

# What this invocation started or created, cleaned up if it fails half-way.
STARTED="" CUR_SLOT="" CUR_DB=""
cleanup() {
  local rc=$?
  for p in $STARTED; do
    if kill -0 "$p" 2>/dev/null; then kill -TERM "$p" 2>/dev/null || true; sleep 1; kill -KILL "$p" 2>/dev/null || true; fi
  done
  if [ "$rc" != 0 ]; then
    sleep 1
    [ -n "$CUR_SLOT" ] && drop_slot "$CUR_SLOT" 2>/dev/null || true
    [ -n "$CUR_DB" ] && dropdb_ "$CUR_DB" 2>/dev/null || true
  fi
}
trap cleanup EXIT

log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

psql_db() { local db=$1; shift; psql -h 127.0.0.1 -U postgres -d "$db" -X -q -v ON_ERROR_STOP=1 "$@"; }
psql_at() { local db=$1; shift; psql -h 127.0.0.1 -U postgres -d "$db" -X -At -v ON_ERROR_STOP=1 -c "$*"; }

bootstrap() { cat "$KDIR/bootstrap"; }
broker_pid() { cat "$KDIR/node1/pid"; }

# utime + stime of a process, clock ticks (100 per second).
cpu_ticks() { awk '{ s = $0; sub(/^.*\) /, "", s); split(s, f, " "); print f[12] + f[13] }' "/proc/$1/stat"; }
hwm_kib() { awk '/^VmHWM:/ { print $2 }' "/proc/$1/status"; }
# Busy ticks of the whole machine (every core): everything but idle and iowait.
# WAL records the whole server wrote so far (pg_stat_wal), and per backlog row between two of them.
wal_records() { psql_at postgres "SELECT wal_records FROM pg_stat_wal"; }
per_row() { awk -v a="$1" -v b="$2" -v rows="$ROWS" 'BEGIN { printf "%.2f", (b - a) / rows }'; }
machine_busy() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9 }' /proc/stat; }
now() { date +%s.%N; }
loadavg() { cut -d' ' -f1 /proc/loadavg; }

# exec: run in the background (`java_run … &`), $! is the JVM itself, not a subshell.
java_run() { exec java $JAVA_OPTS -Dwarm.after="$WARM_AFTER" -cp "$JAVA_CP" DbzOutboxRelay "$@"; }
# Short-lived helper JVMs (topic, count, setup) start fast and stay small.
java_tool() { java -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xmx512m -Dorg.slf4j.simpleLogger.defaultLogLevel=warn -cp "$JAVA_CP" DbzOutboxRelay "$@"; }

backlog_sql() {
  local f="$WORK/backlog-$ROWS.sql"
  if [ ! -s "$f" ]; then
    local first=1
    : > "$f.tmp"
    while [ "$first" -le "$ROWS" ]; do
      local last=$((first + PER_TX - 1))
      cat >> "$f.tmp" <<EOF
BEGIN;
INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
SELECT gen_random_uuid(), 'order', 'agg-' || (n % $AGGREGATES), 'order.paid',
       jsonb_build_object('order_id', 'order-' || n, 'payment_id', 'pay-' || n,
                          'amount', ((100 + n % 9900) / 100)::text || '.' || lpad(((100 + n % 9900) % 100)::text, 2, '0'),
                          'currency', 'EUR', 'note', repeat('x', $PAD))
FROM generate_series($first, $last) n ORDER BY n;
COMMIT;
EOF
      first=$((last + 1))
    done
    mv "$f.tmp" "$f"
  fi
  printf '%s\n' "$f"
}

newdb() {
  local db=$1
  case "$db" in dbz_*) ;; *) die "refusing database $db" ;; esac
  psql_at postgres "DROP DATABASE IF EXISTS $db" >/dev/null
  psql_at postgres "CREATE DATABASE $db" >/dev/null
  "$IDEM" migrate --db "$PG/$db" >/dev/null
}

dropdb_() {
  local db=$1
  case "$db" in dbz_*) ;; *) die "refusing database $db" ;; esac
  psql_at postgres "DROP DATABASE IF EXISTS $db" >/dev/null
}

drop_slot() {
  local slot=$1
  psql_at postgres "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = '$slot' AND NOT active" >/dev/null
}

write_backlog() {
  local db=$1 f
  f=$(backlog_sql)
  local t0; t0=$(now)
  psql_db "$db" -f "$f" >/dev/null
  psql_db "$db" -c ANALYZE -c CHECKPOINT >/dev/null
  local n; n=$(psql_at "$db" "SELECT count(*) FROM idem_outbox WHERE status = 'pending'")
  [ "$n" = "$ROWS" ] || die "backlog has $n rows, not $ROWS"
  log "backlog of $n rows written in $(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }') s"
}

create_topic() { java_tool topic "$(bootstrap)" "$1" 3 >/dev/null; }

slot_active() { psql_at postgres "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '$1' AND active"; }
walsender_pid() { psql_at postgres "SELECT active_pid FROM pg_replication_slots WHERE slot_name = '$1' AND active"; }

wait_published() {
  # Waits until every row is marked published (the idem relays mark after Kafka acknowledged).
  local db=$1 pid=$2 deadline=$(( $(date +%s) + 600 )) n=0
  while :; do
    n=$(psql_at "$db" "SELECT count(*) FROM idem_outbox WHERE status = 'published'")
    [ "$n" -ge "$ROWS" ] && return 0
    kill -0 "$pid" 2>/dev/null || die "relay $pid exited with $n of $ROWS published"
    [ "$(date +%s)" -lt "$deadline" ] || die "timed out with $n of $ROWS published"
    sleep 0.5
  done
}

wait_empty() {
  # Waits until the outbox is empty (a relay with --delete-published deletes after Kafka acknowledged).
  local db=$1 pid=$2 deadline=$(( $(date +%s) + 600 )) n=0
  while :; do
    n=$(psql_at "$db" "SELECT count(*) FROM idem_outbox")
    [ "$n" = 0 ] && return 0
    kill -0 "$pid" 2>/dev/null || die "relay $pid exited with $n of $ROWS rows left"
    [ "$(date +%s)" -lt "$deadline" ] || die "timed out with $n of $ROWS rows left"
    sleep 0.05
  done
}

stop_pid() {
  local pid=$1
  kill -TERM "$pid" 2>/dev/null || true
  local i=0
  while kill -0 "$pid" 2>/dev/null; do
    i=$((i + 1))
    [ "$i" -gt 300 ] && { kill -KILL "$pid" 2>/dev/null || true; break; }
    sleep 0.1
  done
  wait "$pid" 2>/dev/null || true
}

# record SYSTEM RUN CONFIG T0 FIRST LAST RELAY_TICKS HWM_KIB WALSENDER_TICKS BROKER_TICKS MACHINE_TICKS COUNT_JSON LOAD0 LOAD1 EXTRA
record() {
  local sys=$1 run=$2 config=$3 t0=$4 first=$5 last=$6 rticks=$7 hwm=$8 wticks=$9 bticks=${10} mticks=${11} count=${12} l0=${13} l1=${14} extra=${15:-}
  local counted distinct viol bytes
  counted=$(printf '%s' "$count" | python3 -c 'import json,sys; print(json.load(sys.stdin)["records"])')
  distinct=$(printf '%s' "$count" | python3 -c 'import json,sys; print(json.load(sys.stdin)["distinct_ids"])')
  viol=$(printf '%s' "$count" | python3 -c 'import json,sys; print(json.load(sys.stdin)["seq_order_violations"])')
  bytes=$(printf '%s' "$count" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(round(d["bytes"]/max(1,d["records"])))')
  local line
  line=$(awk -v sys="$sys" -v run="$run" -v cfg="$config" -v t0="$t0" -v first="$first" -v last="$last" \
      -v rt="$rticks" -v hwm="$hwm" -v wt="$wticks" -v bt="$bticks" -v mt="$mticks" -v rows="$ROWS" \
      -v counted="$counted" -v distinct="$distinct" -v viol="$viol" -v bytes="$bytes" -v l0="$l0" -v l1="$l1" -v extra="$extra" \
      'BEGIN {
         total = last - t0; steady = last - first;
         printf "%s\t%s\t%s\t%.0f\t%.3f\t%.0f\t%.2f\t%.1f\t%.2f\t%.2f\t%.2f\t%d\t%d\t%d\t%d\t%s\t%s\t%s\n",
           sys, run, cfg, rows / total, total, (steady > 0 ? (rows - 1) / steady : 0), rt / 100, hwm / 1024,
           wt / 100, bt / 100, mt / 100, counted, distinct, viol, bytes, l0, l1, extra
       }')
  if [ ! -s "$WORK/results.tsv" ]; then
    printf 'system\trun\tconfig\trows_per_s\tstart_to_last_s\tfirst_to_last_per_s\trelay_cpu_s\trelay_rss_mib\twalsender_cpu_s\tbroker_cpu_s\tmachine_busy_s\tcounted\tdistinct_ids\tseq_violations\tbytes_per_record\tload_start\tload_end\textra\n' > "$WORK/results.tsv"
  fi
  printf '%s\n' "$line" >> "$WORK/results.tsv"
  printf '%s\n' "$line"
}

# ---------------------------------------------------------------- idem CDC relay

run_cdc() {
  # Database and slot names are folded to lower case (PostgreSQL folds unquoted names).
  local run=$1 batch=${2:-500} mode=${3:-marks} db="dbz_cdc_${1,,}" slot="dbz_cdc_${1,,}" pub="dbz_cdc_${1,,}_pub" prefix="dbz.cdc.$1."
  local topic="${prefix}order" dir="$WORK/cdc-$1" system=idem-cdc
  rm -rf "$dir"; mkdir -p "$dir"
  log "cdc $run: database $db, topic $topic, $mode"
  newdb "$db"; create_topic "$topic"
  local args=(cdc relay --db "$PG/$db" --brokers "$(bootstrap)" --slot "$slot" --publication "$pub"
              --topic-prefix "$prefix" --batch-size "$batch")
  case "$mode" in
    marks) ;;
    delete) args+=(--delete-published); system=idem-cdc-delete ;;
    *) die "cdc mode is marks or delete, not $mode" ;;
  esac
  printf '%q ' "$IDEM" "${args[@]}" > "$dir/command"; echo >> "$dir/command"
  CUR_DB=$db CUR_SLOT=$slot
  "$IDEM" "${args[@]}" >"$dir/setup.log" 2>&1 & local pid=$!; STARTED="$STARTED $pid"
  local i=0
  until [ "$(slot_active "$slot")" = 1 ]; do
    i=$((i + 1)); [ "$i" -gt 600 ] && die "slot $slot never read"; kill -0 "$pid" || die "setup relay died"; sleep 0.1
  done
  sleep 0.5; stop_pid "$pid"
  local w0 w1 w2; w0=$(wal_records)
  write_backlog "$db"
  w1=$(wal_records)
  ps -eo pid,pcpu,rss,etime,comm --sort=-pcpu | head -12 > "$dir/ps-before.txt"
  local l0 m0 b0 t0; l0=$(loadavg); m0=$(machine_busy); b0=$(cpu_ticks "$(broker_pid)"); t0=$(now)
  "$IDEM" "${args[@]}" >"$dir/relay.log" 2>&1 & pid=$!; STARTED="$STARTED $pid"
  local stamps warm=""
  if [ "$mode" = delete ]; then
    # Deleted rows leave no published_at: the drain ends when the outbox is empty, seen by a
    # look every 50 ms, and its start is the relay's start (so the rate includes its start-up).
    wait_empty "$db" "$pid"; stamps="$t0 $(now)"
  fi
  [ "$mode" = delete ] || wait_published "$db" "$pid"
  local rt hwm wpid wt m1 b1 l1
  rt=$(cpu_ticks "$pid"); hwm=$(hwm_kib "$pid"); wpid=$(walsender_pid "$slot"); wt=$(cpu_ticks "$wpid")
  m1=$(machine_busy); b1=$(cpu_ticks "$(broker_pid)"); l1=$(loadavg)
  w2=$(wal_records)
  if [ "$mode" = marks ]; then
    stamps=$(psql_at "$db" "SELECT extract(epoch FROM min(published_at)) || ' ' || extract(epoch FROM max(published_at)) FROM idem_outbox")
    [ "$WARM_AFTER" -gt 0 ] && warm=$(psql_at "$db" "WITH w AS (SELECT published_at FROM idem_outbox ORDER BY published_at OFFSET $WARM_AFTER - 1 LIMIT 1) SELECT 'warm_rows_per_s=' || round(($ROWS - $WARM_AFTER) / extract(epoch FROM (SELECT max(published_at) FROM idem_outbox) - w.published_at)) FROM w")
  fi
  stop_pid "$pid"
  local count; count=$(java_tool count "$(bootstrap)" "$topic" ce_id idem_aggregate_seq); printf '%s\n' "$count" > "$dir/count.json"
  drop_slot "$slot"; dropdb_ "$db"
  record "$system" "$run" "batch=$batch" "$t0" ${stamps% *} ${stamps#* } "$rt" "$hwm" "$wt" $((b1 - b0)) $((m1 - m0)) "$count" "$l0" "$l1" "$warm wal_records_per_row=$(per_row "$w0" "$w1")+$(per_row "$w1" "$w2")"
}

# ---------------------------------------------------------------- idem polling relay

run_poll() {
  local run=$1 db="dbz_poll_${1,,}" prefix="dbz.poll.$1."
  local topic="${prefix}order" dir="$WORK/poll-$1"
  rm -rf "$dir"; mkdir -p "$dir"
  log "poll $run: database $db, topic $topic"
  CUR_DB=$db
  newdb "$db"; create_topic "$topic"
  local w0 w1 w2; w0=$(wal_records)
  write_backlog "$db"
  w1=$(wal_records)
  local args=(relay --db "$PG/$db" --brokers "$(bootstrap)" --topic-prefix "$prefix" --batch-size 500 --no-prune)
  printf '%q ' "$IDEM" "${args[@]}" > "$dir/command"; echo >> "$dir/command"
  ps -eo pid,pcpu,rss,etime,comm --sort=-pcpu | head -12 > "$dir/ps-before.txt"
  local l0 m0 b0 t0; l0=$(loadavg); m0=$(machine_busy); b0=$(cpu_ticks "$(broker_pid)"); t0=$(now)
  "$IDEM" "${args[@]}" >"$dir/relay.log" 2>&1 & local pid=$!; STARTED="$STARTED $pid"
  wait_published "$db" "$pid"
  local rt hwm m1 b1 l1
  rt=$(cpu_ticks "$pid"); hwm=$(hwm_kib "$pid"); m1=$(machine_busy); b1=$(cpu_ticks "$(broker_pid)"); l1=$(loadavg)
  w2=$(wal_records)
  local stamps; stamps=$(psql_at "$db" "SELECT extract(epoch FROM min(published_at)) || ' ' || extract(epoch FROM max(published_at)) FROM idem_outbox")
  local warm=""; [ "$WARM_AFTER" -gt 0 ] && warm=$(psql_at "$db" "WITH w AS (SELECT published_at FROM idem_outbox ORDER BY published_at OFFSET $WARM_AFTER - 1 LIMIT 1) SELECT 'warm_rows_per_s=' || round(($ROWS - $WARM_AFTER) / extract(epoch FROM (SELECT max(published_at) FROM idem_outbox) - w.published_at)) FROM w")
  stop_pid "$pid"
  local count; count=$(java_tool count "$(bootstrap)" "$topic" ce_id idem_aggregate_seq); printf '%s\n' "$count" > "$dir/count.json"
  dropdb_ "$db"
  record idem-poll "$run" "batch=500" "$t0" ${stamps% *} ${stamps#* } "$rt" "$hwm" 0 $((b1 - b0)) $((m1 - m0)) "$count" "$l0" "$l1" "$warm wal_records_per_row=$(per_row "$w0" "$w1")+$(per_row "$w1" "$w2")"
}

# ---------------------------------------------------------------- Debezium

producer_props() {
  cat <<EOF
bootstrap.servers=$(bootstrap)
client.id=dbz-outbox-relay
enable.idempotence=true
acks=all
linger.ms=5
batch.size=262144
compression.type=none
EOF
}

run_dbz() {
  local run=$1 batch=$2 queue=$3 poll=$4
  local db="dbz_dbz_${1,,}" slot="dbz_dbz_${1,,}" pub="dbz_dbz_${1,,}_pub" prefix="dbz.dbz.$1."
  local topic="${prefix}order" dir="$WORK/dbz-$1"
  rm -rf "$dir"; mkdir -p "$dir"
  log "dbz $run: database $db, topic $topic, max.batch.size=$batch max.queue.size=$queue poll.interval.ms=$poll"
  CUR_DB=$db CUR_SLOT=$slot
  newdb "$db"; create_topic "$topic"
  "$HERE/engine-props.sh" "$db" "$slot" "$pub" "$prefix" "$dir/offsets.dat" "$batch" "$queue" "$poll" > "$dir/engine.properties"
  printf 'extended.headers.enabled=%s\n' "${DBZ_EXTENDED_HEADERS:-false}" >> "$dir/engine.properties"
  producer_props > "$dir/producer.properties"
  java_tool setup "$dir/engine.properties" > "$dir/setup.out" 2> "$dir/setup.log" || die "debezium setup failed: $(tail -3 "$dir/setup.log")"
  [ "$(psql_at postgres "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '$slot' AND NOT active")" = 1 ] || die "slot $slot missing or active"
  local w0 w1 w2; w0=$(wal_records)
  write_backlog "$db"
  w1=$(wal_records)
  ps -eo pid,pcpu,rss,etime,comm --sort=-pcpu | head -12 > "$dir/ps-before.txt"
  local l0 m0 b0 t0; l0=$(loadavg); m0=$(machine_busy); b0=$(cpu_ticks "$(broker_pid)"); t0=$(now)
  java_run relay "$dir/engine.properties" "$dir/producer.properties" "$ROWS" "$dir/result.json" "$dir/stop" \
      >"$dir/relay.out" 2>"$dir/relay.log" & local pid=$!; STARTED="$STARTED $pid"
  local deadline=$(( $(date +%s) + 600 ))
  until [ -s "$dir/result.json" ]; do
    kill -0 "$pid" 2>/dev/null || die "debezium relay exited early: $(tail -5 "$dir/relay.log")"
    [ "$(date +%s)" -lt "$deadline" ] || die "debezium relay timed out"
    sleep 0.1
  done
  local rt hwm wpid wt m1 b1 l1
  rt=$(cpu_ticks "$pid"); hwm=$(hwm_kib "$pid"); wpid=$(walsender_pid "$slot"); wt=$(cpu_ticks "$wpid")
  m1=$(machine_busy); b1=$(cpu_ticks "$(broker_pid)"); l1=$(loadavg)
  w2=$(wal_records)
  touch "$dir/stop"; wait "$pid" || log "debezium relay exit status $?"
  local res; res=$(cat "$dir/result.json")
  local first last startup
  first=$(printf '%s' "$res" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["first_ack_ms"]/1000)')
  last=$(printf '%s' "$res" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["last_ack_ms"]/1000)')
  startup=$(printf '%s' "$res" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("batches=%d max_batch=%d first_batch_after_s=%.2f cpu_before_first_batch_s=%.2f jvm_cpu_s=%.2f jvm_hwm_mib=%.1f" % (d["batches"], d["max_batch"], d["first_batch_ms"]/1000 - '"$t0"', d["first_batch_cpu_ticks"]/100, (d["self_cpu_ticks_utime"] + d["self_cpu_ticks_stime"])/100, d["vm_hwm_kib"]/1024) + ("" if not d.get("warm_ms") else " warm_rows_per_s=%.0f" % ((d["expected"] - d["warm_after"]) / ((d["last_ack_ms"] - d["warm_ms"]) / 1000))))')
  local count; count=$(java_tool count "$(bootstrap)" "$topic" id idem_aggregate_seq); printf '%s\n' "$count" > "$dir/count.json"
  drop_slot "$slot"; dropdb_ "$db"
  record debezium "$run" "batch=$batch,queue=$queue,poll=$poll" "$t0" "$first" "$last" "$rt" "$hwm" "$wt" $((b1 - b0)) $((m1 - m0)) "$count" "$l0" "$l1" "$startup wal_records_per_row=$(per_row "$w0" "$w1")+$(per_row "$w1" "$w2")"
}

run_produce() {
  local run=$1 topic="dbz.produce.$1" dir="$WORK/produce-$1"
  rm -rf "$dir"; mkdir -p "$dir"
  create_topic "$topic"
  producer_props > "$dir/producer.properties"
  local b0 m0; b0=$(cpu_ticks "$(broker_pid)"); m0=$(machine_busy)
  local out; out=$(java_run produce "$dir/producer.properties" "$topic" "$ROWS" 2>"$dir/produce.log")
  local b1 m1; b1=$(cpu_ticks "$(broker_pid)"); m1=$(machine_busy)
  printf '%s broker_cpu_s=%.2f machine_busy_s=%.2f (whole JVM run)\n' "$out" "$(echo "($b1 - $b0)/100" | bc -l)" "$(echo "($m1 - $m0)/100" | bc -l)" | tee -a "$WORK/produce.txt"
}

case "${1:-}" in
  build)
    (cd "$HERE" && mvn -B -q dependency:copy-dependencies -DoutputDirectory="$LIBS")
    mkdir -p "$CLASSES" && javac -d "$CLASSES" -cp "$LIBS/*" "$HERE/DbzOutboxRelay.java" ;;
  kafka-up) "$KAFKA_SCRIPT" up --nodes 1 --dir "$KDIR" ;;
  kafka-down) "$KAFKA_SCRIPT" down --dir "$KDIR" ;;
  cdc) run_cdc "$2" "${3:-500}" "${4:-marks}" ;;
  poll) run_poll "$2" ;;
  dbz) run_dbz "$2" "${3:-2048}" "${4:-8192}" "${5:-500}" ;;
  produce) run_produce "$2" ;;
  *) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac
