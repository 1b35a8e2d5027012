//! Loopback ports chosen now for processes that bind them later.
//!
//! A port is taken from outside the kernel's ephemeral range: a port the kernel hands out for
//! port 0 is also what it hands the run's outgoing connections as their local ports, so one of
//! them could take it before the process binds it. A port free now is not yet bound by its
//! process either, so one run's choices are kept in one book: a port handed out once, or
//! reserved by another chooser (a prepared Kafka cluster's client, controller and proxy ports,
//! `scripts/kafka prepare`'s `DIR/ports`), is never handed out again.
//!
//! A server that clients reconnect to while it is down needs such a port most: a client's
//! connect to a free port of the ephemeral range can be given that same port as its own local
//! port, and then talks to itself (a TCP self-connect), reading its own bytes back as the
//! server's answer.
//!
//! Other processes choose ports of the same range at the same time (the test runner runs tests
//! side by side, each choosing ports for its servers), so a choice is also written down for the
//! machine: [`lease`]. A port whose lease a live process holds is never chosen, though nothing
//! listens on it, until that process ends.

use std::collections::BTreeSet;
use std::io;
use std::net::TcpListener;
use std::ops::RangeInclusive;

pub mod lease;

/// The ports one run has chosen or been told are taken.
#[derive(Debug)]
pub struct Ports {
    range: RangeInclusive<u16>,
    taken: BTreeSet<u16>,
    start: u32,
}

impl Default for Ports {
    fn default() -> Self {
        Self::new()
    }
}

impl Ports {
    /// A book over the ports outside the ephemeral range (`outside_ephemeral`), starting its
    /// search at a place that differs between runs.
    pub fn new() -> Self {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|r| {
                let mut bounds = r.split_whitespace().map(str::parse::<u16>);
                Some((bounds.next()?.ok()?, bounds.next()?.ok()?))
            })
            .unwrap_or((32_768, 60_999));
        let start = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
            ^ std::process::id();
        Self::over(outside_ephemeral(range), start)
    }

    fn over(range: RangeInclusive<u16>, start: u32) -> Self {
        Self {
            range,
            taken: BTreeSet::new(),
            start,
        }
    }

    /// Marks `ports` as taken by someone else.
    pub fn reserve(&mut self, ports: impl IntoIterator<Item = u16>) {
        self.taken.extend(ports);
    }

    /// A port nothing listens on now, that this book has not handed out or been told of and
    /// whose [`lease`] no live process (this one included) holds; this process takes its lease.
    pub fn pick(&mut self) -> io::Result<u16> {
        let me = lease::Owner::this_process()?;
        let leases = lease::Leases::machine()?;
        let chosen = self.pick_with(|port| {
            Ok(TcpListener::bind(("127.0.0.1", port)).is_ok() && leases.take(port, &me)?)
        })?;
        match chosen {
            Some(port) => Ok(port),
            None => Err(io::Error::other(format!(
                "found no free loopback port in {}-{} (the run holds {} of them)",
                self.range.start(),
                self.range.end(),
                self.taken.len()
            ))),
        }
    }

    /// The first port, in a stride through the range from the book's start, that is neither
    /// taken nor refused by `is_free`; it is then taken.
    fn pick_with(
        &mut self,
        mut is_free: impl FnMut(u16) -> io::Result<bool>,
    ) -> io::Result<Option<u16>> {
        let first = u32::from(*self.range.start());
        let span = u32::from(*self.range.end()) - first + 1;
        // 7 919 is prime: unless the span is a multiple of it, the stride visits every port
        // of the range once before it repeats.
        let stride = if span % 7_919 == 0 { 1 } else { 7_919 };
        for i in 0..span {
            let offset = self.start.wrapping_add(i.wrapping_mul(stride)) % span;
            let Ok(port) = u16::try_from(first + offset) else {
                continue;
            };
            if !self.taken.contains(&port) && is_free(port)? {
                self.taken.insert(port);
                self.start = self.start.wrapping_add((i + 1).wrapping_mul(stride));
                return Ok(Some(port));
            }
        }
        Ok(None)
    }
}

/// The ports to choose from, given the kernel's ephemeral range `(low, high)`: from 10 000 up
/// to it when at least 1 000 ports lie there (Linux's default range leaves 22 768); else those
/// above it; else, on a machine whose ephemeral range spans nearly every port, all from 10 000
/// (none is safe from the kernel's choices there).
fn outside_ephemeral((low, high): (u16, u16)) -> RangeInclusive<u16> {
    const ROOM: u16 = 1_000;
    if low >= 10_000 + ROOM {
        10_000..=low - 1
    } else if high <= u16::MAX - ROOM {
        high + 1..=u16::MAX
    } else {
        10_000..=u16::MAX
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pick_if(ports: &mut Ports, is_free: impl Fn(u16) -> bool) -> Option<u16> {
        ports.pick_with(|port| Ok(is_free(port))).unwrap()
    }

    #[test]
    fn the_ports_lie_outside_the_ephemeral_range_when_there_is_room() {
        assert_eq!(outside_ephemeral((32_768, 60_999)), 10_000..=32_767);
        assert_eq!(outside_ephemeral((1_024, 50_000)), 50_001..=65_535);
        assert_eq!(outside_ephemeral((1_024, 65_000)), 10_000..=65_535);
    }

    #[test]
    fn a_port_handed_out_is_not_handed_out_again_though_nothing_binds_it() {
        let mut ports = Ports::over(20_000..=20_002, 0);
        let picked: BTreeSet<_> = (0..3)
            .filter_map(|_| pick_if(&mut ports, |_| true))
            .collect();
        assert_eq!(picked, BTreeSet::from([20_000, 20_001, 20_002]));
        assert_eq!(pick_if(&mut ports, |_| true), None);
    }

    #[test]
    fn reserved_and_bound_ports_are_skipped() {
        let mut ports = Ports::over(20_000..=20_009, 3);
        ports.reserve((20_000..=20_009).filter(|p| *p != 20_004 && *p != 20_007));
        assert_eq!(pick_if(&mut ports, |p| p != 20_004), Some(20_007));
        assert_eq!(pick_if(&mut ports, |_| true), Some(20_004));
        assert_eq!(pick_if(&mut ports, |_| true), None);
    }

    #[test]
    fn a_port_another_live_process_leased_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let leases = lease::Leases::at(dir.path().to_path_buf()).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        let other = lease::Owner::of(child.id()).unwrap().unwrap();
        let me = lease::Owner::this_process().unwrap();
        assert!(leases.take(20_000, &other).unwrap());
        let mut ports = Ports::over(20_000..=20_001, 0);
        let picked = ports.pick_with(|port| leases.take(port, &me)).unwrap();
        assert_eq!(picked, Some(20_001));
        assert_eq!(leases.holder(20_001).unwrap(), Some(me));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn the_stride_visits_every_port_of_a_wide_range() {
        let mut ports = Ports::over(10_000..=32_767, 12_345);
        let n = usize::from(32_767u16 - 10_000 + 1);
        let picked: BTreeSet<_> = (0..n)
            .filter_map(|_| pick_if(&mut ports, |_| true))
            .collect();
        assert_eq!(picked.len(), n);
    }
}
