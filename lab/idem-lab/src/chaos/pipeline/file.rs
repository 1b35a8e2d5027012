//! The pipeline file (`idem-lab chaos --pipeline pipeline.toml`): the databases, Kafka, the
//! components as command lines, the load, and the verify config — everything the runner needs
//! to put a pipeline it did not write under faults. Reading and checking it, and filling in a
//! command line's placeholders, are pure.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use idem_core::crash::CrashPoint;
use serde::Deserialize;

/// A pipeline file, read.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct PipelineFile {
    /// Databases by name: `{db.NAME}` in a command line is its URL as the component reaches
    /// it (a PostgreSQL server through the component's fault proxy when it takes network
    /// faults; an SQLite file as it is).
    #[serde(default)]
    pub databases: BTreeMap<String, Database>,
    /// The runner's PostgreSQL server (the `start = true` databases' server).
    #[serde(default)]
    pub postgres: PostgresSection,
    /// The Kafka cluster.
    pub kafka: KafkaSection,
    /// The components: the processes under faults that stay up until the pipeline settles.
    #[serde(rename = "component")]
    pub components: Vec<Component>,
    /// The load: processes that write the pipeline's input, stopped when the faults stop.
    #[serde(default, rename = "load")]
    pub loads: Vec<Component>,
    /// Remotes the components reach over TCP (an HTTP API their effects call), each behind a
    /// fault proxy of the runner's.
    #[serde(default, rename = "remote")]
    pub remotes: Vec<Remote>,
    /// Rows a foreign writer inserts into the outbox with plain SQL during the run.
    #[serde(default)]
    pub hostile: Option<HostileSection>,
    /// Tables locked for a while during the run.
    #[serde(default, rename = "lock")]
    pub locks: Vec<Lock>,
    /// Events written into an outbox in one transaction before the components start.
    #[serde(default)]
    pub burst: Option<BurstSection>,
    /// What proves the run.
    pub verify: VerifySection,
}

/// A database of the pipeline: a URL (a server that runs already, or an SQLite file), or one
/// on a PostgreSQL server the runner starts and crashes.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub(crate) enum Database {
    /// `postgres://…` or `sqlite://…`: left alone (never crashed).
    Url(String),
    /// `{ start = true, setup = [...] }`: created on the runner's own server.
    Started(Started),
}

/// A database on the runner's own PostgreSQL server: `start = true`, and the command that
/// creates its tables (`{db.NAME}` and `{dir}` filled in), run once before the components.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct Started {
    pub start: bool,
    #[serde(default)]
    pub setup: Vec<String>,
}

/// The runner's PostgreSQL server: crashed at 40 % and 70 % of the run, or, with `failover`,
/// failed over to a synchronous standby at 40 % and crashed at 70 %.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct PostgresSection {
    /// A synchronous streaming standby the server fails over to once (the primary stopped as
    /// a crash would, the standby promoted in its place, on its port): no commit is lost,
    /// and logical replication slots are: a PostgreSQL 15 or 16 standby has none.
    #[serde(default)]
    pub failover: bool,
}

/// What a component does after a failover of the runner's server: its replicas are
/// restarted with `env` added, to that start and every later one (an operator's answer to the
/// failover, such as a CDC relay's `--create-slot` for the slot the standby lacks). Its values
/// are taken as written, as a window's are: no placeholders.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct AfterFailover {
    pub env: BTreeMap<String, String>,
}

/// The Kafka cluster: one the runner starts (`nodes`), which it may kill and put behind fault
/// proxies, or one that runs already (`bootstrap`), which it leaves alone.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct KafkaSection {
    /// Nodes the runner starts (`scripts/kafka prepare`): 1 or 3.
    #[serde(default)]
    pub nodes: Option<usize>,
    /// A cluster that runs already.
    #[serde(default)]
    pub bootstrap: Option<String>,
    /// Topics created before the components start.
    #[serde(default)]
    pub topics: Vec<String>,
    /// Their partitions.
    #[serde(default = "default_partitions")]
    pub partitions: i32,
    /// Every 5–10 s, copies of three recent records of each topic produced again (a
    /// redelivery at-least-once permits): every consumer must absorb them.
    #[serde(default = "yes")]
    pub redeliver: bool,
    /// How the runner's node takes clients: in plain text (the default), or `sasl_ssl`.
    #[serde(default)]
    pub security: Option<KafkaSecurity>,
}

/// A secured node of the runner's: `sasl_ssl`, SASL over TLS with a PKI and users made for
/// the run; clients log in with SCRAM-SHA-512 and trust the run's CA (`{kafka.user}`,
/// `{kafka.password_file}`, `{kafka.mechanism}`, `{tls.ca}`).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(crate) enum KafkaSecurity {
    SaslSsl,
}

/// The placeholders a secured node defines: the SCRAM user, the file holding its password,
/// its mechanism, and the run's CA with a certificate and key it signed for `127.0.0.1` (a
/// component that serves TLS, such as an HTTPS API, presents them).
pub(crate) const SECURED_PLACEHOLDERS: [&str; 6] = [
    "kafka.user",
    "kafka.password_file",
    "kafka.mechanism",
    "tls.ca",
    "tls.cert",
    "tls.key",
];

fn yes() -> bool {
    true
}

fn default_partitions() -> i32 {
    4
}

