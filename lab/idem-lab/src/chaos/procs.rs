//! The chaos runner's processes: each a component of the pipeline or a Kafka node, a child
//! that can be killed, paused, restarted, and restarted with a crash point armed.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What a process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Role {
    /// A Kafka node of the runner's.
    Broker,
    /// A component or a load of the pipeline file.
    Component,
}

/// Builds the command of incarnation `n`.
pub(super) type Build = Box<dyn Fn(u32) -> Command + Send>;

/// One supervised process.
pub(crate) struct Proc {
    pub role: Role,
    pub name: String,
    build: Build,
    child: Option<Child>,
    pub incarnation: u32,
    pub paused_until: Option<Instant>,
    pub restart_at: Option<Instant>,
    /// Started with a crash point armed: spared other faults until then.
    pub armed_until: Option<Instant>,
    /// The current incarnation was started with a crash point (`IDEM_CRASH_POINTS`), which
    /// may still fire: it ends the incarnation when its hit comes.
    pub crash_point_pending: bool,
    log: PathBuf,
    /// Environment added to every start from now on (a component's `after_failover`).
    pub lasting_env: Vec<(String, String)>,
    /// Asked to stop (SIGTERM): its exit is the runner's doing.
    stopping: bool,
    /// Exits the runner did not cause: no SIGKILL or SIGTERM of its, no crash point's abort
    /// (a process that gives up on its own, as on a database that is down, is a defect).
    pub unexpected_exits: Vec<String>,
}

/// A process of the run never outlives it: whatever ends the run (an error, an interrupt),
/// dropping it SIGKILLs the current incarnation (paused or not).
impl Drop for Proc {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.kill9();
        }
    }
}

impl Proc {
    pub(crate) fn new(role: Role, name: String, dir: &Path, build: Build) -> Self {
        Proc {
            role,
            log: dir.join(format!("{name}.log")),
            name,
            build,
            child: None,
            incarnation: 0,
            paused_until: None,
            restart_at: None,
            armed_until: None,
            crash_point_pending: false,
            lasting_env: Vec::new(),
            stopping: false,
            unexpected_exits: Vec::new(),
        }
    }

    /// Starts a new incarnation, with its [`Proc::lasting_env`] and `env` added (a crash
    /// point to arm).
    pub(crate) fn start(&mut self, env: &[(&str, String)]) -> anyhow::Result<()> {
        self.incarnation += 1;
        let mut cmd = (self.build)(self.incarnation);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let mut header = log.try_clone()?;
        let _ = writeln!(
            header,
            "==== {} incarnation {} {:?}{:?} at {}",
            self.name,
            self.incarnation,
            self.lasting_env,
            env,
            chrono::Utc::now().format("%H:%M:%S%.3f")
        );
        cmd.stdout(log.try_clone()?)
            .stderr(log)
            .stdin(Stdio::null());
        for (k, v) in &self.lasting_env {
            cmd.env(k, v);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let program = cmd.get_program().to_string_lossy().into_owned();
        let child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting {} ({program}): {e}", self.name))?;
        self.child = Some(child);
        self.stopping = false;
        self.paused_until = None;
        self.restart_at = None;
        self.armed_until = None;
        self.crash_point_pending = env.iter().any(|(k, _)| *k == "IDEM_CRASH_POINTS");
        Ok(())
    }

    /// Is a crash point armed in the current incarnation (and still given time to fire)?
    pub(crate) fn armed(&self, now: Instant) -> bool {
        self.armed_until.is_some_and(|t| now < t)
    }

    pub(crate) fn pid(&self) -> Option<i32> {
        self.child.as_ref().and_then(|c| i32::try_from(c.id()).ok())
    }

    /// Sends `sig`. A `kill` that could not run is retried once and then logged: a lost
    /// SIGCONT would leave a process stopped for the rest of the run with no trace.
    pub(crate) fn signal(&self, sig: i32) {
        let Some(pid) = self.pid() else { return };
        let send = || {
            Command::new("kill")
                .arg(format!("-{sig}"))
                .arg(pid.to_string())
                .stderr(Stdio::null())
                .status()
        };
        if let Err(e) = send().or_else(|_| send()) {
            tracing::warn!(error = %e, process = %self.name, sig, "could not send a signal");
        }
    }

    /// Is the current incarnation still running? (Reaps it if not.)
    pub(crate) fn running(&mut self) -> bool {
        match &mut self.child {
            None => false,
            Some(c) => match c.try_wait() {
                Ok(None) => true,
                Ok(Some(status)) => {
                    self.child = None;
                    if !self.stopping && !is_crash_point_abort(status) {
                        let what = format!(
                            "{} incarnation {} {status}: {}",
                            self.name,
                            self.incarnation,
                            last_words(&self.log)
                        );
                        tracing::warn!(exit = %what, "a process exited on its own");
                        self.unexpected_exits.push(what);
                    }
                    false
                }
                Err(_) => {
                    self.child = None;
                    false
                }
            },
        }
    }

    pub(crate) fn kill9(&mut self) {
        self.signal(9);
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
        self.paused_until = None;
    }

    /// Asks the process to stop (SIGTERM, after SIGCONT) and waits up to `timeout`.
    pub(crate) fn stop(&mut self, timeout: Duration) -> bool {
        self.stopping = true;
        self.signal(18);
        self.signal(15);
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if !self.running() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill9();
        false
    }

    /// Lines of this process's log (every incarnation) that report a Rust panic.
    pub(crate) fn panics(&self) -> Vec<String> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines()
            .filter(|l| l.contains("panicked at"))
            .map(|l| format!("{}: {l}", self.name))
            .collect()
    }

    /// What the current incarnation wrote to its log so far.
    pub(crate) fn current_log(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let marker = format!("==== {} incarnation {} ", self.name, self.incarnation);
        text.rfind(&marker)
            .map_or_else(String::new, |at| text[at..].to_owned())
    }
}

/// A crash point ends its process with `std::process::abort` (SIGABRT), and logs it.
fn is_crash_point_abort(status: std::process::ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.signal() == Some(6)
}

/// A small deterministic generator (SplitMix64): the seed fixes the fault schedule.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5851_f42d_4c95_7f2d)
    }

    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Uniform index into `len` items (0 when there are none).
    pub(super) fn index(&mut self, len: usize) -> usize {
        let n = self.below(u64::try_from(len).unwrap_or(u64::MAX));
        usize::try_from(n).unwrap_or(0)
    }

    /// Uniform duration in `lo..hi`.
    pub(super) fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        let span = u64::try_from(hi.saturating_sub(lo).as_millis()).unwrap_or(u64::MAX);
        lo + Duration::from_millis(self.below(span.max(1)))
    }
}

/// The last lines a process wrote to its log (its error, when it gave up), without colour
/// codes and cut short: what an unexpected exit is reported with.
fn last_words(log: &Path) -> String {
    const LINES: usize = 3;
    const MAX: usize = 600;
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(LINES)..].join(" | ");
    let mut plain = String::with_capacity(tail.len());
    let mut chars = tail.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // An ANSI escape: `ESC [ … letter`.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    match plain.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}…", &plain[..cut]),
        None => plain,
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let (mut a, mut b, mut c) = (Rng::new(7), Rng::new(7), Rng::new(8));
        let xs: Vec<u64> = (0..5).map(|_| a.next()).collect();
        let ys: Vec<u64> = (0..5).map(|_| b.next()).collect();
        let zs: Vec<u64> = (0..5).map(|_| c.next()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs, zs);
    }
}
