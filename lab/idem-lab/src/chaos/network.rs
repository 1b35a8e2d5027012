//! Network faults of a pipeline run (`pipeline/drive.rs` makes the links): every process that
//! takes them reaches PostgreSQL and Kafka through fault proxies of its own
//! ([`idem_netfault`]), so a fault cuts, slows or resets one process's way to one dependency
//! while the others still reach it; a remote (the points API) sits behind one proxy all its
//! callers share. Kafka clients bootstrap on a proxied listener of their own (`scripts/kafka
//! prepare --proxied-listeners`): the brokers advertise that process's proxies, so every
//! connection it makes to any node passes them.
//!
//! Faults come every 1–3 s (seeded), each on one process's way to one dependency: a partition
//! (a blackhole of 1–8 s, one in five of 12–16 s, longer than the clients' session and poll
//! timeouts), a reset of every open connection, a slow link (latency, jitter, and half of the
//! time a bandwidth cap) for 2–10 s, or lost answers (requests pass and answers are held for
//! 1–5 s, then the connections are reset). The dependency turns PostgreSQL, Kafka, the points
//! API and the kind through [`KINDS`], so five faults partition every dependency and 24 bring
//! every kind to every one; the process and the durations are the seed's. Under the run's
//! steady load a partition lands mid-transaction, and lost answers between a produce and its
//! acknowledgement, a `COMMIT` and its confirmation, an award and its response (the windows
//! the tests in `network_faults.rs` and `effects_e2e.rs` hit on purpose).

use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::Context;
use idem_netfault::{Conditions, Proxy};

use super::procs::Rng;

/// What a process reaches through its proxies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dependency {
    Postgres,
    Kafka,
    /// An HTTP remote: the points API, or a pipeline file's `[[remote]]`.
    Remote,
}

impl Dependency {
    fn name(self) -> &'static str {
        match self {
            Dependency::Postgres => "postgres",
            Dependency::Kafka => "kafka",
            Dependency::Remote => "remote",
        }
    }
}

/// One process's way to one dependency.
pub(super) struct Link {
    process: String,
    dependency: Dependency,
    proxies: Vec<Proxy>,
    /// The fault on it ends then (none: healthy).
    heal_at: Option<Instant>,
    /// Its open connections are reset when the fault ends (held answers are lost, not late).
    reset_on_heal: bool,
}

impl Link {
    /// The way of `process` to `dependency`, through `proxies`.
    pub(super) fn new(process: &str, dependency: Dependency, proxies: Vec<Proxy>) -> Link {
        Link {
            process: process.to_owned(),
            dependency,
            proxies,
            heal_at: None,
            reset_on_heal: false,
        }
    }

    fn set(&self, c: Conditions) {
        for p in &self.proxies {
            p.set(c);
        }
    }

    /// Ends its fault: resets its connections first when the fault held answers.
    fn heal(&mut self) {
        if std::mem::take(&mut self.reset_on_heal) {
            for p in &self.proxies {
                p.reset_all();
            }
        }
        self.set(Conditions::healthy());
        self.heal_at = None;
    }
}

/// Every process's links, when the next fault is due and how many came before it.
pub(super) struct Network {
    links: Vec<Link>,
    next: Instant,
    injected: usize,
    /// The kinds the faults turn through.
    kinds: &'static [Kind],
    /// Processes to SIGKILL while partitioned: when, and which.
    kills: Vec<(Instant, String)>,
    /// Processes whose links take no fault until then.
    spared: BTreeMap<String, Instant>,
}

/// The dependencies faults turn through.
const DEPENDENCIES: [Dependency; 3] = [Dependency::Postgres, Dependency::Kafka, Dependency::Remote];

/// What a fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Partition,
    Slow,
    Reset,
    /// A partition, and the process killed inside it (`Network::with_kills`).
    PartitionKill,
    /// Requests pass, answers are held, then the connections are reset: the dependency acted
    /// on requests whose answers are lost (a produce appended and not acknowledged, a `COMMIT`
    /// committed and not confirmed, an award applied and not answered).
    LostAnswers,
}

