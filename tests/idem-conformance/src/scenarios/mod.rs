//! Store scenarios, written once and run against every [`Backend`](crate::backend::Backend):
//! one file per store concern, named after the `stores/idem-sql/src` module it proves.
//!
//! * `writer.rs`: events written in the business transaction, and the outbox table's contract
//!   for writers in any language;
//! * `relay_store.rs`: the relay's view of the outbox ([`OutboxStore`]): claims, fencing,
//!   backoff, parking, the backlog, pruning;
//! * `migrate.rs`: migrations and table names;
//! * `inbox.rs`: the consumer's inbox and dead letters;
//! * `keys.rs`: the server-side Idempotency-Key store;
//! * `intents.rs`: effect intents and their sending mark;
//! * `retention.rs`: pruning of the inbox and of done intents.
//!
//! Each file names its scenarios in one `scenarios!` call. The call re-exports them here
//! (`scenarios::<name>`) and defines the file's stamping macro (`writer_scenarios!`,
//! `relay_store_scenarios!`, …, exported at the crate root), which [`stamp_scenarios!`] turns
//! into one test per scenario. [`conformance_tests!`] calls every file's stamping macro but
//! `retention_scenarios!`, which the retention test binaries call. A `pub async fn` a file leaves
//! out of its list is unreachable, which the build refuses (`unreachable_pub`, `dead_code`).
//!
//! A new scenario is a `pub async fn <name><B: Backend>(b: &B)` in the file of its concern and
//! its name in that file's `scenarios!` list: the PostgreSQL and the SQLite test binaries
//! (`stores/idem-sql/tests/{postgres,sqlite}_conformance.rs`) each gain a test of that name.
//!
//! [`stamp_scenarios!`]: crate::stamp_scenarios
//! [`conformance_tests!`]: crate::conformance_tests

use std::time::Duration;

use idem_core::outbox::{Claim, ClaimOutcome, ClaimRequest};
use idem_core::store::OutboxStore;
use idem_core::{Event, EventId};

/// Names the scenarios of one file: re-exports them as `scenarios::<name>` and defines
/// `<list>!(<backend constructor>)`, exported, which stamps one test per name.
macro_rules! scenarios {
    ($list:ident; $($name:ident),+ $(,)?) => {
        scenarios!(@ [$] $list; $($name),+);
    };
    // `$d` is a `$` for the metavariables of the macro defined here.
    (@ [$d:tt] $list:ident; $($name:ident),+) => {
        pub(super) mod listed {
            pub use super::{$($name),+};
        }

        #[doc = concat!(
            "Stamps one `#[tokio::test]` per scenario of `",
            file!(),
            "`, each on a backend of its own built by the expression given: `",
            stringify!($list),
            "!(Pg::new().await)`."
        )]
        #[macro_export]
        macro_rules! $list {
            ($d make:expr) => {
                $crate::stamp_scenarios!($d make; $($name),+);
            };
        }
    };
}

mod inbox;
mod intents;
mod keys;
mod migrate;
mod relay_store;
mod retention;
mod writer;

pub use inbox::listed::*;
pub use intents::listed::*;
pub use keys::listed::*;
pub use migrate::listed::*;
pub use relay_store::listed::*;
pub use retention::listed::*;
pub use writer::listed::*;

/// Generates one `#[tokio::test]` per store scenario but retention's, for a backend
/// constructor: the store conformance suite of one database.
///
/// ```ignore
/// idem_conformance::conformance_tests!(idem_conformance::backend::Lite::new().await);
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::writer_scenarios!($make);
        $crate::relay_store_scenarios!($make);
        $crate::migrate_scenarios!($make);
        $crate::inbox_scenarios!($make);
        $crate::keys_scenarios!($make);
        $crate::intents_scenarios!($make);
    };
}

/// Generates one `#[tokio::test]` per named scenario of [`scenarios`](crate::scenarios), each on
/// a backend of its own built by the constructor expression. The files' stamping macros call it
/// with their lists.
///
/// ```ignore
/// use idem_conformance::backend::Lite;
/// idem_conformance::stamp_scenarios!(Lite::new().await; migrate_is_idempotent);
/// ```
#[macro_export]
macro_rules! stamp_scenarios {
    ($make:expr; $($name:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let backend = $make;
                $crate::scenarios::$name(&backend).await;
            }
        )+
    };
}

/// An `order.paid` event of the order `agg`, its payload `{"order_id": agg, "n": i}`.
pub fn event(agg: &str, i: usize) -> Event {
    Event::builder("order", agg, "order.paid")
        .payload(&serde_json::json!({ "order_id": agg, "n": i }))
        .build()
        .unwrap()
}

fn req(relay: &str, batch: u32) -> ClaimRequest {
    ClaimRequest {
        relay_id: relay.to_owned(),
        batch_size: batch,
        lease: Duration::from_secs(60),
    }
}

fn ids(c: &Claim) -> Vec<EventId> {
    c.records.iter().map(|r| r.event_id).collect()
}

/// Claims everything claimable and marks it published; returns the event ids in claim order.
pub async fn publish_all<S: OutboxStore>(store: &S) -> Vec<EventId> {
    let mut out = vec![];
    loop {
        let claim = store.claim(&req("publish-all", 1000)).await.unwrap();
        if claim.records.is_empty() {
            return out;
        }
        out.extend(ids(&claim));
        let outcome = ClaimOutcome {
            published: claim.records.iter().map(|r| r.id).collect(),
            failed: vec![],
        };
        store.complete(&claim, &outcome).await.unwrap();
    }
}

const MINUTE: Duration = Duration::from_secs(60);

const SECOND: Duration = Duration::from_secs(1);
