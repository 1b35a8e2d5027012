//! `idem-lab bench console`: server time per page of `idem console` over large tables.
//!
//! A database of its own gets idem's tables, filled with set-based statements the way writers,
//! relays, consumers and operators leave them (`sql/console_*.sql`), and is analyzed. The
//! console runs as a child process of this binary, its sampler on, and an operator logs in, so
//! every page renders with its action forms. Each page is requested a few times to warm up,
//! then `--requests` times in a row over one keep-alive HTTP/1.1 connection on loopback; the
//! report gives p50, p99 and max of each, next to two floors measured in the same run: `SELECT
//! 1` on a pool to the same database, and `GET /login` (a page that reads nothing).

mod fill;
mod http;

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use serde_json::json;

use super::pg::Databases;
use fill::{FillTimes, Targets};
use http::Console;

/// The target: p99 of each page, milliseconds.
const P99_TARGET_MS: f64 = 200.0;
/// `SELECT 1`, as the ceilings' round trip.
const ROUND_TRIP: &str = include_str!("sql/round_trip.sql");

/// Options of `idem-lab bench console`.
#[derive(Args, Debug)]
pub(super) struct ConsoleBenchArgs {
    /// PostgreSQL server URL (any database on it); the bench creates and drops its own.
    #[arg(long, env = "IDEM_BENCH_DB", default_value = super::DEFAULT_DB)]
    db: String,
    /// Outbox rows, mostly published.
    #[arg(long, default_value_t = 1_000_000)]
    outbox_rows: u64,
    /// Of them, the newest pending.
    #[arg(long, default_value_t = 10_000)]
    pending_rows: u64,
    /// Of them, parked (spread over the table, four reasons).
    #[arg(long, default_value_t = 2_000)]
    parked_rows: u64,
    /// Inbox rows, in three consumer groups.
    #[arg(long, default_value_t = 1_000_000)]
    inbox_rows: u64,
    /// Dead letters of the same groups (four reasons; some replayed, some requested).
    #[arg(long, default_value_t = 100_000)]
    dead_letters: u64,
    /// Effect intents, mostly done (the newest 1 % pending).
    #[arg(long, default_value_t = 100_000)]
    effect_intents: u64,
    /// Of them, of unknown outcome.
    #[arg(long, default_value_t = 3_000)]
    unknown_intents: u64,
    /// Of them, parked.
    #[arg(long, default_value_t = 2_000)]
    parked_intents: u64,
    /// Operator actions in the audit.
    #[arg(long, default_value_t = 5_000)]
    audit_rows: u64,
    /// Timed requests per page (and per floor).
    #[arg(long, default_value_t = 200)]
    requests: u32,
    /// Untimed requests per page first.
    #[arg(long, default_value_t = 5)]
    warmup: u32,
    /// The console's `--sample-every`.
    #[arg(long, default_value = "10s", value_parser = idem_cli::util::parse_duration)]
    sample_every: Duration,
    /// Each page's timed requests start at even intervals over at least this long (default: one
    /// --sample-every, so a sample round falls among them, as among an operator's clicks; `0s`
    /// sends them back to back).
    #[arg(long, value_parser = idem_cli::util::parse_duration)]
    spread: Option<Duration>,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

impl ConsoleBenchArgs {
    fn check(&self) -> anyhow::Result<()> {
        if self.pending_rows + self.parked_rows > self.outbox_rows {
            bail!("--pending-rows and --parked-rows are part of --outbox-rows");
        }
        if self.unknown_intents + self.parked_intents > self.effect_intents * 99 / 100 {
            bail!(
                "--unknown-intents and --parked-intents are part of --effect-intents (99 % at most)"
            );
        }
        if self.requests == 0 || self.sample_every.is_zero() {
            bail!("--requests and --sample-every must be positive");
        }
        Ok(())
    }

