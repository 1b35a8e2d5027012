// Denies a principal every operation on one topic of a cluster of scripts/kafka (an ACL a
// test's relay must meet). Single-file source program (JEP 330):
//
//   java -cp 'LIBS/*' Acl.java BOOTSTRAP CLIENT_PROPERTIES PRINCIPAL TOPIC
//
// CLIENT_PROPERTIES is the cluster's admin login (DIR/client.properties). Exits 0 once the
// broker has the ACL; 1 with the error otherwise.

import java.io.FileInputStream;
import java.io.InputStream;
import java.util.List;
import java.util.Properties;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.common.acl.AccessControlEntry;
import org.apache.kafka.common.acl.AclBinding;
import org.apache.kafka.common.acl.AclOperation;
import org.apache.kafka.common.acl.AclPermissionType;
import org.apache.kafka.common.resource.PatternType;
import org.apache.kafka.common.resource.ResourcePattern;
import org.apache.kafka.common.resource.ResourceType;

public class Acl {
    public static void main(String[] args) throws Exception {
        if (args.length != 4) {
            System.err.println("usage: java -cp 'libs/*' Acl.java BOOTSTRAP CLIENT_PROPERTIES PRINCIPAL TOPIC");
            System.exit(2);
        }
        Properties props = new Properties();
        try (InputStream in = new FileInputStream(args[1])) {
            props.load(in);
        }
        props.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]);
        props.put(AdminClientConfig.CLIENT_ID_CONFIG, "idem-kafka-acl");
        props.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, "10000");
        props.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, "20000");
        AclBinding deny = new AclBinding(
            new ResourcePattern(ResourceType.TOPIC, args[3], PatternType.LITERAL),
            new AccessControlEntry(args[2], "*", AclOperation.ALL, AclPermissionType.DENY));
        try (Admin admin = Admin.create(props)) {
            admin.createAcls(List.of(deny)).all().get();
            System.err.println("[Acl] " + args[2] + " denied every operation on topic " + args[3]);
        } catch (Exception e) {
            System.err.println("[Acl] " + e + (e.getCause() == null ? "" : " (" + e.getCause() + ")"));
            System.exit(1);
        }
    }
}