/// The kinds faults turn through: eight long (coprime with the three dependencies, so every
/// pair comes within 24 faults), a partition every other fault (every dependency partitioned
/// within five).
const KINDS: [Kind; 8] = [
    Kind::Partition,
    Kind::Slow,
    Kind::Partition,
    Kind::Reset,
    Kind::Partition,
    Kind::LostAnswers,
    Kind::Partition,
    Kind::Reset,
];

/// The same with partitions whose process is killed inside them: a process cut from its
/// database mid-transaction, or just after it committed offsets, dies there.
const KINDS_WITH_KILLS: [Kind; 8] = [
    Kind::Partition,
    Kind::Slow,
    Kind::PartitionKill,
    Kind::Reset,
    Kind::Partition,
    Kind::LostAnswers,
    Kind::PartitionKill,
    Kind::Reset,
];

/// The kind of fault `kind` is on a link to `dependency`: a remote's way is shared by every
/// process that calls it, so a partition with a kill is a plain partition there (there is no
/// one process to kill).
fn on(kind: Kind, dependency: Dependency) -> Kind {
    match (kind, dependency) {
        (Kind::PartitionKill, Dependency::Remote) => Kind::Partition,
        (kind, _) => kind,
    }
}

/// The dependency and kind of fault number `n`, given which dependencies have a healthy link
/// (`free`): the turn's dependency, or the next one that has.
fn turn(n: usize, kinds: &[Kind], free: impl Fn(Dependency) -> bool) -> Option<(Dependency, Kind)> {
    let kind = kinds[n % kinds.len()];
    (0..DEPENDENCIES.len())
        .map(|k| DEPENDENCIES[(n + k) % DEPENDENCIES.len()])
        .find(|d| free(*d))
        .map(|d| (d, kind))
}

impl Network {
    /// Faults on `links`, the first one due in three seconds.
    pub(super) fn new(links: Vec<Link>) -> Network {
        Network {
            links,
            next: Instant::now() + Duration::from_secs(3),
            injected: 0,
            kinds: &KINDS,
            kills: vec![],
            spared: BTreeMap::new(),
        }
    }

    /// Injects no fault before `until`.
    pub(super) fn postpone(&mut self, until: Instant) {
        self.next = self.next.max(until);
    }

    /// Heals every link of `process` now and puts no fault on them until `until`.
    pub(super) fn spare(&mut self, process: &str, until: Instant) {
        for l in self.links.iter_mut().filter(|l| l.process == process) {
            l.heal();
        }
        self.kills.retain(|(_, p)| p != process);
        self.spared.insert(process.to_owned(), until);
    }

    /// Every fourth fault (turning with the others) partitions a process and kills it 0.5–2 s
    /// into the partition: [`Network::due_kills`] names it when that time comes.
    pub(super) fn with_kills(mut self) -> Network {
        self.kinds = &KINDS_WITH_KILLS;
        self
    }

    /// The processes whose kill inside a partition is due by `now`.
    pub(super) fn due_kills(&mut self, now: Instant) -> Vec<String> {
        let (due, later) = std::mem::take(&mut self.kills)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.kills = later;
        due.into_iter().map(|(_, p)| p).collect()
    }