    /// The least time between the starts of two timed requests.
    fn pace(&self) -> Duration {
        self.spread.unwrap_or(self.sample_every) / self.requests.max(1)
    }
}

/// Percentiles of one page's (or floor's) times.
#[derive(Clone, Copy, Debug)]
struct Timing {
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

impl Timing {
    /// Nearest-rank percentiles of `times` (not empty).
    fn of(times: &mut [Duration]) -> Self {
        times.sort_unstable();
        let at = |q: f64| times[crate::num::rank(times.len(), q)].as_secs_f64() * 1e3;
        Timing {
            p50_ms: at(0.5),
            p99_ms: at(0.99),
            max_ms: at(1.0),
        }
    }
}

/// One measured page or floor: its times and size, or why it could not be measured.
#[derive(Debug)]
struct Figure {
    key: &'static str,
    path: String,
    /// The path as the table shows it.
    shown: String,
    result: Result<(Timing, usize), String>,
}

impl Figure {
    fn met(&self) -> Option<bool> {
        self.result
            .as_ref()
            .ok()
            .map(|(t, _)| t.p99_ms <= P99_TARGET_MS)
    }
}

/// Everything one run measured.
#[derive(Debug)]
struct Measured {
    postgres: String,
    fill: FillTimes,
    targets: Targets,
    floors: Vec<Figure>,
    pages: Vec<Figure>,
    /// The console's newest sample at the end, as its overview says (`4 s`).
    sample_age: String,
    /// Whether that sample is at most two periods old: the sampler ran during the run.
    sampler_running: bool,
    /// From the first warm-up request to the last timed one.
    seconds: f64,
    /// The machine's load average (1, 5, 15 min) before the first request and after the last.
    load: (String, String),
}

/// Runs `idem-lab bench console`.
pub(super) async fn run(args: ConsoleBenchArgs) -> anyhow::Result<()> {
    args.check()?;
    let m = Databases::scoped(&args.db, async |dbs| measure(&args, dbs).await).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&json_report(&args, &m))?);
    } else {
        print!("{}", text_report(&args, &m));
    }
    if !m.sampler_running {
        bail!(
            "the console's sampler did not run during the measurement (newest sample {} old)",
            m.sample_age
        );
    }
    let failed: Vec<&str> = m
        .floors
        .iter()
        .chain(&m.pages)
        .filter(|f| f.result.is_err())
        .map(|f| f.key)
        .collect();
    if !failed.is_empty() {
        bail!(
            "not every page answered 200 with a body: {}",
            failed.join(", ")
        );
    }
    Ok(())
}

/// Fills the database, starts the console and times every page and floor.
async fn measure(args: &ConsoleBenchArgs, dbs: &mut Databases) -> anyhow::Result<Measured> {
    let (url, pool) = dbs.create("console", 4).await?;
    let postgres: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&pool)
        .await?;
    let fill = fill::fill(&pool, args).await?;
    let targets = Targets::read(&pool).await?;
    eprintln!("idem bench console: starting idem console");
    let console = Console::start(&url, args.sample_every).await?;
    let forms = console.get("/outbox").await?;
    if !forms.contains("name=\"csrf\"") {
        bail!("the outbox page shows no action form: the operator is not logged in");
    }
    let load_before = super::report::load_average();
    let started = Instant::now();
    let mut floors = vec![select_one(&pool, args).await];
    let login = ("/login".to_owned(), "GET /login".to_owned());
    floors.push(page(&console, args, "login", login.0, login.1).await);
    let mut pages = vec![];
    for (key, path, shown) in paths(&targets)? {
        pages.push(page(&console, args, key, path, shown).await);
    }
    let seconds = started.elapsed().as_secs_f64();
    let load = (load_before, super::report::load_average());
    let sample_age = console
        .sample_age()
        .await
        .unwrap_or_else(|e| format!("unknown ({e:#})"));
    let period = args.sample_every.as_secs_f64();
    let sampler_running = http::age_seconds(&sample_age).is_some_and(|a| a <= 2.0 * period + 1.0);
    console.stop().await?;
    pool.close().await;
    Ok(Measured {
        postgres,
        fill,
        targets,
        floors,
        pages,
        sample_age,
        sampler_running,
        seconds,
        load,
    })
}

