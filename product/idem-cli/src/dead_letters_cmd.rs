//! `idem dead-letters`: a consumer group's dead letters with their reasons, and `idem
//! dead-letters replay`, which hands them back to the group's running consumer.
//!
//! The command cannot run a handler (it is the user's, inside their consumer): a confirmed
//! replay records a request on each letter ([`InboxStore::request_replays`]), and every
//! `idem_consumer::Consumer` of the group serves the requests of its group through its own
//! handler, in one transaction with the event's inbox row, so a replay requested twice, served
//! by two members, or racing a redelivery applies once. Without `--confirm` the command is a
//! dry run: it decodes each letter as the consumer would and changes nothing.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Subcommand};
use idem_consumer::replay::{ReplayResult, Replayed, preview};
use idem_core::store::{InboxStore, StoredDeadLetter};

use crate::DbArgs;
use crate::db;

/// `idem dead-letters`: list a group's dead letters, or `replay` them.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct DeadLettersArgs {
    #[command(subcommand)]
    command: Option<DeadLettersCommand>,
    #[command(flatten)]
    list: ListArgs,
}

/// What to do with dead letters other than listing them.
#[derive(Subcommand, Debug)]
enum DeadLettersCommand {
    /// Hand dead letters back to the group's running consumer, which re-applies each through
    /// its handler once (a dry run unless --confirm).
    Replay(ReplayArgs),
}

