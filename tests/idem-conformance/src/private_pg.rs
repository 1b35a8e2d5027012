//! A PostgreSQL server of the test's own (initdb into a temporary directory, a free loopback
//! port, `wal_level = logical`), for tests that restart or crash the server: the suite's
//! shared server must never be restarted while other tests use it.
//!
//! Run as root (CI), the server runs as the `postgres` user (initdb refuses root); otherwise
//! as the current user. The binaries are Debian's (`/usr/lib/postgresql/<version>/bin`).

use std::path::{Path, PathBuf};
use std::process::Command;

/// A private server; stopped (immediately) and deleted when dropped.
pub struct PrivatePg {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    as_postgres: bool,
}

impl PrivatePg {
    /// Creates and starts the server.
    pub fn start() -> Self {
        let bin = bin_dir();
        let dir = tempfile::Builder::new()
            .prefix("idem-private-pg-")
            .tempdir()
            .unwrap();
        let as_postgres = is_root();
        if as_postgres {
            chown_postgres(dir.path());
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let pg = PrivatePg {
            dir,
            bin,
            port,
            as_postgres,
        };
        let data = pg.data();
        pg.run(
            "initdb",
            &["-D", &data, "-A", "trust", "-U", "postgres", "--no-sync"],
        );
        let conf = format!(
            "listen_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{}'\n\
             wal_level = logical\nmax_wal_senders = 4\nmax_replication_slots = 4\n\
             fsync = on\nshared_buffers = 16MB\n",
            pg.dir.path().display()
        );
        let path = Path::new(&data).join("postgresql.conf");
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str(&conf);
        std::fs::write(&path, text).unwrap();
        pg.ctl(&["start"]);
        pg
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server as a crash would (`-m immediate`: no shutdown checkpoint, recovery
    /// replays the WAL at the next start) and starts it again.
    pub fn crash_and_restart(&self) {
        self.ctl(&["stop", "-m", "immediate"]);
        self.ctl(&["start"]);
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    fn ctl(&self, args: &[&str]) {
        let data = self.data();
        let log = self.dir.path().join("server.log").display().to_string();
        let mut all = vec!["-D", &data, "-l", &log, "-w"];
        all.extend_from_slice(args);
        self.run("pg_ctl", &all);
    }

    fn run(&self, program: &str, args: &[&str]) {
        let exe = self.bin.join(program);
        let out = if self.as_postgres {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&exe)
                .args(args)
                .output()
        } else {
            Command::new(&exe).args(args).output()
        }
        .unwrap_or_else(|e| panic!("running {}: {e}", exe.display()));
        assert!(
            out.status.success(),
            "{program} {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        let data = self.data();
        let exe = self.bin.join("pg_ctl");
        let args = ["-D", data.as_str(), "-m", "immediate", "-w", "stop"];
        let _ = if self.as_postgres {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&exe)
                .args(args)
                .output()
        } else {
            Command::new(&exe).args(args).output()
        };
    }
}

/// The newest installed PostgreSQL's binaries.
fn bin_dir() -> PathBuf {
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<u32> = std::fs::read_dir(root)
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (is PostgreSQL installed? scripts/test installs it)",
                root.display()
            )
        })
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    versions.sort_unstable();
    let v = versions
        .last()
        .expect("a PostgreSQL version under /usr/lib/postgresql");
    root.join(v.to_string()).join("bin")
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn chown_postgres(dir: &Path) {
    let ok = Command::new("chown")
        .args(["postgres:postgres"])
        .arg(dir)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "chown postgres {}", dir.display());
}
