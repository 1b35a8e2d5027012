// The Debezium side of the outbox drain comparison (lab/debezium/README.md).
//
//   relay ENGINE.properties PRODUCER.properties EXPECTED RESULT_FILE STOP_FILE
//       Runs the Debezium embedded engine (PostgreSQL connector, pgoutput, outbox EventRouter SMT,
//       all from ENGINE.properties) and sends every record it hands over to Kafka with one
//       KafkaProducer (PRODUCER.properties). A batch is marked processed only after every send of
//       it completed (each future awaited, in order, then markProcessed per record and
//       markBatchFinished), as Debezium Server's Kafka sink does. Once EXPECTED records are
//       acknowledged it writes RESULT_FILE (one JSON line: times in epoch ms) and waits, idle,
//       until STOP_FILE exists (so the caller can read this process's /proc counters), then
//       closes the engine and the producer and exits.
//   setup ENGINE.properties
//       Starts the same engine on an empty outbox so that the connector creates its slot and
//       publication, waits until its slot is read, closes it (the slot stays: slot.drop.on.stop
//       is false) and exits.
//   topic BOOTSTRAP TOPIC PARTITIONS
//       Creates TOPIC (replication factor 1) and waits until every partition has a leader.
//   print ENGINE.properties EXPECTED
//       Smoke test without Kafka: runs the engine, prints the first records as the relay would
//       send them (topic, key, headers, value), exits once EXPECTED records came (or after 60 s).
//   produce PRODUCER.properties TOPIC COUNT
//       The raw-produce ceiling of this machine for the same client: COUNT records shaped like the
//       relay's (key agg-N of 1000, ~256-byte JSON value, the same four headers) built in memory
//       and sent with the relay's producer settings, every send awaited; prints the rate.
//   count BOOTSTRAP TOPIC ID_HEADER SEQ_HEADER
//       Reads TOPIC from the beginning to its end offsets and prints one JSON line: records,
//       distinct ID_HEADER values, bytes (key + value + headers), per-partition counts, and the
//       number of keys whose SEQ_HEADER values are not increasing in offset order.
import java.io.IOException;
import java.io.Reader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.TreeMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicReference;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.clients.admin.TopicDescription;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.ConsumerRecords;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.TopicPartitionInfo;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.header.internals.RecordHeaders;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.connect.source.SourceRecord;

import io.debezium.embedded.Connect;
import io.debezium.engine.DebeziumEngine;
import io.debezium.engine.RecordChangeEvent;
import io.debezium.engine.format.ChangeEventFormat;

public final class DbzOutboxRelay {

    private DbzOutboxRelay() {
    }

    public static void main(String[] args) throws Exception {
        if (args.length == 0) {
            usage();
        }
        switch (args[0]) {
            case "relay" -> relay(args);
            case "setup" -> setup(args);
            case "topic" -> topic(args);
            case "count" -> count(args);
            case "print" -> print(args);
            case "produce" -> produce(args);
            default -> usage();
        }
    }

    private static void usage() {
        System.err.println("usage: relay ENGINE PRODUCER EXPECTED RESULT STOP | setup ENGINE | topic BOOTSTRAP TOPIC PARTITIONS"
                + " | count BOOTSTRAP TOPIC ID_HEADER SEQ_HEADER");
        System.exit(2);
    }

    private static Properties load(String path) throws IOException {
        Properties p = new Properties();
        try (Reader r = Files.newBufferedReader(Path.of(path), StandardCharsets.UTF_8)) {
            p.load(r);
        }
        return p;
    }

    // ------------------------------------------------------------------ relay

    /** The Kafka record Kafka Connect would produce for this SourceRecord with StringConverter
     *  for key and value and SimpleHeaderConverter for the headers: strings as their UTF-8 bytes. */
    private static ProducerRecord<byte[], byte[]> toKafka(SourceRecord r) {
        byte[] key = bytes(r.key());
        byte[] value = bytes(r.value());
        RecordHeaders headers = new RecordHeaders();
        for (org.apache.kafka.connect.header.Header h : r.headers()) {
            headers.add(h.key(), bytes(h.value()));
        }
        Long ts = r.timestamp();
        if (ts != null && ts < 0) {
            ts = null;
        }
        return new ProducerRecord<>(r.topic(), r.kafkaPartition(), ts, key, value, headers);
    }