/// A page to time: its key, its path and query, and the same as the table shows it (a long
/// reason named by what it is).
type Page = (&'static str, String, String);

/// Every page an operator opens, with the filters the targets choose.
fn paths(t: &Targets) -> anyhow::Result<Vec<Page>> {
    let reason = t
        .parked_reason
        .as_deref()
        .context("no outbox row is parked")?;
    let group = t
        .letter_group
        .as_deref()
        .context("no dead letter is open")?;
    let letter_reason = t.letter_reason.as_deref().unwrap_or_default();
    let letters_after = t.letters_after.unwrap_or_default();
    let g = format!("group={}", encode(group));
    let r = format!("reason={}", encode(letter_reason));
    let page = |key, path: String, shown: &str| (key, path, shown.to_owned());
    let same = |key, path: &str| (key, path.to_owned(), path.to_owned());
    Ok(vec![
        same("overview", "/"),
        same("outbox", "/outbox"),
        page(
            "outbox_reason",
            format!("/outbox?reason={}", encode(reason)),
            "/outbox?reason=<the rarest parked reason>",
        ),
        same("outbox_after", &format!("/outbox?after={}", t.outbox_after)),
        same("consumers", "/consumers"),
        same("letters", &format!("/consumers/letters?{g}")),
        page(
            "letters_reason",
            format!("/consumers/letters?{g}&{r}"),
            &format!("/consumers/letters?{g}&reason=<its rarest>"),
        ),
        same(
            "letters_after",
            &format!("/consumers/letters?{g}&after={letters_after}"),
        ),
        page(
            "replay_dry_run",
            format!("/consumers/replay?{g}&{r}"),
            &format!("/consumers/replay?{g}&reason=<its rarest>"),
        ),
        same("effects", "/effects"),
        same("effects_unknown", "/effects?status=unknown"),
        same("proof", "/proof"),
        same("audit", "/audit"),
    ])
}

/// `s` as a query value: every byte but the unreserved ones percent-encoded.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Times `GET path`: `--warmup` untimed, then `--requests` timed, one after the other.
async fn page(
    console: &Console,
    args: &ConsoleBenchArgs,
    key: &'static str,
    path: String,
    shown: String,
) -> Figure {
    eprintln!("idem bench console: timing {shown}");
    let result = timed(args, async || Ok(console.get(&path).await?.len())).await;
    Figure {
        key,
        path,
        shown,
        result: result.map_err(|e| format!("{e:#}")),
    }
}

/// The floor of a page's database work: `SELECT 1` on a pool to the same database.
async fn select_one(pool: &sqlx::PgPool, args: &ConsoleBenchArgs) -> Figure {
    let result = timed(args, async || {
        sqlx::query(ROUND_TRIP).execute(pool).await?;
        Ok(0)
    })
    .await;
    Figure {
        key: "select_1",
        path: "SELECT 1".to_owned(),
        shown: "SELECT 1 on a pool".to_owned(),
        result: result.map_err(|e| format!("{e:#}")),
    }
}

/// Runs `once` `--warmup` times, then `--requests` times timed, each start at least
/// [`ConsoleBenchArgs::pace`] after the one before; the percentiles and the size `once`
/// returned last.
async fn timed(
    args: &ConsoleBenchArgs,
    mut once: impl AsyncFnMut() -> anyhow::Result<usize>,
) -> anyhow::Result<(Timing, usize)> {
    for _ in 0..args.warmup {
        once().await?;
    }
    let mut times = Vec::with_capacity(usize::try_from(args.requests)?);
    let mut size = 0;
    let mut next = tokio::time::Instant::now();
    for _ in 0..args.requests {
        tokio::time::sleep_until(next).await;
        next += args.pace();
        let started = Instant::now();
        size = once().await?;
        times.push(started.elapsed());
    }
    Ok((Timing::of(&mut times), size))
}

/// The report as JSON.
fn json_report(args: &ConsoleBenchArgs, m: &Measured) -> serde_json::Value {
    let figure = |f: &Figure| match &f.result {
        Ok((t, bytes)) => json!({
            "key": f.key, "path": f.path, "p50_ms": t.p50_ms, "p99_ms": t.p99_ms,
            "max_ms": t.max_ms, "bytes": bytes,
        }),
        Err(e) => json!({ "key": f.key, "path": f.path, "failed": e }),
    };
    let ratios: serde_json::Map<String, serde_json::Value> = m
        .pages
        .iter()
        .map(|f| {
            let value = f.result.as_ref().ok().map(|(t, _)| t.p99_ms);
            let v = json!({ "value": value, "target": "<= 200", "met": f.met() });
            (format!("{}_p99_ms", f.key), v)
        })
        .collect();
    json!({
        "config": config(args),
        "environment": {
            "cores": std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
            "postgres": m.postgres,
            "load_average_at_start": m.load.0,
            "load_average_at_end": m.load.1,
        },
        "fill_seconds": m.fill.iter().map(|(k, s)| ((*k).to_owned(), json!(s))).collect::<serde_json::Map<_, _>>(),
        "targets": {
            "parked_reason": m.targets.parked_reason, "outbox_after": m.targets.outbox_after,
            "letter_group": m.targets.letter_group, "letter_reason": m.targets.letter_reason,
            "letters_after": m.targets.letters_after,
        },
        "floors": m.floors.iter().map(figure).collect::<Vec<_>>(),
        "pages": m.pages.iter().map(figure).collect::<Vec<_>>(),
        "ratios": ratios,
        "targets_met": m.pages.iter().all(|f| f.met() == Some(true)),
        "sampler": { "sample_every_s": args.sample_every.as_secs_f64(), "last_sample_age_at_end": m.sample_age, "running": m.sampler_running },
        "measure_seconds": m.seconds,
    })
}

/// The run's options, as the report records them.
fn config(args: &ConsoleBenchArgs) -> serde_json::Value {
    json!({
        "outbox_rows": args.outbox_rows, "pending_rows": args.pending_rows,
        "parked_rows": args.parked_rows, "inbox_rows": args.inbox_rows,
        "dead_letters": args.dead_letters, "effect_intents": args.effect_intents,
        "unknown_intents": args.unknown_intents, "parked_intents": args.parked_intents,
        "audit_rows": args.audit_rows, "requests": args.requests, "warmup": args.warmup,
        "sample_every_s": args.sample_every.as_secs_f64(),
        "spread_s": args.pace().as_secs_f64() * f64::from(args.requests),
    })
}

/// The report as a table.
fn text_report(args: &ConsoleBenchArgs, m: &Measured) -> String {
    let mut out = format!(
        "idem console over {} outbox rows, {} inbox rows, {} dead letters, {} effect intents, {} audit rows\n",
        args.outbox_rows, args.inbox_rows, args.dead_letters, args.effect_intents, args.audit_rows
    );
    let fill: Vec<String> = m
        .fill
        .iter()
        .map(|(k, s)| format!("{k} {s:.1} s"))
        .collect();
    out += &format!("  filled in: {}\n", fill.join(", "));
    out += &format!(
        "  {} GETs per page after {} untimed, one after the other over {:.0} s, logged in, load average {} → {}\n",
        args.requests,
        args.warmup,
        args.pace().as_secs_f64() * f64::from(args.requests),
        m.load.0,
        m.load.1,
    );
    out += &format!(
        "  the console samples every {} s; its newest sample is {} old at the end\n",
        args.sample_every.as_secs_f64(),
        m.sample_age
    );
    out += &format!(
        "  {:<56} {:>9} {:>9} {:>9} {:>9}   p99 <= {P99_TARGET_MS:.0} ms\n",
        "page", "p50 ms", "p99 ms", "max ms", "bytes"
    );
    for f in &m.floors {
        out += &line(&format!("floor: {}", f.shown), f, None);
    }
    for f in &m.pages {
        out += &line(&f.shown, f, Some(f.met() == Some(true)));
    }
    let t = &m.targets;
    out += &format!(
        "  the rarest parked reason: {}\n  the rarest open reason of group {}: {}\n",
        t.parked_reason.as_deref().unwrap_or("-"),
        t.letter_group.as_deref().unwrap_or("-"),
        t.letter_reason.as_deref().unwrap_or("-"),
    );
    out
}

/// One row of the table: a path cut to 56 characters, its figures and whether it met the
/// target (floors have none).
fn line(path: &str, f: &Figure, met: Option<bool>) -> String {
    let shown: String = if path.chars().count() > 56 {
        path.chars().take(55).chain(['…']).collect()
    } else {
        path.to_owned()
    };
    let verdict = match met {
        None => "",
        Some(true) => "met",
        Some(false) => "MISSED",
    };
    match &f.result {
        Ok((t, bytes)) => format!(
            "  {shown:<56} {:>9.2} {:>9.2} {:>9.2} {bytes:>9}   {verdict}\n",
            t.p50_ms, t.p99_ms, t.max_ms
        ),
        Err(e) => format!("  {shown:<56} failed: {e}\n"),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut times: Vec<Duration> = (1..=200).rev().map(Duration::from_millis).collect();
        let t = super::Timing::of(&mut times);
        assert!((t.p50_ms - 101.0).abs() < 1e-9, "{t:?}");
        assert!((t.p99_ms - 198.0).abs() < 1e-9, "{t:?}");
        assert!((t.max_ms - 200.0).abs() < 1e-9, "{t:?}");
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(super::encode("a b&c=ü"), "a%20b%26c%3D%C3%BC");
    }
}
