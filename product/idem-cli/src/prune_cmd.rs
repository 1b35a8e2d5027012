//! `idem prune`: retention of the consumer's inbox and of done effect intents, refused inside
//! the redelivery horizon, and of the outbox's per-aggregate counters when asked
//! (docs/operating/retention.md).

use std::time::Duration;

use clap::Args;
use idem_core::retention::{Prunable, RetentionError, RetentionStore, RetentionWindow};

use crate::DbArgs;
use crate::db;

#[derive(Args, Debug)]
pub struct PruneArgs {
    #[command(flatten)]
    db: DbArgs,
    /// How long after processing a copy of an event can still be delivered: the topic's
    /// retention.ms plus its segment.ms, longer if outbox rows can wait parked (e.g. 8d, 192h).
    /// Required with --inbox-older-than and --intents-older-than.
    #[arg(long, value_parser = crate::util::parse_duration)]
    redelivery_horizon: Option<Duration>,
    /// Delete processed inbox rows (every consumer group) processed and last delivered longer
    /// ago than this; refused below the horizon. Dead-lettered rows stay.
    #[arg(long, value_parser = crate::util::parse_duration)]
    inbox_older_than: Option<Duration>,
    /// Delete done effect intents finished longer ago than this; refused below the horizon.
    /// Pending, parked and unknown intents stay.
    #[arg(long, value_parser = crate::util::parse_duration)]
    intents_older_than: Option<Duration>,
    /// Delete the outbox's per-aggregate counters (PostgreSQL) of aggregates with no pending
    /// or parked row. Their next event is numbered 1 again: only where no consumer keeps the
    /// last `idem_aggregate_seq` applied per aggregate (docs/operating/retention.md).
    #[arg(long)]
    outbox_counters: bool,
    /// Rows deleted per statement.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    batch: u32,
}

/// The windows asked for, each checked against the horizon, before anything connects.
fn windows(
    args: &PruneArgs,
) -> Result<(Option<RetentionWindow>, Option<RetentionWindow>), RetentionError> {
    // No horizon given: zero, which a window refuses with a message naming the horizon.
    let horizon = args.redelivery_horizon.unwrap_or(Duration::ZERO);
    let window = |what, w: Option<Duration>| {
        w.map(|w| RetentionWindow::new(what, w, horizon))
            .transpose()
    };
    Ok((
        window(Prunable::Inbox, args.inbox_older_than)?,
        window(Prunable::DoneIntents, args.intents_older_than)?,
    ))
}

/// Runs `prune` until a batch comes back short; returns the total.
async fn drain<F, Fut>(batch: u32, mut prune: F) -> idem_core::Result<u64>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = idem_core::Result<u64>>,
{
    let mut total = 0;
    loop {
        let n = prune().await?;
        total += n;
        if n < u64::from(batch) {
            return Ok(total);
        }
    }
}

pub(crate) async fn run(args: PruneArgs) -> anyhow::Result<()> {
    let (inbox, intents) = windows(&args)?;
    if inbox.is_none() && intents.is_none() && !args.outbox_counters {
        anyhow::bail!(
            "name what to prune: --inbox-older-than, --intents-older-than and/or --outbox-counters"
        );
    }
    let store = db::open(&args.db, 1).await?;
    let batch = args.batch;
    for (what, window) in [(Prunable::Inbox, inbox), (Prunable::DoneIntents, intents)] {
        let Some(w) = window else { continue };
        let n = idem_sql::with_store!(&store, s => {
            let relay = s.relay();
            drain(batch, || relay.prune_older(what, &w, batch)).await
        })?;
        println!("pruned {n} {}", what.describe());
    }
    if args.outbox_counters {
        let n = idem_sql::with_store!(&store, s => {
            let relay = s.relay();
            drain(batch, || relay.prune_aggregate_counters(batch)).await
        })?;
        println!("pruned {n} outbox aggregate counters");
    }
    Ok(())
}