    private static byte[] bytes(Object o) {
        if (o == null) {
            return null;
        }
        if (o instanceof byte[] b) {
            return b;
        }
        return o.toString().getBytes(StandardCharsets.UTF_8);
    }

    private static void relay(String[] args) throws Exception {
        if (args.length != 6) {
            usage();
        }
        final Properties engineProps = load(args[1]);
        final Properties producerProps = load(args[2]);
        final long expected = Long.parseLong(args[3]);
        final AtomicLong firstBatchCpuTicks = new AtomicLong(-1);
        // Optional: the time the WARM_AFTER-th acknowledgement came (the rate of the rest is the
        // warm rate, past the JVM's start-up and JIT compilation).
        final long warmAfter = Long.getLong("warm.after", 0L);
        final AtomicLong ackCount = new AtomicLong();
        final AtomicLong warmMs = new AtomicLong();
        final Path resultFile = Path.of(args[4]);
        final Path stopFile = Path.of(args[5]);

        producerProps.put("key.serializer", ByteArraySerializer.class.getName());
        producerProps.put("value.serializer", ByteArraySerializer.class.getName());

        final long mainStartMs = System.currentTimeMillis();
        final KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(producerProps);

        final AtomicLong acked = new AtomicLong();
        final AtomicLong batches = new AtomicLong();
        final AtomicLong maxBatch = new AtomicLong();
        final AtomicLong firstAckMs = new AtomicLong(Long.MAX_VALUE);
        final AtomicLong lastAckMs = new AtomicLong();
        final AtomicLong firstBatchMs = new AtomicLong();
        final AtomicLong taskStartedMs = new AtomicLong();
        final AtomicLong pollingStartedMs = new AtomicLong();
        final AtomicReference<String> failure = new AtomicReference<>();
        final CountDownLatch finished = new CountDownLatch(1);

        DebeziumEngine.ChangeConsumer<RecordChangeEvent<SourceRecord>> sink = (records, committer) -> {
            if (firstBatchMs.compareAndSet(0, System.currentTimeMillis())) {
                long[] c = selfCpuTicks();
                firstBatchCpuTicks.set(c[0] + c[1]);
            }
            batches.incrementAndGet();
            maxBatch.accumulateAndGet(records.size(), Math::max);
            List<Future<RecordMetadata>> sends = new ArrayList<>(records.size());
            for (RecordChangeEvent<SourceRecord> event : records) {
                sends.add(producer.send(toKafka(event.record()), (metadata, error) -> {
                    if (error == null) {
                        long now = System.currentTimeMillis();
                        firstAckMs.accumulateAndGet(now, Math::min);
                        lastAckMs.accumulateAndGet(now, Math::max);
                        if (ackCount.incrementAndGet() == warmAfter) {
                            warmMs.set(now);
                        }
                    }
                }));
            }
            // At least once: a record is marked processed only once Kafka acknowledged it and
            // every record before it; a failed send fails the batch, nothing after it is marked.
            for (int i = 0; i < records.size(); i++) {
                try {
                    sends.get(i).get();
                }
                catch (ExecutionException e) {
                    failure.compareAndSet(null, "send failed: " + e.getCause());
                    finished.countDown();
                    throw new RuntimeException(e.getCause());
                }
                committer.markProcessed(records.get(i));
            }
            committer.markBatchFinished();
            if (acked.addAndGet(records.size()) >= expected) {
                finished.countDown();
            }
        };

        final DebeziumEngine<RecordChangeEvent<SourceRecord>> engine = DebeziumEngine.create(ChangeEventFormat.of(Connect.class))
                .using(engineProps)
                .using(new DebeziumEngine.ConnectorCallback() {
                    @Override
                    public void taskStarted() {
                        taskStartedMs.compareAndSet(0, System.currentTimeMillis());
                    }

                    @Override
                    public void pollingStarted() {
                        pollingStartedMs.compareAndSet(0, System.currentTimeMillis());
                    }
                })
                .using((success, message, error) -> {
                    if (!success) {
                        failure.compareAndSet(null, "engine stopped: " + message + (error == null ? "" : " " + error));
                    }
                    finished.countDown();
                })
                .notifying(sink)
                .build();

        final long engineStartMs = System.currentTimeMillis();
        ExecutorService executor = Executors.newSingleThreadExecutor();
        executor.execute(engine);

        finished.await();
        final long doneMs = System.currentTimeMillis();
        long[] cpu = selfCpuTicks();
        String result = String.format(
                "{\"ok\":%s,\"failure\":%s,\"acked\":%d,\"expected\":%d,\"batches\":%d,\"max_batch\":%d,"
                        + "\"jvm_start_ms\":%d,\"main_start_ms\":%d,\"engine_start_ms\":%d,\"task_started_ms\":%d,"
                        + "\"polling_started_ms\":%d,\"first_batch_ms\":%d,\"first_ack_ms\":%d,\"last_ack_ms\":%d,"
                        + "\"done_ms\":%d,\"self_cpu_ticks_utime\":%d,\"self_cpu_ticks_stime\":%d,\"first_batch_cpu_ticks\":%d,\"vm_hwm_kib\":%d,\"warm_after\":%d,\"warm_ms\":%d}",
                failure.get() == null && acked.get() >= expected, json(failure.get()), acked.get(), expected,
                batches.get(), maxBatch.get(),
                java.lang.management.ManagementFactory.getRuntimeMXBean().getStartTime(), mainStartMs, engineStartMs,
                taskStartedMs.get(), pollingStartedMs.get(), firstBatchMs.get(),
                firstAckMs.get() == Long.MAX_VALUE ? 0 : firstAckMs.get(), lastAckMs.get(), doneMs,
                cpu[0], cpu[1], firstBatchCpuTicks.get(), vmHwmKib(), warmAfter, warmMs.get());
        Path tmp = Path.of(resultFile + ".tmp");
        Files.writeString(tmp, result + "\n");
        Files.move(tmp, resultFile, java.nio.file.StandardCopyOption.ATOMIC_MOVE);
        System.out.println(result);

        // Idle until the caller has read our counters (at most two minutes).
        long until = System.currentTimeMillis() + 120_000;
        while (!Files.exists(stopFile) && System.currentTimeMillis() < until) {
            Thread.sleep(50);
        }
        engine.close();
        executor.shutdown();
        executor.awaitTermination(60, TimeUnit.SECONDS);
        producer.close(Duration.ofSeconds(10));
        System.exit(failure.get() == null ? 0 : 1);
    }

