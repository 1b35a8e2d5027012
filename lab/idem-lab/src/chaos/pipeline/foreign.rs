//! The `[hostile]` section at run time: a foreign writer inserting rounds of hostile rows into
//! the outbox with plain SQL while the faults run (the catalogue is `chaos/hostile.rs`), and
//! where each stored row ended once the pipeline settles.
//!
//! The runner reaches both databases directly, not through a component's fault proxy, and
//! writes a round between two faults of its own loop, never across a PostgreSQL crash it
//! causes: a round's refusals are the contract's, not the network's.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use idem_sql::AnyPool;

use super::file::HostileSection;
use crate::chaos::hostile::{self, Accepted, Shape};
use crate::chaos::procs::Rng;
use crate::chaos::schedule;

/// The foreign writer of one run.
pub(super) struct ForeignWriter {
    outbox: AnyPool,
    consumers: AnyPool,
    shape: Shape,
    round: u64,
    next: Instant,
    accepted: Vec<Accepted>,
    violations: Vec<String>,
}

/// Where the stored rows ended: each row's fate by name and event id, and the rows the
/// contract or the pipeline treated otherwise than it must.
pub(super) struct Outcome {
    pub rows: BTreeMap<String, String>,
    pub violations: Vec<String>,
}

impl ForeignWriter {
    /// Connects to the section's databases (`databases`: URLs by name); the first round is
    /// due 5 s after `start`.
    pub(super) async fn open(
        section: &HostileSection,
        databases: &BTreeMap<String, String>,
        start: Instant,
        denied: bool,
    ) -> anyhow::Result<Self> {
        let connect = |name: &str| {
            let url = databases.get(name).cloned();
            let name = name.to_owned();
            async move {
                let url = url.with_context(|| format!("[hostile] database {name} has no URL"))?;
                let pool = super::postgres::runner_pool(&url, 2)
                    .await
                    .with_context(|| format!("[hostile] connecting to database {name}"))?;
                anyhow::Ok(AnyPool::Postgres(pool))
            }
        };
        Ok(Self {
            outbox: connect(&section.outbox).await?,
            consumers: connect(&section.consumers).await?,
            shape: Shape {
                aggregate_type: section.aggregate_type.clone(),
                event_type: section.event_type.clone(),
                groups: section.groups.clone(),
                business_rule: section.business_rule,
                denied,
            },
            round: 0,
            next: start + Duration::from_secs(5),
            accepted: vec![],
            violations: vec![],
        })
    }

    /// Writes a round when one is due (the next in 20–40 s); the rows written and refused are
    /// counted in `faults` (`hostile_rows`, `hostile_rows_refused`). Returns what to put on
    /// the timeline.
    pub(super) async fn tick(
        &mut self,
        now: Instant,
        rng: &mut Rng,
        faults: &mut BTreeMap<String, u64>,
    ) -> anyhow::Result<Option<String>> {
        if now < self.next {
            return Ok(None);
        }
        self.round += 1;
        let round = hostile::insert_round(&self.outbox, self.round, &self.shape).await?;
        let written = (round.accepted.len() + round.refused) as u64;
        *faults.entry("hostile_rows".to_owned()).or_default() += written;
        *faults.entry("hostile_rows_refused".to_owned()).or_default() += round.refused as u64;
        self.accepted.extend(round.accepted);
        self.violations.extend(round.violations);
        self.next = now + schedule::hostile_interval(rng);
        Ok(Some(format!(
            "hostile_rows round {}: {written} rows, {} refused at insert",
            self.round, round.refused
        )))
    }

    /// How many stored rows are not contained yet.
    pub(super) async fn open_rows(&self) -> anyhow::Result<usize> {
        Ok(self.outcome().await?.violations.len() - self.violations.len())
    }

    /// Where every stored row ended.
    pub(super) async fn outcome(&self) -> anyhow::Result<Outcome> {
        let groups = &self.shape.groups;
        let fates = hostile::fates(&self.outbox, &self.consumers, groups, &self.accepted).await?;
        let (rows, open) = crate::chaos::hostile::hostile_rows(&fates, groups);
        let mut violations = self.violations.clone();
        violations.extend(open);
        Ok(Outcome { rows, violations })
    }
}