/// One component: a command line run as `replicas` processes.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct Component {
    /// Its name (its processes are `NAME-0`, `NAME-1`, …, with logs of those names).
    pub name: String,
    /// The program and its arguments, with placeholders: `{db.NAME}`, `{kafka}`, `{replica}`
    /// (0-based), `{incarnation}` (1 for the first start, then one more per restart),
    /// `{port}` (a free loopback port of the replica's, the same for every incarnation),
    /// `{dir}` (the run's directory).
    pub command: Vec<String>,
    /// Its environment, with the same placeholders.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// How many processes run it.
    #[serde(default = "one")]
    pub replicas: usize,
    /// When a replica is ready at start (none: once it is spawned).
    #[serde(default)]
    pub ready: Option<Ready>,
    /// The faults it may receive.
    #[serde(default = "all_faults")]
    pub faults: Vec<Fault>,
    /// The named crash points its program has (idem's, built with the `failpoints` feature):
    /// the runner restarts a replica with one armed (`IDEM_CRASH_POINTS`), which aborts the
    /// process at that point; every listed point is armed until it has fired once.
    #[serde(default, deserialize_with = "crash_points")]
    pub crash_points: Vec<CrashPoint>,
    /// Whiles in which its replicas run with more environment.
    #[serde(default, rename = "window")]
    pub windows: Vec<Window>,
    /// How its replicas are restarted after a failover of the runner's server.
    #[serde(default)]
    pub after_failover: Option<AfterFailover>,
}

/// A while in which a component's replicas run with more environment — a dependency made slow
/// by a knob of its own, a smaller limit: they are restarted with `env` added when its period
/// opens, take no other fault and no network fault while it is open, and are restarted without
/// it when it closes. Counted as `window_<name>`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct Window {
    /// Its name (letters, digits, `-`, `_`).
    pub name: String,
    /// The environment added, as written (no placeholders).
    pub env: BTreeMap<String, String>,
    /// When it opens and for how long.
    pub period: PeriodSection,
}

/// A table of a database locked for a while (`LOCK TABLE … IN ACCESS EXCLUSIVE MODE`, as a
/// migration or an operator's maintenance takes it): every statement on it waits, or fails at
/// its own `lock_timeout`. Counted as `lock_<name>`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct Lock {
    /// Its name (letters, digits, `-`, `_`).
    pub name: String,
    /// The database (a `[databases]` name; PostgreSQL).
    pub database: String,
    /// The table (`name` or `schema.name`, plain identifiers).
    pub table: String,
    /// Lock the table's rows (`SELECT … FOR UPDATE`) instead of the table: inserts go on,
    /// while an update or a delete of a row waits (a relay marking the rows it published).
    #[serde(default)]
    pub rows: bool,
    /// At its release, end the sessions waiting on it (`pg_terminate_backend`), as an
    /// operator ending blocked sessions does: what they had in flight fails with them.
    /// Counted as `lock_<name>_waiters_ended`.
    #[serde(default)]
    pub end_waiters: bool,
    /// When it is taken and for how long.
    pub period: PeriodSection,
}

/// Events written into an outbox with plain SQL in one transaction just before the
/// components start, with no `ANALYZE` after them: the relays' first claims run on
/// statistics that say the table is small. Each event is of an aggregate of its own and of
/// `aggregate_type`, whose topic no consumer should read: the burst loads the relays and
/// nothing downstream. The run fails when the burst is not published by the end of the
/// faults, or drains slower than 200 rows/s (a claim whose plan depends on fresh statistics
/// crawls through it).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct BurstSection {
    /// The database (a `[databases]` name; PostgreSQL) whose `idem_outbox` they go into.
    pub outbox: String,
    /// Their aggregate type (their topic, with the relays' prefix; its event type is
    /// `<aggregate_type>.written`).
    pub aggregate_type: String,
    /// How many (at least 1 000; default: 250 per second of the run, at most 20 000).
    #[serde(default)]
    pub rows: Option<u32>,
}

/// A recurring while: at `first` after the faults start, then every `every`, for `lasts`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct PeriodSection {
    /// When the first opens, after the faults start (`8s`).
    #[serde(deserialize_with = "duration")]
    pub first: std::time::Duration,
    /// How long after one opens the next does.
    #[serde(deserialize_with = "duration")]
    pub every: std::time::Duration,
    /// How long one lasts (shorter than `every`).
    #[serde(deserialize_with = "duration")]
    pub lasts: std::time::Duration,
    /// While it is open, no other fault anywhere: it is the one condition under test (every
    /// link healed; the signals, crash points, broker faults, PostgreSQL crashes,
    /// redeliveries, hostile rounds and other windows and locks wait). It opens once the run is
    /// calm. Default: the other faults go on around it.
    #[serde(default)]
    pub quiet: bool,
}

impl PeriodSection {
    /// Does it last at all, and less than its period?
    fn fits(&self) -> bool {
        !self.lasts.is_zero() && self.lasts < self.every
    }
}

/// A duration written as `500ms`, `15s`, `2m`.
fn duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<std::time::Duration, D::Error> {
    let text = String::deserialize(d)?;
    idem_cli::util::parse_duration(&text).map_err(serde::de::Error::custom)
}

/// Crash points by their names (`relay.after_publish_before_mark`).
fn crash_points<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<CrashPoint>, D::Error> {
    let names = Vec::<String>::deserialize(d)?;
    names
        .iter()
        .map(|n| n.parse().map_err(serde::de::Error::custom))
        .collect()
}

fn one() -> usize {
    1
}

fn all_faults() -> Vec<Fault> {
    vec![Fault::Kill, Fault::Pause, Fault::Restart, Fault::Network]
}

/// How to tell that a replica is ready, with the command line's placeholders.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub(crate) enum Ready {
    /// A line of its log (standard output or error) contains this.
    Log(String),
    /// This `host:port` accepts TCP connections.
    Tcp(String),
    /// This `http://` URL answers 2xx.
    Http(String),
}

/// A fault a component may receive.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Fault {
    /// SIGKILL, restarted after 0.2–1.5 s.
    Kill,
    /// SIGSTOP for 1–4 s, then SIGCONT.
    Pause,
    /// SIGTERM, then a restart once it exits.
    Restart,
    /// Partitions, resets and slow links between it and its databases and Kafka.
    Network,
}