    private static String json(String s) {
        if (s == null) {
            return "null";
        }
        return "\"" + s.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", " ") + "\"";
    }

    /** utime and stime of this process, in clock ticks (fields 14 and 15 of /proc/self/stat). */
    private static long[] selfCpuTicks() {
        try {
            String stat = Files.readString(Path.of("/proc/self/stat"));
            String[] f = stat.substring(stat.lastIndexOf(')') + 2).split(" ");
            // f[0] is field 3 (state); utime is field 14, stime field 15.
            return new long[]{ Long.parseLong(f[11]), Long.parseLong(f[12]) };
        }
        catch (Exception e) {
            return new long[]{ -1, -1 };
        }
    }

    private static long vmHwmKib() {
        try {
            for (String line : Files.readAllLines(Path.of("/proc/self/status"))) {
                if (line.startsWith("VmHWM:")) {
                    return Long.parseLong(line.replaceAll("[^0-9]", ""));
                }
            }
        }
        catch (Exception e) {
            // fall through
        }
        return -1;
    }

    // ------------------------------------------------------------------ setup

    private static void setup(String[] args) throws Exception {
        if (args.length != 2) {
            usage();
        }
        final Properties engineProps = load(args[1]);
        final String url = "jdbc:postgresql://" + engineProps.getProperty("database.hostname") + ":"
                + engineProps.getProperty("database.port", "5432") + "/" + engineProps.getProperty("database.dbname");
        final String slot = engineProps.getProperty("slot.name");
        final CountDownLatch stopped = new CountDownLatch(1);
        final AtomicReference<String> failure = new AtomicReference<>();
        final AtomicLong seen = new AtomicLong();
        DebeziumEngine<RecordChangeEvent<SourceRecord>> engine = DebeziumEngine.create(ChangeEventFormat.of(Connect.class))
                .using(engineProps)
                .using((success, message, error) -> {
                    if (!success) {
                        failure.set(message + (error == null ? "" : " " + error));
                    }
                    stopped.countDown();
                })
                .notifying((records, committer) -> {
                    seen.addAndGet(records.size());
                    for (RecordChangeEvent<SourceRecord> r : records) {
                        committer.markProcessed(r);
                    }
                    committer.markBatchFinished();
                })
                .build();
        ExecutorService executor = Executors.newSingleThreadExecutor();
        executor.execute(engine);
        boolean active = false;
        long until = System.currentTimeMillis() + 180_000;
        Properties jdbc = new Properties();
        jdbc.setProperty("user", engineProps.getProperty("database.user"));
        if (engineProps.getProperty("database.password") != null) {
            jdbc.setProperty("password", engineProps.getProperty("database.password"));
        }
        try (Connection c = DriverManager.getConnection(url, jdbc);
                PreparedStatement st = c.prepareStatement("SELECT active FROM pg_replication_slots WHERE slot_name = ?")) {
            st.setString(1, slot);
            while (!active && stopped.getCount() > 0 && System.currentTimeMillis() < until) {
                try (ResultSet rs = st.executeQuery()) {
                    active = rs.next() && rs.getBoolean(1);
                }
                if (!active) {
                    Thread.sleep(100);
                }
            }
        }
        // Let the streaming loop settle before stopping.
        Thread.sleep(1000);
        engine.close();
        executor.shutdown();
        executor.awaitTermination(60, TimeUnit.SECONDS);
        System.out.printf("{\"setup\":\"%s\",\"slot_active_seen\":%s,\"records_seen\":%d,\"failure\":%s}%n",
                slot, active, seen.get(), json(failure.get()));
        System.exit(active && failure.get() == null ? 0 : 1);
    }

