// Readiness probe for the cluster of scripts/kafka. Single-file source program (JEP 330):
//
//   java -cp 'LIBS/*' Ready.java BOOTSTRAP EXPECTED_BROKERS TIMEOUT_SECS [CLIENT_PROPERTIES]
//
// CLIENT_PROPERTIES (a secured cluster's login: security.protocol, ssl.*, sasl.*) is read
// into the admin client's settings.
// Exits 0 once EXPECTED_BROKERS brokers are registered and unfenced and a throw-away topic
// with replication factor EXPECTED_BROKERS has a leader and a full ISR (it is deleted again);
// exits 1 with the last problem seen when TIMEOUT_SECS pass first. Progress goes to stderr.

import java.io.FileInputStream;
import java.io.InputStream;
import java.util.Collection;
import java.util.List;
import java.util.Properties;
import java.util.UUID;
import java.util.concurrent.ExecutionException;
import java.util.stream.Collectors;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.DescribeClusterOptions;
import org.apache.kafka.clients.admin.DescribeTopicsOptions;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.clients.admin.TopicDescription;
import org.apache.kafka.common.Node;
import org.apache.kafka.common.TopicPartitionInfo;
import org.apache.kafka.common.errors.TopicExistsException;

public class Ready {
    public static void main(String[] args) throws Exception {
        if (args.length != 3 && args.length != 4) {
            System.err.println("usage: java -cp 'libs/*' Ready.java BOOTSTRAP EXPECTED_BROKERS TIMEOUT_SECS [CLIENT_PROPERTIES]");
            System.exit(2);
        }
        String bootstrap = args[0];
        int expected = Integer.parseInt(args[1]);
        long deadline = System.nanoTime() + Long.parseLong(args[2]) * 1_000_000_000L;

        Properties props = new Properties();
        if (args.length == 4) {
            try (InputStream in = new FileInputStream(args[3])) {
                props.load(in);
            }
        }
        props.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(AdminClientConfig.CLIENT_ID_CONFIG, "idem-kafka-ready");
        props.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, "3000");
        props.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, "5000");
        props.put(AdminClientConfig.RECONNECT_BACKOFF_MS_CONFIG, "100");
        props.put(AdminClientConfig.RECONNECT_BACKOFF_MAX_MS_CONFIG, "500");
        props.put(AdminClientConfig.RETRY_BACKOFF_MS_CONFIG, "100");
        props.put(AdminClientConfig.RETRY_BACKOFF_MAX_MS_CONFIG, "500");

        String topic = "idem-ready-" + UUID.randomUUID();
        String last = "no answer from " + bootstrap + " yet";
        int phase = 0; // 0: brokers, 1: create topic, 2: topic fully replicated
        try (Admin admin = Admin.create(props)) {
            while (true) {
                try {
                    if (phase == 0) {
                        Collection<Node> nodes = admin.describeCluster(
                                new DescribeClusterOptions().includeFencedBrokers(true).timeoutMs(3000))
                            .nodes().get();
                        List<Node> unfenced = nodes.stream().filter(n -> !n.isFenced()).collect(Collectors.toList());
                        last = nodes.size() + " broker(s) registered, " + unfenced.size() + " unfenced "
                            + nodes.stream().map(n -> n.id() + (n.isFenced() ? "(fenced)" : "")).collect(Collectors.toList())
                            + ", want " + expected;
                        if (unfenced.size() >= expected) {
                            System.err.println("[Ready] " + last);
                            phase = 1;
                            continue;
                        }
                    } else if (phase == 1) {
                        try {
                            admin.createTopics(List.of(new NewTopic(topic, 1, (short) expected))).all().get();
                        } catch (ExecutionException e) {
                            if (!(e.getCause() instanceof TopicExistsException)) throw e;
                        }
                        phase = 2;
                        continue;
                    } else {
                        TopicDescription d = admin.describeTopics(List.of(topic), new DescribeTopicsOptions().timeoutMs(3000))
                            .allTopicNames().get().get(topic);
                        TopicPartitionInfo p = d.partitions().get(0);
                        last = "probe topic " + topic + ": leader " + p.leader() + ", isr " + p.isr();
                        if (p.leader() != null && !p.leader().isEmpty() && p.isr().size() >= expected) {
                            System.err.println("[Ready] " + last);
                            try {
                                admin.deleteTopics(List.of(topic)).all().get();
                            } catch (ExecutionException e) {
                                System.err.println("[Ready] could not delete " + topic + ": " + e.getCause());
                            }
                            return;
                        }
                    }
                } catch (ExecutionException e) {
                    last = e.getCause().toString();
                }
                if (System.nanoTime() > deadline) {
                    System.err.println("[Ready] not ready: " + last);
                    System.exit(1);
                }
                Thread.sleep(200);
            }
        }
    }
}
