//! Running idem's binaries as real OS processes, for crash tests.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A child process whose standard error is captured line by line.
pub struct Proc {
    name: String,
    child: Child,
    lines: Receiver<String>,
    log: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    /// Spawns `cmd` with piped stderr (stdout is inherited to the test's output).
    pub fn spawn(name: &str, mut cmd: Command) -> Self {
        cmd.stderr(Stdio::piped())
            .stdout(Stdio::null())
            .stdin(Stdio::null());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        let log2 = log.clone();
        let label = name.to_owned();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[{label}] {line}");
                log2.lock().unwrap().push(line.clone());
                let _ = tx.send(line);
            }
        });
        Proc {
            name: name.to_owned(),
            child,
            lines: rx,
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for a stderr line containing `needle` and returns it.
    pub fn wait_for_line(&self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        if let Some(l) = self.log.lock().unwrap().iter().find(|l| l.contains(needle)) {
            return l.clone();
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(needle) => return l,
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => panic!(
                    "{}: no line containing {needle:?} within {timeout:?}",
                    self.name
                ),
                Err(RecvTimeoutError::Disconnected) => {
                    panic!(
                        "{}: exited before printing {needle:?}; log:\n{}",
                        self.name,
                        self.log().join("\n")
                    )
                }
            }
        }
    }

    /// The address in a `... metrics on http://ADDR/metrics` line.
    pub fn metrics_addr(&self) -> SocketAddr {
        let line = self.wait_for_line("metrics on http://", Duration::from_secs(30));
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|s| s.split('/').next())
            .unwrap();
        addr.parse().unwrap()
    }

    /// Everything printed to stderr so far.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Everything the process printed to stderr, once it has exited: the reader thread may
    /// still be reading the last lines from the pipe when the exit is seen, so this waits (at
    /// most 5 s) for it to reach the end of the pipe, when its sender is dropped.
    pub fn final_log(&mut self) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(_) => {}
                Err(RecvTimeoutError::Disconnected | RecvTimeoutError::Timeout) => break,
            }
        }
        self.log()
    }

    /// Waits for the process to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within {timeout:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Spawns `cmd`, a command that must refuse to start, and waits until it exits, at most
    /// `bound`; returns its standard error, having asserted that it failed within `bound`.
    pub fn refused(name: &str, cmd: Command, bound: Duration) -> String {
        let started = Instant::now();
        let mut p = Proc::spawn(name, cmd);
        let status = p.wait_exit(bound);
        let took = started.elapsed();
        let log = p.final_log().join("\n");
        assert!(!status.success(), "{name} succeeded:\n{log}");
        assert!(took < bound, "{name} took {took:?}");
        log
    }

    /// Sends `signal` (e.g. `libc`'s SIGKILL = 9, SIGTERM = 15) through `kill(1)`.
    pub fn signal(&self, signal: i32) {
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "could not signal {}", self.name);
    }

    /// SIGKILL, then reap; returns the exit status (killed by signal 9).
    pub fn kill9(&mut self) -> ExitStatus {
        self.signal(9);
        let st = self.wait_exit(Duration::from_secs(10));
        assert_eq!(
            st.signal(),
            Some(9),
            "{} was not killed by SIGKILL: {st:?}",
            self.name
        );
        st
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A minimal HTTP/1.0 GET on loopback; returns the body.
pub fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

/// Sums the samples of metric `name` whose label set contains every `labels` pair.
pub fn metric_sum(body: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_value(body, name, labels).unwrap_or(0.0)
}

/// Like [`metric_sum`], but `None` when no sample matches, so a metric that was never exported
/// cannot pass for a zero.
pub fn metric_value(body: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let values: Vec<f64> = body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// Polls `check` until it returns `Some`, failing after `timeout`. For waiting on *state*
/// (rows published, a process ready), never as a stand-in for synchronisation.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