    // ------------------------------------------------------------------ print

    private static void print(String[] args) throws Exception {
        if (args.length != 3) {
            usage();
        }
        final Properties engineProps = load(args[1]);
        final long expected = Long.parseLong(args[2]);
        final AtomicLong seen = new AtomicLong();
        final CountDownLatch finished = new CountDownLatch(1);
        DebeziumEngine<RecordChangeEvent<SourceRecord>> engine = DebeziumEngine.create(ChangeEventFormat.of(Connect.class))
                .using(engineProps)
                .using((success, message, error) -> {
                    System.out.println("engine stopped: success=" + success + " " + message + (error == null ? "" : " " + error));
                    finished.countDown();
                })
                .notifying((records, committer) -> {
                    for (RecordChangeEvent<SourceRecord> e : records) {
                        ProducerRecord<byte[], byte[]> pr = toKafka(e.record());
                        if (seen.incrementAndGet() <= 3) {
                            StringBuilder sb = new StringBuilder("topic=" + pr.topic() + " partition=" + pr.partition()
                                    + " ts=" + pr.timestamp() + " key=" + new String(pr.key(), StandardCharsets.UTF_8));
                            for (Header h : pr.headers()) {
                                sb.append(' ').append(h.key()).append('=').append(new String(h.value(), StandardCharsets.UTF_8));
                            }
                            sb.append(" value=").append(new String(pr.value(), StandardCharsets.UTF_8));
                            sb.append(" | source value schema=").append(e.record().valueSchema() == null ? null : e.record().valueSchema().name());
                            System.out.println(sb);
                        }
                        committer.markProcessed(e);
                    }
                    committer.markBatchFinished();
                    System.out.println("batch of " + records.size() + ", total " + seen.get());
                    if (seen.get() >= expected) {
                        finished.countDown();
                    }
                })
                .build();
        ExecutorService executor = Executors.newSingleThreadExecutor();
        executor.execute(engine);
        finished.await(60, TimeUnit.SECONDS);
        engine.close();
        executor.shutdown();
        executor.awaitTermination(60, TimeUnit.SECONDS);
        System.out.println("seen " + seen.get());
        System.exit(seen.get() >= expected ? 0 : 1);
    }

    // ------------------------------------------------------------------ produce

