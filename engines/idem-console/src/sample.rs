//! What the console samples every few seconds (the tables' bounded counts, the groups' lag in
//! Kafka, the services' metrics), the last hour of samples, and the rates between them. Pages
//! read the newest sample: a page view costs the same however large the tables are.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_kafka::inspect::PartitionLag;
use idem_sql::AnyStore;
use idem_sql::ops::{CdcSlot, IntentCounts, LetterGroup, OutboxSummary, TypeBacklog};

use crate::ops;
use crate::scrape::Scraped;

/// Counts stop here: a page says "at least" beyond it.
pub(crate) const CAP: i64 = 100_000;
/// Open dead letters grouped per sample (the newest ones).
pub(crate) const LETTER_CAP: i64 = 10_000;

/// One database's part of a round.
#[derive(Clone, Debug, Default)]
pub(crate) struct DbSample {
    /// The database's name in the console.
    pub(crate) name: String,
    /// The outbox, if it could be read.
    pub(crate) outbox: Option<OutboxSummary>,
    /// Pending and parked rows by aggregate type.
    pub(crate) types: Vec<TypeBacklog>,
    /// Logical replication slots.
    pub(crate) slots: Vec<CdcSlot>,
    /// Effect intents by status.
    pub(crate) intents: Option<IntentCounts>,
    /// Open dead letters by group and reason.
    pub(crate) letters: Vec<LetterGroup>,
    /// Consumer groups with inbox rows.
    pub(crate) groups: Vec<String>,
}

impl DbSample {
    /// Whether anything was ever written to this database's outbox.
    pub(crate) fn has_outbox(&self) -> bool {
        self.outbox.as_ref().is_some_and(|o| o.last_id > 0)
    }

    /// Whether any effect intent was ever recorded here.
    pub(crate) fn has_intents(&self) -> bool {
        self.intents.as_ref().is_some_and(|c| c.last_id > 0)
    }
}

/// One round of reads.
#[derive(Clone, Debug, Default)]
pub(crate) struct Sample {
    /// Unix time, seconds.
    pub(crate) at: f64,
    /// Each database's tables.
    pub(crate) dbs: Vec<DbSample>,
    /// Per group, its partitions' committed offsets and high watermarks (with a broker).
    pub(crate) lag: BTreeMap<String, Vec<PartitionLag>>,
    /// What the services' metrics endpoints said.
    pub(crate) scraped: Scraped,
    /// What could not be read this round, and why.
    pub(crate) errors: Vec<String>,
}

impl Sample {
    /// The consumer groups of every database (a group's inbox is in one), with its database.
    pub(crate) fn groups(&self) -> Vec<(&str, &str)> {
        self.dbs
            .iter()
            .flat_map(|d| d.groups.iter().map(move |g| (d.name.as_str(), g.as_str())))
            .collect()
    }

    /// Open dead letters of `group` (among each database's newest [`LETTER_CAP`]).
    pub(crate) fn open_letters(&self, group: &str) -> i64 {
        self.dbs
            .iter()
            .flat_map(|d| &d.letters)
            .filter(|l| l.consumer_group == group)
            .map(|l| l.letters)
            .sum()
    }

    /// The records `group` has still to read, over its topics, if a broker was asked.
    pub(crate) fn group_lag(&self, group: &str) -> Option<i64> {
        self.lag
            .get(group)
            .map(|ps| ps.iter().map(PartitionLag::lag).sum())
    }

    /// Records `group` committed past, over its partitions.
    fn committed(&self, group: &str) -> Option<i64> {
        self.lag
            .get(group)
            .map(|ps| ps.iter().filter_map(|p| p.committed).sum())
    }

    /// Records in the topics the groups read (their high watermarks, each topic once).
    fn topic_records(&self) -> Option<i64> {
        let mut seen = BTreeMap::new();
        for p in self.lag.values().flatten() {
            seen.insert((p.topic.clone(), p.partition), p.high);
        }
        (!seen.is_empty()).then(|| seen.values().sum())
    }

    fn db(&self, name: &str) -> Option<&DbSample> {
        self.dbs.iter().find(|d| d.name == name)
    }
}

/// The rates between two samples, per second.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Rates {
    /// Rows written to each database's outbox.
    pub(crate) written: BTreeMap<String, f64>,
    /// Rows the relay drained from each database's outbox (written less the backlog's growth).
    pub(crate) relayed: BTreeMap<String, f64>,
    /// Records appended to the topics the groups read.
    pub(crate) appended: Option<f64>,
    /// Records each group committed past (its consumer's rate).
    pub(crate) consumed: BTreeMap<String, f64>,
    /// Effect intents settled in each database (recorded less the growth of the unsettled).
    pub(crate) settled: BTreeMap<String, f64>,
}