/// A remote reached over TCP through one fault proxy the runner puts in front of it:
/// `{remote.NAME}` is the proxy's `host:port`, and every process that uses it shares the way
/// the network faults cut, slow and reset.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct Remote {
    /// Its name.
    pub name: String,
    /// Its `host:port`; `{port.NAME}` names a component's (a remote the pipeline runs itself).
    pub address: String,
}

/// Rows a foreign writer inserts into the outbox with plain SQL, a round every 20–40 s from 5 s
/// into the run: values the contract must refuse at insert, and values it stores that the
/// pipeline must contain — parked by a relay with its reason, or dead-lettered or handled by
/// every one of `groups` — while the other events flow. A row still pending, or published and
/// open in a group, when the pipeline settles fails the run.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct HostileSection {
    /// The database (a `[databases]` name; PostgreSQL) whose `idem_outbox` they go into.
    pub outbox: String,
    /// The database (a `[databases]` name; PostgreSQL) where `groups` keep their
    /// `idem_inbox` and `idem_dead_letters`.
    pub consumers: String,
    /// The consumer groups that read the rows' topic.
    pub groups: Vec<String>,
    /// The aggregate type of the rows (their topic, with the relays' prefix).
    pub aggregate_type: String,
    /// The event type of the well-formed rows: one the consumers handle.
    pub event_type: String,
    /// The consumers' database refuses payments named `refused-by-rule-…` (`idem-lab setup
    /// --business-rule`): one more row, well formed, that every group must dead-letter.
    #[serde(default)]
    pub business_rule: bool,
}

/// The verify config: the same file `idem verify --config` reads.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct VerifySection {
    /// Its path, relative to the pipeline file.
    pub config: PathBuf,
}

/// A pipeline file that cannot run, and why.
#[derive(Debug, thiserror::Error, PartialEq)]
pub(crate) enum FileError {
    #[error("the pipeline file is not valid TOML for a pipeline: {0}")]
    Toml(String),
    #[error("[kafka] needs exactly one of `nodes` (a cluster the runner starts) and `bootstrap`")]
    KafkaSource,
    #[error("[kafka] nodes = {0}: the runner starts 1 or 3 nodes")]
    Nodes(usize),
    #[error("[kafka] nodes = 3 needs `topics`: leader kills choose a partition of the first")]
    NoTopicToKillLeadersOf,
    #[error("the pipeline has no [[component]]")]
    NoComponent,
    #[error("two components or loads are named `{0}`: every name must be unique")]
    DuplicateName(String),
    #[error("`{0}` is not a name for a component: use letters, digits, `-` and `_`")]
    BadName(String),
    #[error("`{0}` has an empty command")]
    EmptyCommand(String),
    #[error("`{0}` has replicas = 0")]
    NoReplica(String),
    #[error("`{name}` names `{placeholder}`, which the file does not define")]
    Unknown { name: String, placeholder: String },
    #[error("`{name}` has an unclosed `{{` in `{text}`")]
    Unclosed { name: String, text: String },
    #[error(
        "database `{0}` has start = false: give its URL instead, or start = true for a \
         PostgreSQL server the runner starts and crashes"
    )]
    StartFalse(String),
    #[error(
        "`{0}` is not a name for a database the runner creates: use letters, digits, `-` and `_`"
    )]
    BadDatabaseName(String),
    #[error("[hostile] {0} = \"{1}\" names no PostgreSQL database of [databases]")]
    HostileDatabase(&'static str, String),
    #[error("[hostile] groups is empty: name the consumer groups that read the rows' topic")]
    HostileGroups,
    #[error("[hostile] {0} = \"{1}\": use letters, digits, `.`, `-` and `_`")]
    HostileValue(&'static str, String),
    #[error(
        "window `{window}` of `{component}` lasts as long as its `every` or longer, or not at all"
    )]
    WindowLength { component: String, window: String },
    #[error("lock `{0}` lasts as long as its `every` or longer, or not at all")]
    LockLength(String),
    #[error("lock `{0}` names a database that is not a PostgreSQL one of [databases]")]
    LockDatabase(String),
    #[error("lock `{0}`: its table is not `name` or `schema.name` of letters, digits and `_`")]
    LockTable(String),
    #[error("[burst] outbox = \"{0}\" names no PostgreSQL database of [databases]")]
    BurstDatabase(String),
    #[error("[burst] aggregate_type = \"{0}\": use letters, digits, `.`, `-` and `_`")]
    BurstValue(String),
    #[error(
        "[burst] rows = {0}: a burst of fewer than 1000 rows drains too fast to time; write \
         more, or leave `rows` out for the default"
    )]
    BurstRows(u32),
    #[error(
        "[postgres] failover = true needs a database with start = true: the runner fails over its own server only"
    )]
    FailoverWithoutServer,
    #[error("`{0}` has after_failover, but [postgres] has no failover = true")]
    AfterNoFailover(String),
    #[error("[kafka] security needs nodes = 1: the runner secures a node of its own, one only")]
    SecurityNodes,
}

impl PipelineFile {
    /// Reads and checks a pipeline file.
    pub(crate) fn parse(text: &str) -> Result<PipelineFile, FileError> {
        let file: PipelineFile =
            toml::from_str(text).map_err(|e| FileError::Toml(e.to_string()))?;
        file.check()?;
        Ok(file)
    }