    /// Heals the faults that are over and, when one is due, injects the next: counted in
    /// `faults` as `net_<kind>_<dependency>`, written to the timeline by `timeline`.
    pub(super) fn tick(
        &mut self,
        now: Instant,
        rng: &mut Rng,
        faults: &mut BTreeMap<String, u64>,
        timeline: &dyn Fn(&str),
    ) {
        for l in &mut self.links {
            if l.heal_at.is_some_and(|at| now >= at) {
                l.heal();
                timeline(&format!(
                    "net_heal {} of {}",
                    l.dependency.name(),
                    l.process
                ));
            }
        }
        if now < self.next {
            return;
        }
        self.next = now + rng.between(Duration::from_secs(1), Duration::from_secs(3));
        self.spared.retain(|_, until| now < *until);
        let spared = &self.spared;
        let open = |l: &Link| l.heal_at.is_none() && !spared.contains_key(&l.process);
        let healthy = |d: Dependency| self.links.iter().any(|l| l.dependency == d && open(l));
        let Some((dependency, kind)) = turn(self.injected, self.kinds, healthy) else {
            return;
        };
        self.injected += 1;
        let free: Vec<usize> = (0..self.links.len())
            .filter(|&i| self.links[i].dependency == dependency && open(&self.links[i]))
            .collect();
        let l = &mut self.links[free[rng.index(free.len())]];
        let kind = on(kind, dependency);
        let (kind, what) = match kind {
            Kind::Partition => {
                let long = rng.below(5) == 0;
                let d = if long {
                    rng.between(Duration::from_secs(12), Duration::from_secs(16))
                } else {
                    rng.between(Duration::from_secs(1), Duration::from_secs(8))
                };
                l.set(Conditions::blackhole());
                l.heal_at = Some(now + d);
                ("partition", format!("for {:.1} s", d.as_secs_f64()))
            }
            Kind::PartitionKill => {
                let d = rng.between(Duration::from_secs(3), Duration::from_secs(8));
                let kill = rng.between(Duration::from_millis(500), Duration::from_secs(2));
                l.set(Conditions::blackhole());
                l.heal_at = Some(now + d);
                self.kills.push((now + kill, l.process.clone()));
                let (d, kill) = (d.as_secs_f64(), kill.as_secs_f64());
                (
                    "partition_kill",
                    format!("for {d:.1} s, killed after {kill:.1} s"),
                )
            }
            Kind::Reset => {
                for p in &l.proxies {
                    p.reset_all();
                }
                ("reset", "every open connection".to_owned())
            }
            Kind::LostAnswers => {
                let d = rng.between(Duration::from_secs(1), Duration::from_secs(5));
                l.set(Conditions::answers_held());
                l.heal_at = Some(now + d);
                l.reset_on_heal = true;
                (
                    "lost_answers",
                    format!("held {:.1} s, then reset", d.as_secs_f64()),
                )
            }
            Kind::Slow => {
                let c = slow(rng);
                let d = rng.between(Duration::from_secs(2), Duration::from_secs(10));
                l.set(c);
                l.heal_at = Some(now + d);
                ("slow", format!("{c:?} for {:.1} s", d.as_secs_f64()))
            }
        };
        let key = format!("net_{kind}_{}", l.dependency.name());
        *faults.entry(key).or_default() += 1;
        timeline(&format!(
            "net_{kind} {} of {}: {what}",
            l.dependency.name(),
            l.process
        ));
    }

    /// Per remote (a link of process `remote NAME`), the connections its proxy accepted.
    pub(super) fn remote_connections(&self) -> BTreeMap<String, u64> {
        self.links
            .iter()
            .filter(|l| l.dependency == Dependency::Remote)
            .filter_map(|l| {
                let name = l.process.strip_prefix("remote ")?;
                let accepted = l.proxies.iter().map(|p| p.stats().accepted).sum();
                Some((name.to_owned(), accepted))
            })
            .collect()
    }

    /// Ends every fault: the pipeline settles on a healthy network.
    pub(super) fn heal_all(&mut self) {
        self.kills.clear();
        for l in &mut self.links {
            l.heal();
        }
    }
}

/// A slow link: 20–250 ms of latency, up to 100 ms of jitter, half of the time a cap of
/// 64 KiB/s to 1 MiB/s.
fn slow(rng: &mut Rng) -> Conditions {
    Conditions {
        latency: rng.between(Duration::from_millis(20), Duration::from_millis(250)),
        jitter: rng.between(Duration::ZERO, Duration::from_millis(100)),
        bandwidth: (rng.below(2) == 0).then(|| 65_536 + rng.below(983_040)),
        ..Conditions::healthy()
    }
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A proxy to the PostgreSQL server of `url`, and `url` through it.
pub(super) async fn postgres_link(url: &str, seed: u64) -> anyhow::Result<(Proxy, String)> {
    let authority = authority(url)
        .with_context(|| format!("no host:port in the database URL {}", idem_sql::redact(url)))?;
    let with_port = if authority
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        authority.to_owned()
    } else {
        format!("{authority}:5432")
    };
    let upstream = with_port
        .to_socket_addrs()?
        .next()
        .with_context(|| format!("{with_port} does not resolve"))?;
    let proxy = Proxy::start(loopback(), upstream, seed).await?;
    let routed = url.replacen(authority, &proxy.addr().to_string(), 1);
    Ok((proxy, routed))
}

