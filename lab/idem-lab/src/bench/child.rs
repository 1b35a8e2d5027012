//! The system under test as real processes: `idem relay`, `idem-lab settlement`, `idem verify`,
//! started from this same binary, so peak memory is the real process's (`VmHWM`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};

/// A child `idem` process; killed if dropped while running.
pub(super) struct Child {
    name: String,
    child: tokio::process::Child,
    log: PathBuf,
}

impl Child {
    /// Starts `idem ARGS…` with its output in `logs/NAME.log`, its Kafka security from `env`
    /// alone (the `IDEM_KAFKA_…` variables of [`idem_cli::kafka_args::child_env`]; this
    /// process's own are not inherited).
    pub(super) fn spawn(
        name: &str,
        args: &[String],
        env: &[(&'static str, String)],
        logs: &Path,
    ) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("locating the idem binary")?;
        let log = logs.join(format!("{name}.log"));
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let mut command = tokio::process::Command::new(exe);
        for var in idem_cli::kafka_args::env_names() {
            command.env_remove(var);
        }
        let child = command
            .args(args)
            .env("RUST_LOG", "warn")
            .env_remove("IDEM_CRASH_POINTS")
            .envs(env.iter().map(|(k, v)| (*k, v)))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Child {
            name: name.to_owned(),
            child,
            log,
        })
    }

    /// The process id (while it runs).
    pub(super) fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Peak resident memory so far (`VmHWM`), in bytes.
    pub(super) fn peak_rss(&self) -> Option<u64> {
        self.pid().and_then(peak_rss_of)
    }

    /// Fails, with the end of its log, if the process has exited.
    pub(super) fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited early ({status}); its log ends with:\n{}",
                self.name,
                self.log_tail()
            );
        }
        Ok(())
    }

    /// The last lines of its output.
    pub(super) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// SIGTERM, then waits (SIGKILL after 20 s).
    pub(super) async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.pid() {
            let _ = tokio::process::Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status()
                .await;
        }
        match tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await {
            Ok(status) => {
                status?;
            }
            Err(_) => {
                tracing::warn!(name = %self.name, "did not stop within 20 s; killing it");
                self.child.kill().await?;
            }
        }
        Ok(())
    }

    /// Waits for the process to exit, sampling its peak memory every 10 ms until then.
    pub(super) async fn wait_with_peak(
        mut self,
    ) -> anyhow::Result<(std::process::ExitStatus, u64)> {
        let mut peak = 0;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok((status, peak));
            }
            if let Some(p) = self.peak_rss() {
                peak = peak.max(p);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// `VmHWM` of process `pid`, in bytes (Linux).
pub(super) fn peak_rss_of(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vm_hwm(&status)
}

fn parse_vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_vm_hwm() {
        let status = "Name:\tidem\nVmPeak:\t  200 kB\nVmHWM:\t   15360 kB\nVmRSS:\t 100 kB\n";
        assert_eq!(super::parse_vm_hwm(status), Some(15_360 * 1024));
        assert_eq!(super::parse_vm_hwm("Name: x\n"), None);
    }
}
