// Formats the storage of every node of a new cluster in one JVM (three JVMs side by side take
// twice as long on a two-core machine). Single-file source program (JEP 330):
//
//   java -cp 'LIBS/*' Format.java CLUSTER_ID SERVER_PROPERTIES...
//
// Each file gets `kafka.tools.StorageTool format -t CLUSTER_ID -c FILE`, as kafka-storage.sh
// would run it. The quorum is static (controller.quorum.voters), so no --standalone or
// --initial-controllers. Exits with the first non-zero status.

public class Format {
    public static void main(String[] args) {
        if (args.length < 2) {
            System.err.println("usage: java -cp 'libs/*' Format.java CLUSTER_ID SERVER_PROPERTIES...");
            System.exit(2);
        }
        for (int i = 1; i < args.length; i++) {
            int rc;
            try {
                rc = kafka.tools.StorageTool.execute(new String[] {"format", "-t", args[0], "-c", args[i]}, System.out);
            } catch (Exception e) {
                System.err.println("formatting " + args[i] + " failed: " + e);
                rc = 1;
            }
            if (rc != 0) {
                System.err.println("formatting " + args[i] + " exited with " + rc);
                System.exit(rc);
            }
        }
    }
}