/// The sum of a rate over databases or groups, if any has one.
pub(crate) fn total(m: &BTreeMap<String, f64>) -> Option<f64> {
    (!m.is_empty()).then(|| m.values().sum())
}

/// The rates from `a` to the later `b`. A rate whose counts hit [`CAP`] in either sample, or
/// whose counter went backwards (a table truncated, a group reset), is unknown.
pub(crate) fn rates(a: &Sample, b: &Sample) -> Rates {
    let dt = b.at - a.at;
    let mut r = Rates::default();
    if dt <= 0.0 {
        return r;
    }
    let per_s = |x: i64| (x >= 0).then(|| lossy(x) / dt);
    for yd in &b.dbs {
        let Some(xd) = a.db(&yd.name) else { continue };
        let name = || yd.name.clone();
        if let (Some(x), Some(y)) = (&xd.outbox, &yd.outbox) {
            let written = y.last_id - x.last_id;
            let uncapped = [x.pending, x.parked, y.pending, y.parked]
                .iter()
                .all(|n| *n < CAP);
            let grew = (y.pending + y.parked) - (x.pending + x.parked);
            if let Some(v) = per_s(written) {
                r.written.insert(name(), v);
            }
            if let (true, Some(v)) = (uncapped, per_s(written - grew)) {
                r.relayed.insert(name(), v);
            }
        }
        if let (Some(x), Some(y)) = (&xd.intents, &yd.intents) {
            let open = |c: &IntentCounts| c.pending + c.parked + c.unknown;
            let settled = (y.last_id - x.last_id) - (open(y) - open(x));
            if let (true, Some(v)) = (open(x) < CAP && open(y) < CAP, per_s(settled)) {
                r.settled.insert(name(), v);
            }
        }
    }
    if let (Some(x), Some(y)) = (a.topic_records(), b.topic_records()) {
        r.appended = per_s(y - x);
    }
    for (_, group) in b.groups() {
        if let (Some(x), Some(y)) = (a.committed(group), b.committed(group))
            && let Some(rate) = per_s(y - x)
        {
            r.consumed.insert(group.to_owned(), rate);
        }
    }
    r
}

/// A count as a float for a rate: exact below 2^53, which a row count or an offset delta
/// between two samples never reaches.
#[allow(clippy::cast_precision_loss)]
fn lossy(x: i64) -> f64 {
    x as f64
}

/// The samples of the last hour, oldest first.
#[derive(Debug)]
pub(crate) struct History {
    samples: VecDeque<Sample>,
    span: f64,
}

impl History {
    /// Keeps `span` of samples.
    pub(crate) fn new(span: Duration) -> Self {
        History {
            samples: VecDeque::new(),
            span: span.as_secs_f64(),
        }
    }

    /// Adds the newest sample and forgets those older than the span.
    pub(crate) fn push(&mut self, s: Sample) {
        let horizon = s.at - self.span;
        self.samples.push_back(s);
        while self.samples.front().is_some_and(|f| f.at < horizon) {
            self.samples.pop_front();
        }
    }

    /// The newest sample.
    pub(crate) fn latest(&self) -> Option<&Sample> {
        self.samples.back()
    }

    /// The span kept, in seconds.
    pub(crate) fn span(&self) -> f64 {
        self.span
    }

    /// The rates between the last two samples.
    pub(crate) fn current(&self) -> Rates {
        let n = self.samples.len();
        if n < 2 {
            return Rates::default();
        }
        rates(&self.samples[n - 2], &self.samples[n - 1])
    }

