//! `idem dead-letters`: a consumer group's dead letters with their reasons. (The lab binary
//! `idem-lab` adds `dead-letters replay`, which re-applies them through the reference handlers.)

use anyhow::Context;
use clap::Args;
use idem_core::store::InboxStore;

use crate::DbArgs;
use crate::db;

/// `idem dead-letters`: [`DbArgs`] spelled out with `--db` optional, so that `idem-lab
/// dead-letters replay` (a subcommand the lab adds) parses without it.
#[derive(Args, Debug)]
pub struct DeadLettersArgs {
    /// Database URL: postgres://… or sqlite://path.
    #[arg(long, env = "IDEM_DB")]
    db: Option<String>,
    /// PostgreSQL schema of idem's tables (default: the search path).
    #[arg(long, env = "IDEM_SCHEMA")]
    schema: Option<String>,
    /// Prefix of idem's table names.
    #[arg(long, env = "IDEM_TABLE_PREFIX", default_value = "idem_")]
    table_prefix: String,
    /// Consumer group.
    #[arg(long)]
    group: String,
    /// At most this many.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Why reading the dead letters failed, when it does.
pub const MIGRATE_HINT: &str =
    "reading the dead letters (a database below idem's schema version 9 needs `idem migrate`)";

/// Lists the group's dead letters (JSON with `--json`).
pub async fn run(args: DeadLettersArgs) -> anyhow::Result<()> {
    let Some(url) = args.db.clone() else {
        anyhow::bail!("idem dead-letters needs --db URL (or IDEM_DB)");
    };
    let dbargs = DbArgs {
        db: url,
        schema: args.schema.clone(),
        table_prefix: args.table_prefix.clone(),
    };
    let store = db::open(&dbargs, 1).await?;
    let rows =
        idem_sql::with_store!(store, s => s.inbox().dead_letters(&args.group, args.limit).await)
            .context(MIGRATE_HINT)?;
    if args.json {
        println!("{}", serde_json::to_string(&rows)?);
    } else if rows.is_empty() {
        println!("no dead letters for group {}", args.group);
    } else {
        for r in rows {
            let replayed = match (&r.replay_outcome, &r.replayed_at) {
                (Some(o), Some(at)) => format!(
                    "  replay: {o} at {at} by {}",
                    r.replayed_by.as_deref().unwrap_or("-")
                ),
                _ => String::new(),
            };
            println!(
                "#{} {}/{}@{}  event {}  reason: {}{replayed}",
                r.id,
                r.topic,
                r.partition,
                r.offset,
                r.event_id.as_deref().unwrap_or("-"),
                r.reason
            );
        }
    }
    Ok(())
}