/// `idem dead-letters --db URL --group G`: [`DbArgs`] spelled out, optional to the types (a
/// `replay` subcommand takes its own) and required on the command line.
#[derive(Args, Debug)]
struct ListArgs {
    /// Database URL: postgres://… or sqlite://path.
    #[arg(long, env = "IDEM_DB", required = true)]
    db: Option<String>,
    /// PostgreSQL schema of idem's tables (default: the search path).
    #[arg(long, env = "IDEM_SCHEMA")]
    schema: Option<String>,
    /// Prefix of idem's table names.
    #[arg(long, env = "IDEM_TABLE_PREFIX", default_value = "idem_")]
    table_prefix: String,
    /// Consumer group.
    #[arg(long, required = true)]
    group: Option<String>,
    /// At most this many.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// `idem dead-letters replay`.
#[derive(Args, Debug)]
struct ReplayArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Consumer group whose dead letters these are (its running consumer replays them).
    #[arg(long)]
    group: String,
    /// Replay this dead letter (its id in `idem dead-letters`).
    #[arg(long, conflicts_with = "all", required_unless_present = "all")]
    id: Option<i64>,
    /// Replay every open dead letter of the group (never replayed, or whose replay failed).
    #[arg(long)]
    all: bool,
    /// Request the replays. Without it the command is a dry run: it lists what would be
    /// replayed and changes nothing.
    #[arg(long)]
    confirm: bool,
    /// Who requests the replays, recorded on each letter and in the audit (default: $USER).
    #[arg(long)]
    by: Option<String>,
    /// Why (kept in the audit table).
    #[arg(long, default_value = "replayed with idem dead-letters replay")]
    reason: String,
    /// How long to wait for the group's consumer to serve the requests (0s: do not wait; the
    /// requests stay until a consumer of the group serves them).
    #[arg(long, default_value = "30s", value_parser = crate::util::parse_duration)]
    wait: Duration,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Why reading the dead letters failed, when it does.
pub const MIGRATE_HINT: &str =
    "reading the dead letters (a database below idem's schema version 22 needs `idem migrate`)";

/// How often a confirmed replay looks whether its requests were served.
const WAIT_POLL: Duration = Duration::from_millis(200);

/// Runs `idem dead-letters` or `idem dead-letters replay`.
pub async fn run(args: DeadLettersArgs) -> anyhow::Result<()> {
    match args.command {
        Some(DeadLettersCommand::Replay(replay)) => run_replay(replay).await,
        None => list(args.list).await,
    }
}

/// Lists the group's dead letters (JSON with `--json`).
async fn list(args: ListArgs) -> anyhow::Result<()> {
    let (Some(url), Some(group)) = (args.db, args.group) else {
        anyhow::bail!("idem dead-letters needs --db URL (or IDEM_DB) and --group");
    };
    let dbargs = DbArgs {
        db: url,
        schema: args.schema,
        table_prefix: args.table_prefix,
    };
    let store = db::open(&dbargs, 1).await?;
    let rows = idem_sql::with_store!(store, s => s.inbox().dead_letters(&group, args.limit).await)
        .context(MIGRATE_HINT)?;
    if args.json {
        println!("{}", serde_json::to_string(&rows)?);
    } else if rows.is_empty() {
        println!("no dead letters for group {group}");
    } else {
        for r in &rows {
            println!("{}", listed(r));
        }
    }
    Ok(())
}

/// One line of `idem dead-letters`.
fn listed(r: &StoredDeadLetter) -> String {
    let replayed = match (&r.replay_outcome, &r.replayed_at) {
        (Some(o), Some(at)) => format!(
            "  replay: {o} at {at} by {}",
            r.replayed_by.as_deref().unwrap_or("-")
        ),
        _ => String::new(),
    };
    let requested = match &r.replay_requested_at {
        Some(at) => format!(
            "  replay requested at {at} by {}",
            r.replay_requested_by.as_deref().unwrap_or("-")
        ),
        None => String::new(),
    };
    format!(
        "#{} {}/{}@{}  event {}  reason: {}{replayed}{requested}",
        r.id,
        r.topic,
        r.partition,
        r.offset,
        r.event_id.as_deref().unwrap_or("-"),
        r.reason
    )
}

/// Runs `idem dead-letters replay`: the dry run, or the request and the wait for it.
async fn run_replay(args: ReplayArgs) -> anyhow::Result<()> {
    let store = db::open(&args.db, 1).await?;
    idem_sql::with_store!(&store, s => replay_with(&s.inbox(), &store, &args).await)
}

async fn replay_with<I: InboxStore>(
    inbox: &I,
    store: &idem_sql::AnyStore,
    args: &ReplayArgs,
) -> anyhow::Result<()> {
    if !args.confirm {
        let dry = preview(inbox, &args.group, args.id)
            .await
            .context(MIGRATE_HINT)?;
        print_dry_run(args, &dry);
        return none_open(args, dry.is_empty());
    }
    let by = crate::audit::actor(args.by.as_deref());
    let ids = inbox
        .request_replays(&args.group, args.id, None, &by)
        .await
        .context(MIGRATE_HINT)?;
    none_open(args, ids.is_empty())?;
    let target = match args.id {
        Some(id) => format!("dead letter #{id} of group {}", args.group),
        None => format!("every open dead letter of group {}", args.group),
    };
    let requested = crate::audit::Audited {
        action: "dead_letters.replay",
        target,
        reason: args.reason.clone(),
        affected: u64::try_from(ids.len()).unwrap_or(u64::MAX),
        outcome: "requested".to_owned(),
    };
    crate::audit::record(store, Some(&by), requested).await;
    if args.wait.is_zero() {
        report(args, &ids, &[])?;
        return Ok(());
    }
    let served = wait_served(inbox, &args.group, &ids, args.wait).await?;
    report(args, &ids, &served)
}

/// Refuses a replay of one letter that is not open; says so when the group has none.
fn none_open(args: &ReplayArgs, empty: bool) -> anyhow::Result<()> {
    match (args.id, empty) {
        (Some(id), true) => anyhow::bail!(
            "group {} has no open dead letter #{id} (it does not exist, or its replay succeeded: see `idem dead-letters`)",
            args.group
        ),
        (None, true) if !args.json => {
            println!("no open dead letters to replay for group {}", args.group);
            Ok(())
        }
        _ => Ok(()),
    }
}

fn print_dry_run(args: &ReplayArgs, dry: &[Replayed]) {
    if args.json {
        let rows: Vec<serde_json::Value> = dry.iter().map(dry_json).collect();
        println!("{}", serde_json::Value::Array(rows));
        return;
    }
    for r in dry {
        let what = match &r.result {
            ReplayResult::Undecodable(reason) => format!("not replayable (undecodable): {reason}"),
            _ => "would replay".to_owned(),
        };
        println!(
            "#{} {}/{}@{}  event {}  {what}",
            r.id,
            r.topic,
            r.partition,
            r.offset,
            r.event_id.map_or_else(|| "-".to_owned(), |e| e.to_string())
        );
    }
    if !dry.is_empty() {
        println!(
            "dry run: nothing changed; add --confirm to hand {} letter(s) to group {}'s running consumer",
            dry.len(),
            args.group
        );
    }
}

fn dry_json(r: &Replayed) -> serde_json::Value {
    let reason = match &r.result {
        ReplayResult::Undecodable(reason) | ReplayResult::Failed(reason) => Some(reason),
        _ => None,
    };
    serde_json::json!({
        "id": r.id,
        "topic": r.topic,
        "partition": r.partition,
        "offset": r.offset,
        "event_id": r.event_id.map(|e| e.to_string()),
        "outcome": r.result.label(),
        "reason": reason,
    })
}

/// Waits until no replay of `ids` is requested any more (every one served) or `wait` passed,
/// and reads back the letters served.
async fn wait_served<I: InboxStore>(
    inbox: &I,
    group: &str,
    ids: &[i64],
    wait: Duration,
) -> anyhow::Result<Vec<StoredDeadLetter>> {
    let deadline = Instant::now() + wait;
    let first = ids.first().map_or(0, |id| id - 1);
    loop {
        let pending = pending_of(inbox, group, first, ids).await?;
        if pending == 0 || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(WAIT_POLL).await;
    }
    let mut served = vec![];
    for id in ids {
        if let Some(letter) = inbox.find_dead_letter(group, *id).await? {
            served.push(letter);
        }
    }
    Ok(served)
}

/// How many of `ids` are still requested (their ids are above `after`).
async fn pending_of<I: InboxStore>(
    inbox: &I,
    group: &str,
    mut after: i64,
    ids: &[i64],
) -> anyhow::Result<usize> {
    let mut pending = 0;
    loop {
        let page = inbox.requested_replays(group, after, 500).await?;
        let Some(last) = page.last() else {
            return Ok(pending);
        };
        after = last.open.id;
        pending += page
            .iter()
            .filter(|r| ids.binary_search(&r.open.id).is_ok())
            .count();
    }
}

/// Prints what became of the requests; an error when one failed or was not served in time.
fn report(args: &ReplayArgs, ids: &[i64], served: &[StoredDeadLetter]) -> anyhow::Result<()> {
    if args.json {
        println!("{}", serde_json::to_string(served)?);
    } else {
        for r in served {
            println!("{}", listed(r));
        }
    }
    let waiting = served
        .iter()
        .filter(|r| r.replay_requested_at.is_some())
        .count();
    if args.wait.is_zero() || waiting > 0 {
        let waiting = if args.wait.is_zero() {
            ids.len()
        } else {
            waiting
        };
        let msg = format!(
            "{waiting} of {} replay(s) requested and not served yet: a consumer of group {} serves them (idem schema 22 or later); they stay requested until one runs",
            ids.len(),
            args.group
        );
        if args.wait.is_zero() {
            eprintln!("{msg}");
            return Ok(());
        }
        anyhow::bail!("after {:?}, {msg}", args.wait);
    }
    let failed = served
        .iter()
        .filter(|r| r.replay_outcome.as_deref() == Some("failed"))
        .count();
    if failed > 0 {
        anyhow::bail!(
            "{failed} of {} replays failed; the letters are kept with the new reason",
            served.len()
        );
    }
    Ok(())
}