    private static void produce(String[] args) throws Exception {
        if (args.length != 4) {
            usage();
        }
        Properties producerProps = load(args[1]);
        producerProps.put("key.serializer", ByteArraySerializer.class.getName());
        producerProps.put("value.serializer", ByteArraySerializer.class.getName());
        String topic = args[2];
        int n = Integer.parseInt(args[3]);
        List<ProducerRecord<byte[], byte[]>> records = new ArrayList<>(n);
        String note = "x".repeat(153);
        for (int i = 1; i <= n; i++) {
            String value = "{\"note\": \"" + note + "\", \"amount\": \"" + ((100 + i % 9900) / 100) + "." + String.format("%02d", (100 + i % 9900) % 100)
                    + "\", \"currency\": \"EUR\", \"order_id\": \"order-" + i + "\", \"payment_id\": \"pay-" + i + "\"}";
            RecordHeaders h = new RecordHeaders();
            h.add("id", java.util.UUID.randomUUID().toString().getBytes(StandardCharsets.UTF_8));
            h.add("ce_type", "order.paid".getBytes(StandardCharsets.UTF_8));
            h.add("ce_time", "2026-12-03T11:01:21.971215Z".getBytes(StandardCharsets.UTF_8));
            h.add("idem_aggregate_seq", Integer.toString(1 + i / 1000).getBytes(StandardCharsets.UTF_8));
            records.add(new ProducerRecord<>(topic, null, null, ("agg-" + (i % 1000)).getBytes(StandardCharsets.UTF_8),
                    value.getBytes(StandardCharsets.UTF_8), h));
        }
        try (KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(producerProps)) {
            // Warm the connection and metadata with one record first.
            producer.send(new ProducerRecord<>(topic, "warm".getBytes(StandardCharsets.UTF_8), "{}".getBytes(StandardCharsets.UTF_8))).get();
            long[] c0 = selfCpuTicks();
            long t0 = System.nanoTime();
            List<Future<RecordMetadata>> fs = new ArrayList<>(n);
            for (ProducerRecord<byte[], byte[]> r : records) {
                fs.add(producer.send(r));
            }
            for (Future<RecordMetadata> f : fs) {
                f.get();
            }
            long t1 = System.nanoTime();
            long[] c1 = selfCpuTicks();
            double s = (t1 - t0) / 1e9;
            System.out.printf("{\"produce\":%d,\"seconds\":%.3f,\"per_s\":%.0f,\"client_cpu_s\":%.2f}%n", n, s, n / s,
                    ((c1[0] + c1[1]) - (c0[0] + c0[1])) / 100.0);
        }
    }

    // ------------------------------------------------------------------ topic

    private static void topic(String[] args) throws Exception {
        if (args.length != 4) {
            usage();
        }
        Properties p = new Properties();
        p.put("bootstrap.servers", args[1]);
        String name = args[2];
        int partitions = Integer.parseInt(args[3]);
        try (Admin admin = Admin.create(p)) {
            admin.createTopics(List.of(new NewTopic(name, partitions, (short) 1))).all().get(60, TimeUnit.SECONDS);
            long until = System.currentTimeMillis() + 60_000;
            while (true) {
                TopicDescription d = admin.describeTopics(List.of(name)).allTopicNames().get(30, TimeUnit.SECONDS).get(name);
                boolean ready = d.partitions().size() == partitions;
                for (TopicPartitionInfo tp : d.partitions()) {
                    ready &= tp.leader() != null && !tp.leader().isEmpty();
                }
                if (ready) {
                    break;
                }
                if (System.currentTimeMillis() > until) {
                    throw new IllegalStateException("topic " + name + " has no leaders yet");
                }
                Thread.sleep(100);
            }
        }
        System.out.printf("{\"topic\":\"%s\",\"partitions\":%d}%n", name, partitions);
    }

    // ------------------------------------------------------------------ count