    fn check(&self) -> Result<(), FileError> {
        match (self.kafka.nodes, &self.kafka.bootstrap) {
            (Some(3), None) if self.kafka.topics.is_empty() => {
                return Err(FileError::NoTopicToKillLeadersOf);
            }
            (Some(n), None) if n == 1 || n == 3 => {}
            (Some(n), None) => return Err(FileError::Nodes(n)),
            (None, Some(_)) => {}
            _ => return Err(FileError::KafkaSource),
        }
        if self.kafka.security.is_some() && self.kafka.nodes != Some(1) {
            return Err(FileError::SecurityNodes);
        }
        if self.components.is_empty() {
            return Err(FileError::NoComponent);
        }
        if self.postgres.failover && self.started().next().is_none() {
            return Err(FileError::FailoverWithoutServer);
        }
        let probe = Places::probe(self);
        for (name, started) in self.started() {
            if !started.start {
                return Err(FileError::StartFalse(name.to_owned()));
            }
            if !valid_name(name) {
                return Err(FileError::BadDatabaseName(name.to_owned()));
            }
            for text in &started.setup {
                expand(text, &probe).map_err(|e| e.of(&format!("databases.{name}.setup")))?;
            }
        }
        let mut names = std::collections::BTreeSet::new();
        for c in self.components.iter().chain(&self.loads) {
            if !valid_name(&c.name) {
                return Err(FileError::BadName(c.name.clone()));
            }
            if !names.insert(c.name.as_str()) {
                return Err(FileError::DuplicateName(c.name.clone()));
            }
            if c.command.is_empty() {
                return Err(FileError::EmptyCommand(c.name.clone()));
            }
            if c.replicas == 0 {
                return Err(FileError::NoReplica(c.name.clone()));
            }
            if c.after_failover.is_some() && !self.postgres.failover {
                return Err(FileError::AfterNoFailover(c.name.clone()));
            }
            for text in c.texts() {
                expand(text, &probe).map_err(|e| e.of(&c.name))?;
            }
            for w in &c.windows {
                if !valid_name(&w.name) {
                    return Err(FileError::BadName(w.name.clone()));
                }
                if !w.period.fits() {
                    return Err(FileError::WindowLength {
                        component: c.name.clone(),
                        window: w.name.clone(),
                    });
                }
            }
        }
        let mut remotes = std::collections::BTreeSet::new();
        for r in &self.remotes {
            if !valid_name(&r.name) {
                return Err(FileError::BadName(r.name.clone()));
            }
            if !remotes.insert(r.name.as_str()) {
                return Err(FileError::DuplicateName(r.name.clone()));
            }
            let at = format!("remote.{}", r.name);
            expand(&r.address, &probe).map_err(|e| e.of(&at))?;
        }
        if let Some(h) = &self.hostile {
            self.check_hostile(h)?;
        }
        for l in &self.locks {
            self.check_lock(l)?;
        }
        if let Some(b) = &self.burst {
            self.check_burst(b)?;
        }
        Ok(())
    }

    fn check_burst(&self, b: &BurstSection) -> Result<(), FileError> {
        if !self.is_postgres(&b.outbox) {
            return Err(FileError::BurstDatabase(b.outbox.clone()));
        }
        if !plain_value(&b.aggregate_type) {
            return Err(FileError::BurstValue(b.aggregate_type.clone()));
        }
        if let Some(rows) = b.rows.filter(|r| *r < crate::chaos::burst::MIN_ROWS) {
            return Err(FileError::BurstRows(rows));
        }
        Ok(())
    }

    fn check_lock(&self, l: &Lock) -> Result<(), FileError> {
        if !valid_name(&l.name) {
            return Err(FileError::BadName(l.name.clone()));
        }
        if !l.period.fits() {
            return Err(FileError::LockLength(l.name.clone()));
        }
        if !self.is_postgres(&l.database) {
            return Err(FileError::LockDatabase(l.name.clone()));
        }
        let identifier = |part: &str| {
            part.chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && part.len() <= 63
        };
        let parts: Vec<&str> = l.table.split('.').collect();
        if parts.len() > 2 || !parts.iter().all(|p| identifier(p)) {
            return Err(FileError::LockTable(l.name.clone()));
        }
        Ok(())
    }

    /// Is database `name` a PostgreSQL one: started by the runner, or given by a
    /// `postgres…` URL?
    fn is_postgres(&self, name: &str) -> bool {
        match self.databases.get(name) {
            Some(Database::Started(_)) => true,
            Some(Database::Url(url)) => url.starts_with("postgres"),
            None => false,
        }
    }

    fn check_hostile(&self, h: &HostileSection) -> Result<(), FileError> {
        for (key, name) in [("outbox", &h.outbox), ("consumers", &h.consumers)] {
            if !self.is_postgres(name) {
                return Err(FileError::HostileDatabase(key, name.clone()));
            }
        }
        if h.groups.is_empty() {
            return Err(FileError::HostileGroups);
        }
        let values = [
            ("aggregate_type", &h.aggregate_type),
            ("event_type", &h.event_type),
        ];
        let groups = h.groups.iter().map(|g| ("groups", g));
        for (key, value) in values.into_iter().chain(groups) {
            if !plain_value(value) {
                return Err(FileError::HostileValue(key, value.clone()));
            }
        }
        Ok(())
    }

    /// The databases on the runner's own PostgreSQL server, by name.
    pub(crate) fn started(&self) -> impl Iterator<Item = (&str, &Started)> {
        self.databases.iter().filter_map(|(name, db)| match db {
            Database::Started(s) => Some((name.as_str(), s)),
            Database::Url(_) => None,
        })
    }

    /// Every database's URL: the file's, or `started`'s for those the runner created.
    pub(crate) fn urls(&self, started: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        self.databases
            .iter()
            .filter_map(|(name, db)| match db {
                Database::Url(url) => Some((name.clone(), url.clone())),
                Database::Started(_) => started.get(name).map(|u| (name.clone(), u.clone())),
            })
            .collect()
    }

