//! A PostgreSQL server of the test's own (initdb into a temporary directory, a free loopback
//! port outside the ephemeral range, `wal_level = logical`), for tests that restart or crash the
//! server: the suite's shared server must never be restarted while other tests use it.
//!
//! Run as root (CI), the server runs as the `postgres` user (initdb refuses root); otherwise
//! as the current user. The binaries are Debian's (`/usr/lib/postgresql/<version>/bin`).

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::ports::Ports;

/// A private server; stopped (immediately) and deleted when dropped.
pub struct PrivatePg {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    as_postgres: bool,
    /// The port of the streaming standby, while there is one ([`PrivatePg::try_add_standby`]).
    standby: std::sync::Mutex<Option<u16>>,
}

impl PrivatePg {
    /// Creates and starts the server (panics when it cannot: for tests).
    pub fn start() -> Self {
        Self::try_start().unwrap_or_else(|e| panic!("starting a private PostgreSQL: {e}"))
    }

    /// Creates and starts the server.
    pub fn try_start() -> io::Result<Self> {
        let bin = bin_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("idem-private-pg-")
            .tempdir()?;
        let as_postgres = is_root();
        if as_postgres {
            chown_postgres(dir.path())?;
        }
        // Below the ephemeral range: clients reconnect while the server is down (crate::ports).
        let port = Ports::new().pick()?;
        let pg = PrivatePg {
            dir,
            bin,
            port,
            as_postgres,
            standby: std::sync::Mutex::new(None),
        };
        let data = pg.data();
        pg.run(
            "initdb",
            &["-D", &data, "-A", "trust", "-U", "postgres", "--no-sync"],
        )?;
        let conf = format!(
            "listen_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{}'\n\
             wal_level = logical\nmax_wal_senders = 8\nmax_replication_slots = 8\n\
             fsync = on\nshared_buffers = 16MB\n",
            pg.dir.path().display()
        );
        let path = Path::new(&data).join("postgresql.conf");
        let mut text = std::fs::read_to_string(&path)?;
        text.push_str(&conf);
        std::fs::write(&path, text)?;
        pg.ctl(&["start"])?;
        Ok(pg)
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The server's log.
    pub fn log(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// Stops the server as a crash would (`-m immediate`: no shutdown checkpoint, recovery
    /// replays the WAL at the next start) and starts it again (panics when it cannot).
    pub fn crash_and_restart(&self) {
        self.try_crash_and_restart()
            .unwrap_or_else(|e| panic!("restarting the private PostgreSQL: {e}"));
    }

    /// [`PrivatePg::crash_and_restart`], with the failure as an error.
    pub fn try_crash_and_restart(&self) -> io::Result<()> {
        self.try_crash()?;
        self.try_start_again()
    }

    /// Stops the server as a crash would and leaves it down (an outage); then
    /// [`PrivatePg::try_start_again`].
    pub fn try_crash(&self) -> io::Result<()> {
        self.ctl(&["stop", "-m", "immediate"])
    }

    /// Starts the server after [`PrivatePg::try_crash`] (recovery replays the WAL).
    pub fn try_start_again(&self) -> io::Result<()> {
        self.ctl(&["start"])
    }

    /// Makes a synchronous streaming standby of the server (`pg_basebackup -R`, on a port of
    /// its own) and waits until it streams: from then on every commit waits until the standby
    /// has it, so a failover loses no commit. Logical replication slots are not copied: the
    /// standby has none, as a PostgreSQL 15 or 16 standby never has.
    pub fn try_add_standby(&self) -> io::Result<()> {
        let mut ports = Ports::new();
        ports.reserve([self.port]);
        let port = ports.pick()?;
        let standby = self.standby_data();
        let primary = self.port.to_string();
        self.run(
            "pg_basebackup",
            &[
                "-D",
                &standby,
                "-h",
                "127.0.0.1",
                "-p",
                &primary,
                "-U",
                "postgres",
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ],
        )?;
        let log = self.dir.path().join("standby.log").display().to_string();
        let port_option = format!("-p {port}");
        self.run(
            "pg_ctl",
            &[
                "-D",
                &standby,
                "-l",
                &log,
                "-w",
                "-o",
                &port_option,
                "start",
            ],
        )?;
        *self.standby.lock().unwrap_or_else(|p| p.into_inner()) = Some(port);
        // Synchronous from here on (the standby's own settings, copied before, have none).
        let conf = Path::new(&self.data()).join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf)?;
        text.push_str("synchronous_standby_names = '*'\n");
        std::fs::write(&conf, text)?;
        self.ctl(&["reload"])?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while self.psql("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'")?
            != "1"
        {
            if std::time::Instant::now() > deadline {
                return Err(io::Error::other("the standby did not stream within 60 s"));
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        Ok(())
    }

    /// Fails over to the standby: the primary stops as a crash would, the standby is promoted,
    /// then restarted in the primary's place (its data directory and port), so clients of
    /// [`PrivatePg::url`] reconnect to the new primary.
    pub fn try_fail_over(&self) -> io::Result<()> {
        let mut standby_port = self.standby.lock().unwrap_or_else(|p| p.into_inner());
        if standby_port.is_none() {
            return Err(io::Error::other(
                "no standby to fail over to: try_add_standby first",
            ));
        }
        let (data, standby) = (self.data(), self.standby_data());
        self.ctl(&["stop", "-m", "immediate"])?;
        self.run("pg_ctl", &["-D", &standby, "-w", "promote"])?;
        self.run("pg_ctl", &["-D", &standby, "-w", "-m", "fast", "stop"])?;
        let old = self.dir.path().join("data.failed");
        std::fs::rename(&data, &old)?;
        std::fs::rename(&standby, &data)?;
        // The standby is the server now: it no longer runs on a port of its own.
        *standby_port = None;
        self.ctl(&["start"])
    }

    /// One value a query returns, as `psql -At` prints it.
    fn psql(&self, sql: &str) -> io::Result<String> {
        let port = self.port.to_string();
        let out = self
            .command("psql")
            .args([
                "-X",
                "-At",
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-c",
                sql,
            ])
            .output()?;
        if !out.status.success() {
            return Err(io::Error::other(
                String::from_utf8_lossy(&out.stderr).into_owned(),
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    fn standby_data(&self) -> String {
        self.dir.path().join("standby").display().to_string()
    }

    fn ctl(&self, args: &[&str]) -> io::Result<()> {
        let data = self.data();
        let log = self.log().display().to_string();
        let mut all = vec!["-D", &data, "-l", &log, "-w"];
        all.extend_from_slice(args);
        self.run("pg_ctl", &all)
    }

    fn command(&self, program: &str) -> Command {
        let exe = self.bin.join(program);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(exe);
            c
        } else {
            Command::new(exe)
        }
    }

    fn run(&self, program: &str, args: &[&str]) -> io::Result<()> {
        let out = self.command(program).args(args).output()?;
        if out.status.success() {
            return Ok(());
        }
        Err(io::Error::other(format!(
            "{program} {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )))
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        let mut dirs = vec![self.data()];
        if self.standby.lock().is_ok_and(|s| s.is_some()) {
            dirs.push(self.standby_data());
        }
        for data in dirs {
            let args = ["-D", data.as_str(), "-m", "immediate", "-w", "stop"];
            let _ = self.command("pg_ctl").args(args).output();
        }
    }
}

/// The newest installed PostgreSQL's binaries.
fn bin_dir() -> io::Result<PathBuf> {
    let root = Path::new("/usr/lib/postgresql");
    let entries = std::fs::read_dir(root).map_err(|e| {
        io::Error::other(format!(
            "{}: {e} (is PostgreSQL installed? scripts/test installs it)",
            root.display()
        ))
    })?;
    let newest = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .max()
        .ok_or_else(|| io::Error::other("no PostgreSQL version under /usr/lib/postgresql"))?;
    Ok(root.join(newest.to_string()).join("bin"))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn chown_postgres(dir: &Path) -> io::Result<()> {
    let status = Command::new("chown")
        .args(["postgres:postgres"])
        .arg(dir)
        .status()?;
    if status.success() {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "chown postgres {}",
        dir.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Clients reconnect while the server is down: on a port of the ephemeral range, a client's
    /// connect could be given the server's port as its own and read its own bytes back.
    #[test]
    fn the_server_listens_outside_the_ephemeral_range() {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap();
        let bounds: Vec<u16> = range
            .split_whitespace()
            .map(|b| b.parse().unwrap())
            .collect();
        let (low, high) = (bounds[0], bounds[1]);
        let pg = PrivatePg::start();
        let url = pg.url();
        let port: u16 = url
            .trim_start_matches("postgres://postgres@127.0.0.1:")
            .trim_end_matches("/postgres")
            .parse()
            .unwrap();
        assert!(
            port < low || port > high,
            "{url}: in the ephemeral range {low}-{high}"
        );
        let status = Command::new(pg.bin.join("pg_isready"))
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "nothing answers at {url}");
    }
}
