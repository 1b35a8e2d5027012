//! A Tansu broker process for end-to-end tests.
//!
//! The binary is `$TANSU_BIN`, else `tansu` on the `PATH`, else `~/.cargo/bin/tansu`
//! (`scripts/test` installs it). Each [`Tansu`] listens on its own loopback port, runs from an
//! empty working directory (Tansu reads a `.env` from it), keeps its data in memory, and is
//! killed when dropped.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::process::Proc;

pub fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("TANSU_BIN") {
        return p.into();
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("tansu");
            if p.is_file() {
                return p;
            }
        }
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let p = home.join(".cargo/bin/tansu");
    assert!(
        p.is_file(),
        "Tansu is not installed: run scripts/test, or `cargo install tansu --version 0.6.0 --locked --features dynostore,libsql,postgres`"
    );
    p
}

/// A free loopback port (bound and released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Tansu {
    proc: Option<Proc>,
    port: u16,
    dir: tempfile::TempDir,
}

impl Tansu {
    /// Starts a broker and waits until it accepts connections.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut t = Tansu {
            proc: None,
            port,
            dir,
        };
        t.spawn();
        t
    }

    fn spawn(&mut self) {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let mut cmd = Command::new(binary());
        cmd.arg("broker")
            .arg("--listener-url")
            .arg(&url)
            .arg("--advertised-listener-url")
            .arg(&url)
            .arg("--storage-engine")
            .arg("memory://tansu/")
            .current_dir(self.dir.path());
        for var in [
            "CLUSTER_ID",
            "LISTENER_URL",
            "ADVERTISED_LISTENER_URL",
            "STORAGE_ENGINE",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ] {
            cmd.env_remove(var);
        }
        self.proc = Some(Proc::spawn("tansu", cmd));
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect_timeout(
            &([127, 0, 0, 1], self.port).into(),
            Duration::from_millis(200),
        )
        .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "Tansu did not listen on port {} within 30 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `127.0.0.1:PORT`.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        drop(self.proc.take());
    }
}