    /// The verify config's path, relative to the pipeline file at `file`.
    pub(crate) fn verify_path(&self, file: &Path) -> PathBuf {
        file.parent()
            .unwrap_or(Path::new("."))
            .join(&self.verify.config)
    }
}

impl Component {
    /// Every text with placeholders: the command, the environment's values, the readiness.
    fn texts(&self) -> impl Iterator<Item = &str> {
        let ready = self.ready.as_ref().map(|r| match r {
            Ready::Log(s) | Ready::Tcp(s) | Ready::Http(s) => s.as_str(),
        });
        self.command
            .iter()
            .map(String::as_str)
            .chain(self.env.values().map(String::as_str))
            .chain(ready)
    }

    /// Does it use database `name` or Kafka?
    pub(crate) fn uses(&self, placeholder: &str) -> bool {
        let needle = format!("{{{placeholder}}}");
        self.texts().any(|t| t.contains(&needle))
    }
}

/// A value written into a row or a topic name: letters, digits, `.`, `-` and `_`, not empty.
fn plain_value(value: &str) -> bool {
    let plain = |ch: char| ch.is_ascii_alphanumeric() || matches!(ch, '.' | '-' | '_');
    !value.is_empty() && value.chars().all(plain)
}

/// A name of letters, digits, `-` and `_`.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || ch == '-' || ch == '_')
}

/// `config` (a verify config) with each `{db.NAME}` of `urls` (the databases' URLs by name,
/// as the runner reaches them: never through a fault proxy) replaced by its URL in every
/// string value; nothing else changes. The values are replaced, not the text: a URL holding
/// a quote or a backslash (a password may) stays one string.
pub(crate) fn with_database_urls(config: &mut toml::Value, urls: &BTreeMap<String, String>) {
    match config {
        toml::Value::String(s) => {
            for (name, url) in urls {
                *s = s.replace(&format!("{{db.{name}}}"), url);
            }
        }
        toml::Value::Array(a) => a.iter_mut().for_each(|v| with_database_urls(v, urls)),
        toml::Value::Table(t) => t.iter_mut().for_each(|(_, v)| with_database_urls(v, urls)),
        _ => {}
    }
}

/// What the placeholders of one process stand for.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Places {
    pub databases: BTreeMap<String, String>,
    /// `{port.NAME}`: the `{port}` of replica 0 of component or load `NAME`.
    pub ports: BTreeMap<String, u16>,
    /// `{remote.NAME}`: the `host:port` of remote `NAME`'s fault proxy.
    pub remotes: BTreeMap<String, String>,
    /// `{kafka.user}`, `{tls.ca}`, … of a secured node ([`SECURED_PLACEHOLDERS`]).
    pub secured: BTreeMap<String, String>,
    pub kafka: String,
    pub replica: usize,
    pub incarnation: u32,
    pub port: u16,
    pub dir: String,
}

impl Places {
    /// Values for checking a file: every name it defines, placeholders' values made up.
    fn probe(file: &PipelineFile) -> Places {
        Places {
            databases: file
                .databases
                .keys()
                .map(|k| (k.clone(), String::new()))
                .collect(),
            ports: file
                .components
                .iter()
                .chain(&file.loads)
                .map(|c| (c.name.clone(), 0))
                .collect(),
            remotes: file
                .remotes
                .iter()
                .map(|r| (r.name.clone(), String::new()))
                .collect(),
            secured: match file.kafka.security {
                Some(_) => SECURED_PLACEHOLDERS
                    .iter()
                    .map(|k| ((*k).to_owned(), String::new()))
                    .collect(),
                None => BTreeMap::new(),
            },
            ..Places::default()
        }
    }
}

/// A placeholder the text names and the places do not define, or an unclosed brace.
#[derive(Debug, PartialEq)]
pub(crate) enum Unfilled {
    Unknown(String),
    Unclosed(String),
}

impl Unfilled {
    fn of(self, name: &str) -> FileError {
        match self {
            Unfilled::Unknown(placeholder) => FileError::Unknown {
                name: name.to_owned(),
                placeholder,
            },
            Unfilled::Unclosed(text) => FileError::Unclosed {
                name: name.to_owned(),
                text,
            },
        }
    }
}

