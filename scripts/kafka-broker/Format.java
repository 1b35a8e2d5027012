// Formats the storage of every node of a new cluster in one JVM (three JVMs side by side take
// twice as long on a two-core machine). Single-file source program (JEP 330):
//
//   java -cp 'LIBS/*' Format.java [--add-scram-file FILE] CLUSTER_ID SERVER_PROPERTIES...
//
// Each file gets `kafka.tools.StorageTool format -t CLUSTER_ID -c FILE`, as kafka-storage.sh
// would run it, with an `--add-scram SPEC` for every non-empty line of the --add-scram-file
// (for example 'SCRAM-SHA-512=[name=alice,password=secret]': a SCRAM user created in the
// metadata at format time). The SPECs, which hold passwords, come in a file so that they never
// stand on a command line. The quorum is static (controller.quorum.voters), so no --standalone
// or --initial-controllers. Exits with the first non-zero status.

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;

public class Format {
    public static void main(String[] args) {
        List<String> scram = new ArrayList<>();
        int first = 0;
        if (args.length > 1 && args[0].equals("--add-scram-file")) {
            try {
                for (String spec : Files.readAllLines(Path.of(args[1]))) {
                    if (!spec.isBlank()) {
                        scram.add("--add-scram");
                        scram.add(spec.strip());
                    }
                }
            } catch (IOException e) {
                System.err.println("reading the SCRAM users of " + args[1] + " failed: " + e);
                System.exit(2);
            }
            first = 2;
        }
        if (args.length - first < 2) {
            System.err.println("usage: java -cp 'libs/*' Format.java [--add-scram-file FILE] CLUSTER_ID SERVER_PROPERTIES...");
            System.exit(2);
        }
        String clusterId = args[first];
        for (int i = first + 1; i < args.length; i++) {
            int rc;
            List<String> argv = new ArrayList<>(List.of("format", "-t", clusterId, "-c", args[i]));
            argv.addAll(scram);
            try {
                rc = kafka.tools.StorageTool.execute(argv.toArray(new String[0]), System.out);
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