    private static void count(String[] args) throws Exception {
        if (args.length != 5) {
            usage();
        }
        String topic = args[2];
        String idHeader = args[3];
        String seqHeader = args[4];
        Properties p = new Properties();
        p.put("bootstrap.servers", args[1]);
        p.put("enable.auto.commit", "false");
        p.put("auto.offset.reset", "earliest");
        p.put("max.poll.records", "5000");
        p.put("key.deserializer", ByteArrayDeserializer.class.getName());
        p.put("value.deserializer", ByteArrayDeserializer.class.getName());
        long records = 0;
        long bytes = 0;
        long valueBytes = 0;
        long headerCount = 0;
        long missingId = 0;
        long orderViolations = 0;
        Set<String> ids = new HashSet<>(200_000);
        Map<String, Long> lastSeq = new HashMap<>();
        Map<Integer, Long> perPartition = new TreeMap<>();
        String sample = null;
        try (KafkaConsumer<byte[], byte[]> consumer = new KafkaConsumer<>(p)) {
            List<TopicPartition> tps = new ArrayList<>();
            for (PartitionInfo pi : consumer.partitionsFor(topic, Duration.ofSeconds(30))) {
                tps.add(new TopicPartition(topic, pi.partition()));
            }
            consumer.assign(tps);
            consumer.seekToBeginning(tps);
            Map<TopicPartition, Long> end = consumer.endOffsets(tps, Duration.ofSeconds(30));
            long deadline = System.currentTimeMillis() + 120_000;
            while (System.currentTimeMillis() < deadline) {
                boolean done = true;
                for (TopicPartition tp : tps) {
                    done &= consumer.position(tp, Duration.ofSeconds(30)) >= end.get(tp);
                }
                if (done) {
                    break;
                }
                ConsumerRecords<byte[], byte[]> batch = consumer.poll(Duration.ofMillis(500));
                for (ConsumerRecord<byte[], byte[]> r : batch) {
                    records++;
                    perPartition.merge(r.partition(), 1L, Long::sum);
                    int size = (r.key() == null ? 0 : r.key().length) + (r.value() == null ? 0 : r.value().length);
                    valueBytes += r.value() == null ? 0 : r.value().length;
                    String id = null;
                    String seq = null;
                    for (Header h : r.headers()) {
                        headerCount++;
                        size += h.key().getBytes(StandardCharsets.UTF_8).length + (h.value() == null ? 0 : h.value().length);
                        if (id == null && h.key().equals(idHeader) && h.value() != null) {
                            id = new String(h.value(), StandardCharsets.UTF_8);
                        }
                        if (seq == null && h.key().equals(seqHeader) && h.value() != null) {
                            seq = new String(h.value(), StandardCharsets.UTF_8);
                        }
                    }
                    bytes += size;
                    if (id == null) {
                        missingId++;
                    }
                    else {
                        ids.add(id);
                    }
                    if (seq != null && r.key() != null) {
                        String key = new String(r.key(), StandardCharsets.UTF_8);
                        long s = Long.parseLong(seq.replace("\"", ""));
                        Long before = lastSeq.put(key, s);
                        if (before != null && before >= s) {
                            orderViolations++;
                        }
                    }
                    if (sample == null) {
                        StringBuilder sb = new StringBuilder();
                        sb.append("key=").append(r.key() == null ? "null" : new String(r.key(), StandardCharsets.UTF_8));
                        for (Header h : r.headers()) {
                            sb.append(' ').append(h.key()).append('=')
                                    .append(h.value() == null ? "null" : new String(h.value(), StandardCharsets.UTF_8));
                        }
                        sb.append(" value=").append(r.value() == null ? "null" : new String(r.value(), StandardCharsets.UTF_8));
                        sample = sb.toString();
                    }
                }
            }
            long endTotal = 0;
            for (long e : end.values()) {
                endTotal += e;
            }
            System.out.printf("{\"topic\":\"%s\",\"records\":%d,\"end_offsets_total\":%d,\"distinct_ids\":%d,\"missing_id\":%d,"
                    + "\"keys\":%d,\"seq_order_violations\":%d,\"bytes\":%d,\"value_bytes\":%d,\"headers\":%d,"
                    + "\"per_partition\":%s,\"sample\":%s}%n",
                    topic, records, endTotal, ids.size(), missingId, lastSeq.size(), orderViolations, bytes, valueBytes,
                    headerCount, perPartition.toString().replace("=", ":").replaceAll("(\\d+):", "\"$1\":"), json(sample));
        }
    }
}
