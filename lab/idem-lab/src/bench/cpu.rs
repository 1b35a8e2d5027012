//! CPU time, of the whole machine and of one process, from Linux's `/proc`: what a phase cost
//! in CPU per row, which tells a phase that waits from one that has no core left. On a machine
//! whose cores are all busy, a phase's rate cannot exceed `cores ÷ its CPU time per row`, so a
//! ratio of two phases that both saturate it is bounded by the ratio of their CPU per row.
//!
//! `/proc` counts in `USER_HZ` ticks, 100 a second on every Linux ABI (`sysconf(_SC_CLK_TCK)`).
//! Off Linux (or without `/proc`) every reading is `None` and the CPU figures are left out.

use std::time::Duration;

/// Ticks a second in `/proc/stat` and `/proc/<pid>/stat`.
const USER_HZ: u64 = 100;

/// The machine's busy CPU time so far (every core).
#[derive(Clone, Copy, Debug)]
pub(super) struct MachineCpu {
    busy_ticks: u64,
}

impl MachineCpu {
    /// Now; `None` without `/proc/stat`.
    pub(super) fn now() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let busy_ticks = busy_ticks(stat.lines().next()?)?;
        Some(MachineCpu { busy_ticks })
    }

    /// Busy CPU time of every core since `self`.
    pub(super) fn busy_since(&self) -> Option<Duration> {
        let now = MachineCpu::now()?;
        Some(ticks(now.busy_ticks.saturating_sub(self.busy_ticks)))
    }
}

/// CPU time (user and system) process `pid` has used since it started.
pub(super) fn process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    process_ticks(&stat).map(ticks)
}

/// Microseconds of CPU per row: `cpu` spent on `rows`.
pub(super) fn us_per_row(cpu: Duration, rows: u64) -> f64 {
    cpu.as_secs_f64() * 1e6 / crate::num::float(rows.max(1))
}

/// The rate a machine of `cores` cores could reach at `us_per_row` of CPU per row, all busy.
pub(super) fn bound_per_s(cores: usize, us_per_row: f64) -> f64 {
    match us_per_row > 0.0 {
        true => crate::num::float(cores) * 1e6 / us_per_row,
        false => f64::NAN,
    }
}

/// The machine's cores (as the scheduler gives them to this process).
pub(super) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn ticks(n: u64) -> Duration {
    Duration::from_millis(n.saturating_mul(1000 / USER_HZ))
}

/// `user nice system idle iowait irq softirq steal …` of the `cpu` line: every field but idle
/// and iowait (guest time is already in user).
fn busy_ticks(line: &str) -> Option<u64> {
    let mut fields = line.split_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = fields
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let [user, nice, system, _idle, _iowait, irq, softirq, steal] = v.as_slice() else {
        return None;
    };
    Some(user + nice + system + irq + softirq + steal)
}

/// `utime + stime` of a `/proc/<pid>/stat` text (fields 14 and 15, counted after the command
/// name, which may hold spaces and parentheses).
fn process_ticks(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_line_counts_every_field_but_idle_and_iowait() {
        let line = "cpu  10 1 5 1000 7 2 3 4 9 0";
        assert_eq!(busy_ticks(line), Some(10 + 1 + 5 + 2 + 3 + 4));
        assert_eq!(busy_ticks("cpu0 1 2 3 4 5 6 7 8"), None, "one core's line");
        assert_eq!(busy_ticks("cpu 1 2 3"), None, "too short");
    }

    #[test]
    fn a_process_line_is_read_after_its_command_name() {
        let stat = "42 (idem (cdc) relay) S 1 42 42 0 -1 4194560 500 0 0 0 71 12 0 0 20 0 9 0";
        assert_eq!(process_ticks(stat), Some(83));
        assert_eq!(process_ticks("42 (x) S 1"), None);
    }

    #[test]
    fn spinning_shows_in_this_process_and_in_the_machine() {
        let machine = MachineCpu::now().expect("/proc/stat on Linux");
        let start = process_cpu(std::process::id()).expect("/proc/<pid>/stat");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut x = 0u64;
        let mut used = start;
        while used < start + Duration::from_millis(50) && std::time::Instant::now() < deadline {
            for i in 0..1_000_000u64 {
                x = x.wrapping_mul(31).wrapping_add(i);
            }
            used = process_cpu(std::process::id()).expect("/proc/<pid>/stat");
        }
        std::hint::black_box(x);
        let spun = used - start;
        assert!(
            spun >= Duration::from_millis(50),
            "{spun:?} in 10 s of spinning"
        );
        let busy = machine.busy_since().expect("/proc/stat");
        assert!(
            busy >= spun - Duration::from_millis(20),
            "{busy:?} < {spun:?}"
        );
    }

    #[test]
    fn the_bound_is_cores_over_the_cpu_per_row() {
        assert_eq!(us_per_row(Duration::from_secs(2), 100_000), 20.0);
        assert_eq!(bound_per_s(2, 20.0), 100_000.0);
        assert!(bound_per_s(2, 0.0).is_nan());
    }
}