/// `text` with its placeholders filled in; `{{` and `}}` stand for a brace.
pub(crate) fn expand(text: &str, p: &Places) -> Result<String, Unfilled> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(['{', '}']) {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            out.push_str(&tail[..1]);
            rest = &tail[2..];
            continue;
        }
        if let Some(after) = tail.strip_prefix('}') {
            out.push('}');
            rest = after;
            continue;
        }
        let Some(end) = tail.find('}') else {
            return Err(Unfilled::Unclosed(text.to_owned()));
        };
        let name = &tail[1..end];
        let value = match name {
            "kafka" => p.kafka.clone(),
            "replica" => p.replica.to_string(),
            "incarnation" => p.incarnation.to_string(),
            "port" => p.port.to_string(),
            "dir" => p.dir.clone(),
            _ => lookup(name, p).ok_or_else(|| Unfilled::Unknown(format!("{{{name}}}")))?,
        };
        out.push_str(&value);
        rest = &tail[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The value of a named placeholder: `db.NAME`, `port.NAME`, `remote.NAME`, or one of a
/// secured node's.
fn lookup(name: &str, p: &Places) -> Option<String> {
    if let Some(value) = p.secured.get(name) {
        return Some(value.clone());
    }
    if let Some(db) = name.strip_prefix("db.") {
        return p.databases.get(db).cloned();
    }
    if let Some(c) = name.strip_prefix("port.") {
        return p.ports.get(c).map(u16::to_string);
    }
    let r = name.strip_prefix("remote.")?;
    p.remotes.get(r).cloned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const FILE: &str = r#"
        [databases]
        orders = "postgres://u@127.0.0.1:5432/orders"

        [kafka]
        nodes = 1
        topics = ["shop.order"]

        [[component]]
        name = "relay"
        command = ["idem", "relay", "--db", "{db.orders}", "--brokers", "{kafka}"]
        replicas = 2
        ready = { log = "relay started" }
        crash_points = ["relay.after_publish_before_mark"]

        [[component]]
        name = "consumer"
        command = ["python3", "consumer.py", "--port", "{port}"]
        env = { MEMBER = "consumer-{replica}" }
        faults = ["kill", "network"]

        [[load]]
        name = "writer"
        command = ["writer", "--db", "{db.orders}", "--prefix", "w{replica}-{incarnation}-"]

        [[remote]]
        name = "bank"
        address = "127.0.0.1:{port.consumer}"

        [verify]
        config = "verify.toml"
    "#;

    #[test]
    fn a_pipeline_file_reads_with_its_defaults() {
        let f = PipelineFile::parse(FILE).unwrap();
        assert_eq!(f.kafka.nodes, Some(1));
        assert_eq!(f.kafka.partitions, 4);
        assert!(f.kafka.redeliver);
        assert_eq!(f.components.len(), 2);
        assert_eq!(f.components[0].replicas, 2);
        assert_eq!(f.components[0].faults, all_faults());
        assert_eq!(f.components[1].faults, vec![Fault::Kill, Fault::Network]);
        assert_eq!(
            f.components[0].crash_points,
            vec![CrashPoint::RelayAfterPublishBeforeMark]
        );
        assert_eq!(f.components[1].crash_points, vec![]);
        assert_eq!(
            f.components[0].ready,
            Some(Ready::Log("relay started".into()))
        );
        assert_eq!(f.loads[0].name, "writer");
        assert_eq!(f.remotes[0].address, "127.0.0.1:{port.consumer}");
        assert!(f.components[0].uses("db.orders") && f.components[0].uses("kafka"));
        assert!(!f.components[1].uses("db.orders"));
        assert_eq!(
            f.verify_path(Path::new("/p/pipeline.toml")),
            Path::new("/p/verify.toml")
        );
    }

    #[test]
    fn placeholders_are_filled_and_braces_escaped() {
        let p = Places {
            databases: [("orders".to_owned(), "postgres://o".to_owned())].into(),
            ports: [("api".to_owned(), 4100)].into(),
            remotes: [("bank".to_owned(), "127.0.0.1:4200".to_owned())].into(),
            secured: BTreeMap::new(),
            kafka: "127.0.0.1:1,127.0.0.1:2".to_owned(),
            replica: 1,
            incarnation: 3,
            port: 4000,
            dir: "/run".to_owned(),
        };
        assert_eq!(
            expand(
                "{db.orders}|{kafka}|w{replica}-{incarnation}|{port}|{dir}",
                &p
            )
            .unwrap(),
            "postgres://o|127.0.0.1:1,127.0.0.1:2|w1-3|4000|/run"
        );
        assert_eq!(
            expand("http://127.0.0.1:{port.api}/awards", &p).unwrap(),
            "http://127.0.0.1:4100/awards"
        );
        assert_eq!(
            expand("{port.nope}", &p),
            Err(Unfilled::Unknown("{port.nope}".into()))
        );
        assert_eq!(
            expand("http://{remote.bank}/pay", &p).unwrap(),
            "http://127.0.0.1:4200/pay"
        );
        assert_eq!(
            expand("{remote.api}", &p),
            Err(Unfilled::Unknown("{remote.api}".into()))
        );
        assert_eq!(expand(r#"{{"a": 1}}"#, &p).unwrap(), r#"{"a": 1}"#);
        assert_eq!(
            expand("{db.settle}", &p),
            Err(Unfilled::Unknown("{db.settle}".into()))
        );
        assert_eq!(
            expand("x{port", &p),
            Err(Unfilled::Unclosed("x{port".into()))
        );
    }

    #[test]
    fn a_database_is_a_url_or_one_the_runner_starts() {
        let f = PipelineFile::parse(&FILE.replacen(
            r#"orders = "postgres://u@127.0.0.1:5432/orders""#,
            r#"orders = { start = true, setup = ["setup", "--db", "{db.orders}"] }
               ledger = "sqlite://ledger.db""#,
            1,
        ))
        .unwrap();
        let started: Vec<&str> = f.started().map(|(n, _)| n).collect();
        assert_eq!(started, ["orders"]);
        let urls = f.urls(&[("orders".to_owned(), "postgres://h:1/orders".to_owned())].into());
        assert_eq!(urls["orders"], "postgres://h:1/orders");
        assert_eq!(urls["ledger"], "sqlite://ledger.db");
        let mut config: toml::Value = toml::from_str(
            r#"db = "{db.orders}"
x = { y = ["{db.ledger}"] }"#,
        )
        .unwrap();
        with_database_urls(&mut config, &urls);
        let expected: toml::Value = toml::from_str(
            r#"db = "postgres://h:1/orders"
x = { y = ["sqlite://ledger.db"] }"#,
        )
        .unwrap();
        assert_eq!(config, expected);
        let quoted = [("orders".to_owned(), r#"postgres://u:p"w\d@h/o"#.to_owned())].into();
        let mut config: toml::Value = toml::from_str(r#"db = "{db.orders}""#).unwrap();
        with_database_urls(&mut config, &quoted);
        assert_eq!(config["db"].as_str(), Some(r#"postgres://u:p"w\d@h/o"#));
    }

    #[test]
    fn a_window_adds_environment_for_a_while_shorter_than_its_period() {
        let window = "[[component.window]]\nname = \"slow\"\nenv = { DELAY = \"10s\" }\n\
                      period = { first = \"8s\", every = \"40s\", lasts = \"15s\" }\n\n[[load]]";
        let with = |from: &str, to: &str| {
            PipelineFile::parse(&FILE.replacen("[[load]]", &window.replacen(from, to, 1), 1))
        };
        let f = with("", "").unwrap();
        let w = &f.components[1].windows[0];
        assert_eq!(f.components[1].name, "consumer");
        assert_eq!(
            (w.period.first, w.period.lasts, w.period.quiet),
            (Duration::from_secs(8), Duration::from_secs(15), false)
        );
        assert_eq!(w.env["DELAY"], "10s");
        assert_eq!(
            with("lasts = \"15s\"", "lasts = \"40s\""),
            Err(FileError::WindowLength {
                component: "consumer".into(),
                window: "slow".into()
            })
        );
        assert!(matches!(
            with("every = \"40s\"", "every = \"soon\""),
            Err(FileError::Toml(_))
        ));
    }

    #[test]
    fn a_lock_names_a_postgresql_table_and_holds_it_shorter_than_its_period() {
        let lock = "[[lock]]\nname = \"ledger\"\ndatabase = \"orders\"\n\
                    table = \"public.ledger_entries\"\n\
                    period = { first = \"12s\", every = \"30s\", lasts = \"5s\", quiet = true }\n\n[verify]";
        let with = |from: &str, to: &str| {
            PipelineFile::parse(&FILE.replacen("[verify]", &lock.replacen(from, to, 1), 1))
        };
        let f = with("", "").unwrap();
        assert_eq!(f.locks[0].period.lasts, Duration::from_secs(5));
        assert!(f.locks[0].period.quiet);
        assert!(
            !f.locks[0].rows && !f.locks[0].end_waiters,
            "the table, no one ended"
        );
        let rows = with("period =", "rows = true\nend_waiters = true\nperiod =").unwrap();
        assert!(rows.locks[0].rows && rows.locks[0].end_waiters);
        let refused = [
            ("\"public.ledger_entries\"", "\"ledger; DROP TABLE x\""),
            ("\"public.ledger_entries\"", "\"a.b.c\""),
            ("\"public.ledger_entries\"", "\"1table\""),
        ];
        for (from, to) in refused {
            assert_eq!(
                with(from, to),
                Err(FileError::LockTable("ledger".into())),
                "{to}"
            );
        }
        assert_eq!(
            with("database = \"orders\"", "database = \"nope\""),
            Err(FileError::LockDatabase("ledger".into()))
        );
        assert_eq!(
            with("lasts = \"5s\"", "lasts = \"30s\""),
            Err(FileError::LockLength("ledger".into()))
        );
    }

    #[test]
    fn a_burst_names_a_postgresql_outbox_a_plain_aggregate_type_and_some_rows() {
        let burst = "[burst]\noutbox = \"orders\"\naggregate_type = \"burst\"\n\n[verify]";
        let with = |from: &str, to: &str| {
            PipelineFile::parse(&FILE.replacen("[verify]", &burst.replacen(from, to, 1), 1))
        };
        let f = with("", "").unwrap();
        let b = f.burst.unwrap();
        assert_eq!(
            (b.outbox.as_str(), b.aggregate_type.as_str()),
            ("orders", "burst")
        );
        assert_eq!(b.rows, None, "the default: by the run's length");
        let sized = with("[verify]", "rows = 1500\n\n[verify]").unwrap();
        assert_eq!(sized.burst.unwrap().rows, Some(1500));
        assert_eq!(
            with("[verify]", "rows = 999\n\n[verify]"),
            Err(FileError::BurstRows(999))
        );
        assert_eq!(
            with("\"orders\"", "\"nope\""),
            Err(FileError::BurstDatabase("nope".into()))
        );
        assert_eq!(
            with("\"burst\"", "\"b'; --\""),
            Err(FileError::BurstValue("b'; --".into()))
        );
    }

    #[test]
    fn a_hostile_section_names_postgresql_databases_groups_and_plain_values() {
        let section = "[hostile]\noutbox = \"orders\"\nconsumers = \"orders\"\n\
                       groups = [\"settlement\"]\naggregate_type = \"order\"\n\
                       event_type = \"order.paid\"\n\n[verify]";
        let with = |from: &str, to: &str| {
            PipelineFile::parse(&FILE.replacen("[verify]", &section.replacen(from, to, 1), 1))
        };
        let h = with("", "").unwrap().hostile.unwrap();
        assert_eq!((h.groups.len(), h.business_rule), (1, false));
        assert_eq!(
            with("consumers = \"orders\"", "consumers = \"ledger\""),
            Err(FileError::HostileDatabase("consumers", "ledger".into()))
        );
        assert_eq!(
            with("[\"settlement\"]", "[]"),
            Err(FileError::HostileGroups)
        );
        assert_eq!(
            with("\"order.paid\"", "\"order'paid\""),
            Err(FileError::HostileValue("event_type", "order'paid".into()))
        );
        assert_eq!(
            with("[\"settlement\"]", "[\"a b\"]"),
            Err(FileError::HostileValue("groups", "a b".into()))
        );
        let sqlite = FILE.replacen(
            r#"orders = "postgres://u@127.0.0.1:5432/orders""#,
            r#"orders = "sqlite://orders.db""#,
            1,
        );
        assert_eq!(
            PipelineFile::parse(&sqlite.replacen("[verify]", section, 1)),
            Err(FileError::HostileDatabase("outbox", "orders".into()))
        );
    }

    #[test]
    fn a_file_that_cannot_run_is_refused_with_the_reason() {
        let refused = |from: &str, to: &str| PipelineFile::parse(&FILE.replacen(from, to, 1));
        assert_eq!(refused("nodes = 1", "nodes = 2"), Err(FileError::Nodes(2)));
        assert_eq!(
            PipelineFile::parse(&FILE.replacen("nodes = 1", "nodes = 3", 1).replacen(
                "topics = [\"shop.order\"]",
                "",
                1
            )),
            Err(FileError::NoTopicToKillLeadersOf)
        );
        assert_eq!(
            refused("nodes = 1", "nodes = 1\nbootstrap = \"h:9092\""),
            Err(FileError::KafkaSource)
        );
        assert_eq!(
            refused("name = \"consumer\"", "name = \"relay\""),
            Err(FileError::DuplicateName("relay".into()))
        );
        assert_eq!(
            refused("name = \"consumer\"", "name = \"a b\""),
            Err(FileError::BadName("a b".into()))
        );
        assert_eq!(
            refused("replicas = 2", "replicas = 0"),
            Err(FileError::NoReplica("relay".into()))
        );
        assert_eq!(
            refused("{db.orders}", "{db.order}"),
            Err(FileError::Unknown {
                name: "relay".into(),
                placeholder: "{db.order}".into()
            })
        );
        assert!(matches!(
            refused("faults = [\"kill\", \"network\"]", "faults = [\"explode\"]"),
            Err(FileError::Toml(_))
        ));
        assert!(matches!(
            refused("[verify]", "[verify]\nextra = 1"),
            Err(FileError::Toml(_))
        ));
        assert_eq!(
            refused("{port.consumer}", "{port.bank}"),
            Err(FileError::Unknown {
                name: "remote.bank".into(),
                placeholder: "{port.bank}".into()
            })
        );
        let twice = "[[remote]]\nname = \"bank\"\naddress = \"h:1\"\n\n[verify]";
        assert_eq!(
            refused("[verify]", twice),
            Err(FileError::DuplicateName("bank".into()))
        );
        let Err(FileError::Toml(why)) = refused("after_publish_before_mark", "after_publish")
        else {
            panic!("an unknown crash point was accepted");
        };
        assert!(
            why.contains("relay.after_publish") && why.contains("relay.after_publish_before_mark"),
            "the refusal names the point and the valid ones: {why}"
        );
        let orders = r#"orders = "postgres://u@127.0.0.1:5432/orders""#;
        assert_eq!(
            refused(orders, "orders = { start = false }"),
            Err(FileError::StartFalse("orders".into()))
        );
        assert_eq!(
            refused(orders, "\"or ders\" = { start = true }"),
            Err(FileError::BadDatabaseName("or ders".into()))
        );
        assert_eq!(
            refused(
                orders,
                r#"orders = { start = true, setup = ["s", "{db.nope}"] }"#
            ),
            Err(FileError::Unknown {
                name: "databases.orders.setup".into(),
                placeholder: "{db.nope}".into()
            })
        );
    }

    #[test]
    fn a_failover_needs_the_runners_server_and_after_failover_needs_a_failover() {
        let after = "crash_points = [\"relay.after_publish_before_mark\"]\n\
                     after_failover = { env = { IDEM_CREATE_SLOT = \"true\" } }";
        let with = |from: &str, to: &str| PipelineFile::parse(&FILE.replacen(from, to, 1));
        assert_eq!(
            with("[kafka]", "[postgres]\nfailover = true\n\n[kafka]"),
            Err(FileError::FailoverWithoutServer)
        );
        let after_file = FILE.replacen(
            "crash_points = [\"relay.after_publish_before_mark\"]",
            after,
            1,
        );
        assert_eq!(
            PipelineFile::parse(&after_file),
            Err(FileError::AfterNoFailover("relay".into()))
        );
        let started = after_file
            .replacen(
                r#"orders = "postgres://u@127.0.0.1:5432/orders""#,
                "orders = { start = true }",
                1,
            )
            .replacen("[kafka]", "[postgres]\nfailover = true\n\n[kafka]", 1);
        let f = PipelineFile::parse(&started).unwrap();
        assert!(f.postgres.failover);
        let env = &f.components[0].after_failover.as_ref().unwrap().env;
        assert_eq!(env["IDEM_CREATE_SLOT"], "true");
    }

    #[test]
    fn the_secured_placeholders_exist_only_on_a_secured_single_node() {
        let secured_env = "env = { MEMBER = \"consumer-{replica}\", USER = \"{kafka.user}\", \
                           PASSWORD_FILE = \"{kafka.password_file}\", CA = \"{tls.ca}\" }";
        let text = FILE.replacen("env = { MEMBER = \"consumer-{replica}\" }", secured_env, 1);
        assert_eq!(
            PipelineFile::parse(&text),
            Err(FileError::Unknown {
                name: "consumer".into(),
                placeholder: "{tls.ca}".into()
            })
        );
        let secured = text.replacen(
            "nodes = 1\n",
            "nodes = 1\n        security = \"sasl_ssl\"\n",
            1,
        );
        let f = PipelineFile::parse(&secured).unwrap();
        assert_eq!(f.kafka.security, Some(KafkaSecurity::SaslSsl));
        let places = Places {
            secured: [("kafka.user".to_owned(), "idem_scram".to_owned())].into(),
            ..Places::default()
        };
        assert_eq!(
            expand("u={kafka.user}", &places),
            Ok("u=idem_scram".to_owned())
        );
        assert_eq!(
            PipelineFile::parse(&secured.replacen("nodes = 1\n", "nodes = 3\n", 1)),
            Err(FileError::SecurityNodes)
        );
        let Err(FileError::Toml(why)) =
            PipelineFile::parse(&secured.replacen("\"sasl_ssl\"", "\"ssl\"", 1))
        else {
            panic!("an unknown security was accepted");
        };
        assert!(why.contains("sasl_ssl"), "{why}");
    }
}