/// The `host[:port]` of a `postgres://user@host:port/db?…` URL.
fn authority(url: &str) -> Option<&str> {
    let rest = url.split_once("://")?.1;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let auth = &rest[..end];
    let host = auth.rsplit_once('@').map_or(auth, |(_, h)| h);
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_authority_of_a_database_url_is_its_host_and_port() {
        let url = "postgres://postgres:pw@127.0.0.1:5433/idem_demo?sslmode=disable";
        assert_eq!(authority(url), Some("127.0.0.1:5433"));
        assert_eq!(authority("postgres://h/db"), Some("h"));
        assert_eq!(authority("postgresql://u@[::1]:6/db"), Some("[::1]:6"));
        assert_eq!(authority("not a url"), None);
    }

    #[test]
    fn five_faults_partition_every_dependency_and_24_bring_every_kind_to_each() {
        let all = |_| true;
        let faults: Vec<_> = (0..24).map(|n| turn(n, &KINDS, all).unwrap()).collect();
        for d in DEPENDENCIES {
            assert!(faults[..5].contains(&(d, Kind::Partition)), "{d:?}");
            for k in [Kind::Partition, Kind::Slow, Kind::Reset, Kind::LostAnswers] {
                assert!(faults.contains(&(d, k)), "{d:?} {k:?}");
            }
        }
    }

    #[test]
    fn a_spared_process_takes_no_network_fault_until_its_time_is_up() {
        let links = ["api-0", "relay-0"]
            .iter()
            .flat_map(|p| DEPENDENCIES.map(|d| Link::new(p, d, vec![])))
            .collect();
        let mut net = Network::new(links).with_kills();
        let start = Instant::now();
        net.spare("api-0", start + Duration::from_secs(60));
        let mut rng = Rng::new(5);
        let mut faults = BTreeMap::new();
        let hit = std::cell::RefCell::new(vec![]);
        let log = |line: &str| hit.borrow_mut().push(line.to_owned());
        let mut tick = |every_3_s: std::ops::Range<u64>| {
            for s in every_3_s {
                let now = start + Duration::from_secs(3 * s);
                net.tick(now, &mut rng, &mut faults, &log);
            }
        };
        tick(0..20);
        let on = |p: &str| {
            let of = format!("of {p}:");
            hit.borrow().iter().filter(|l| l.contains(&of)).count()
        };
        assert!(on("relay-0") > 5, "{:?}", hit.borrow());
        assert_eq!(on("api-0"), 0, "{:?}", hit.borrow());
        tick(20..50);
        assert!(on("api-0") > 0, "{:?}", hit.borrow());
    }

    #[test]
    fn a_remote_is_partitioned_where_a_process_would_be_killed_in_its_partition() {
        assert_eq!(on(Kind::PartitionKill, Dependency::Remote), Kind::Partition);
        for d in [Dependency::Postgres, Dependency::Kafka] {
            assert_eq!(on(Kind::PartitionKill, d), Kind::PartitionKill);
        }
        for k in [Kind::Partition, Kind::Slow, Kind::Reset, Kind::LostAnswers] {
            assert_eq!(on(k, Dependency::Remote), k);
        }
    }

    #[test]
    fn a_dependency_whose_links_are_all_faulted_passes_its_turn_on() {
        let kafka_down = |d| d != Dependency::Kafka;
        assert_eq!(
            turn(1, &KINDS, kafka_down),
            Some((Dependency::Remote, Kind::Slow))
        );
        assert_eq!(turn(0, &KINDS, |_| false), None);
        let with_kills: Vec<_> = (0..4)
            .map(|n| turn(n, &KINDS_WITH_KILLS, |_| true).unwrap().1)
            .collect();
        assert!(with_kills.contains(&Kind::PartitionKill));
    }
}