    /// One rate over the span: (seconds before the newest sample, value), oldest first.
    pub(crate) fn series(&self, pick: impl Fn(&Rates) -> Option<f64>) -> Vec<(f64, f64)> {
        let Some(last) = self.latest() else {
            return vec![];
        };
        self.samples
            .iter()
            .zip(self.samples.iter().skip(1))
            .filter_map(|(a, b)| pick(&rates(a, b)).map(|v| (last.at - b.at, v)))
            .collect()
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Reads one database's tables: each view on its own, so that one failing leaves the others
/// (each failure is added to `errors`).
pub(crate) async fn tables(name: &str, store: &AnyStore, errors: &mut Vec<String>) -> DbSample {
    let outbox = ops!(store, o => o.outbox_summary(CAP).await);
    let types = ops!(store, o => o.outbox_types(CAP).await);
    let slots = ops!(store, o => o.cdc_slots().await);
    let intents = ops!(store, o => o.intent_counts(CAP).await);
    let letters = ops!(store, o => o.letter_groups(LETTER_CAP).await);
    let groups = ops!(store, o => o.consumer_groups().await);
    let mut keep = |what: &str, e: idem_core::Error| errors.push(format!("{name}, {what}: {e}"));
    DbSample {
        name: name.to_owned(),
        outbox: outbox.map_err(|e| keep("the outbox", e)).ok(),
        types: types
            .map_err(|e| keep("the outbox by type", e))
            .unwrap_or_default(),
        slots: slots
            .map_err(|e| keep("the replication slots", e))
            .unwrap_or_default(),
        intents: intents.map_err(|e| keep("the effect intents", e)).ok(),
        letters: letters
            .map_err(|e| keep("the dead letters", e))
            .unwrap_or_default(),
        groups: groups
            .map_err(|e| keep("the consumer groups", e))
            .unwrap_or_default(),
    }
}

/// One full round: the tables, the groups' lag in Kafka (with a broker), the metrics
/// endpoints.
pub(crate) async fn take(state: &crate::Shared) -> Sample {
    let mut s = Sample {
        at: now(),
        ..Sample::default()
    };
    for db in &state.databases {
        let part = tables(&db.name, &db.store, &mut s.errors).await;
        s.dbs.push(part);
    }
    if let Some(conn) = &state.config.kafka {
        let groups = s.groups().iter().map(|(_, g)| (*g).to_owned()).collect();
        let topics = state.config.topics.clone();
        match kafka_lag(conn.client_config(), topics, groups).await {
            Ok(lag) => s.lag = lag,
            Err(e) => s
                .errors
                .push(format!("the consumer groups' offsets in Kafka: {e}")),
        }
    }
    s.scraped = crate::scrape::all(&state.config.metrics_urls).await;
    s
}

/// How long the broker may take to answer one round.
const KAFKA_TIMEOUT: Duration = Duration::from_secs(5);

/// Each group's committed offsets and the high watermarks of `topics` (every topic when
/// empty), off the async runtime (the client blocks).
async fn kafka_lag(
    conn: idem_kafka::ClientConfig,
    topics: Vec<String>,
    groups: Vec<String>,
) -> Result<BTreeMap<String, Vec<PartitionLag>>, String> {
    let read = move || -> idem_core::Result<BTreeMap<String, Vec<PartitionLag>>> {
        let topics = if topics.is_empty() {
            idem_kafka::inspect::topics_with(&conn, 50, KAFKA_TIMEOUT)?
        } else {
            topics
        };
        let mut out = BTreeMap::new();
        for g in groups {
            let lag = idem_kafka::inspect::group_lag_with(&conn, &g, &topics, KAFKA_TIMEOUT)?;
            out.insert(g, lag);
        }
        Ok(out)
    };
    match tokio::task::spawn_blocking(read).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: f64, last_id: i64, pending: i64, committed: i64) -> Sample {
        let db = DbSample {
            name: "orders".into(),
            outbox: Some(OutboxSummary {
                pending,
                last_id,
                ..OutboxSummary::default()
            }),
            groups: vec!["settlement".into()],
            ..DbSample::default()
        };
        let mut s = Sample {
            at,
            dbs: vec![db],
            ..Sample::default()
        };
        s.lag.insert(
            "settlement".into(),
            vec![PartitionLag {
                topic: "t".into(),
                partition: 0,
                committed: Some(committed),
                high: committed + 5,
            }],
        );
        s
    }

    #[test]
    fn rates_come_from_the_growth_of_ids_backlogs_and_offsets() {
        let r = rates(&sample(0.0, 100, 10, 50), &sample(10.0, 300, 30, 150));
        assert_eq!(r.written.get("orders"), Some(&20.0));
        assert_eq!(
            r.relayed.get("orders"),
            Some(&18.0),
            "written less the backlog's growth"
        );
        assert_eq!(r.appended, Some(10.0));
        assert_eq!(r.consumed.get("settlement"), Some(&10.0));
    }

    #[test]
    fn a_capped_count_or_a_counter_going_back_gives_no_rate() {
        let r = rates(&sample(0.0, 100, CAP, 50), &sample(10.0, 300, CAP, 40));
        assert_eq!(r.written.get("orders"), Some(&20.0));
        assert_eq!(r.relayed.get("orders"), None);
        assert_eq!(r.consumed.get("settlement"), None, "a reset group");
        assert_eq!(
            rates(&sample(5.0, 1, 0, 0), &sample(5.0, 2, 0, 0)),
            Rates::default()
        );
    }

    #[test]
    fn the_history_keeps_its_span_and_draws_each_rate() {
        let mut h = History::new(Duration::from_secs(60));
        for i in 0..10 {
            h.push(sample(f64::from(i) * 10.0, i64::from(i) * 100, 0, 0));
        }
        assert_eq!(h.latest().map(|s| s.at), Some(90.0));
        let written = h.series(|r| total(&r.written));
        assert_eq!(written.len(), 6, "{written:?}");
        assert_eq!(written.last(), Some(&(0.0, 10.0)));
        assert_eq!(written.first(), Some(&(50.0, 10.0)));
    }
}
