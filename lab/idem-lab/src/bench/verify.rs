//! `idem-lab bench verify`: time and peak memory of `idem verify` over two large tables.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;

use super::child::Child;
use super::kafka::TempDir;
use super::pg::Databases;

/// Options of `idem-lab bench verify`.
#[derive(Args, Debug)]
pub(super) struct VerifyBenchArgs {
    /// PostgreSQL server URL (any database on it); the bench creates and drops its own.
    #[arg(long, env = "IDEM_BENCH_DB", default_value = super::DEFAULT_DB)]
    db: String,
    /// Rows per side.
    #[arg(long, default_value_t = 10_000_000)]
    rows: u64,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

/// Peak RSS target of `idem verify`, bytes.
const VERIFY_RSS_TARGET: u64 = 100 * 1024 * 1024;

pub(super) async fn run(args: VerifyBenchArgs) -> anyhow::Result<()> {
    let (elapsed, peak) =
        Databases::scoped(&args.db, async |dbs| measure(&args, dbs).await).await?;
    let mib = crate::num::mib(peak);
    let met = peak <= VERIFY_RSS_TARGET;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "rows_per_side": args.rows,
                "figures": {
                    "verify_seconds": elapsed.as_secs_f64(),
                    "verify_rows_per_s": crate::num::per_second(2 * args.rows, elapsed),
                    "verify_peak_rss_mib": mib,
                },
                "ratios": {
                    "verify_peak_rss_mib": { "value": mib, "target": "<= 100", "met": met },
                },
            })
        );
    } else {
        println!("idem verify over {} rows per side", args.rows);
        println!("  elapsed        {:>10.1} s", elapsed.as_secs_f64());
        println!(
            "  rows/s         {:>10.0}   (both sides)",
            crate::num::per_second(2 * args.rows, elapsed)
        );
        println!(
            "  peak RSS       {:>10.1} MiB   target <= 100 MiB: {}",
            mib,
            if met { "met" } else { "MISSED" }
        );
    }
    Ok(())
}

async fn measure(args: &VerifyBenchArgs, dbs: &mut Databases) -> anyhow::Result<(Duration, u64)> {
    let (url, pool) = dbs.create("verify", 4).await?;
    let rows = i64::try_from(args.rows)?;
    for table in ["bench_source", "bench_target"] {
        eprintln!("idem bench verify: filling {table} with {} rows", args.rows);
        let t = Instant::now();
        sqlx::query(&format!(
            "CREATE UNLOGGED TABLE {table} (payment_id text NOT NULL, amount_minor bigint NOT NULL)"
        ))
        .execute(&pool)
        .await?;
        sqlx::query(&format!(
            "INSERT INTO {table} SELECT 'pay-' || n, 100 + n % 9900 FROM generate_series(1, $1::bigint) n"
        ))
        .bind(rows)
        .execute(&pool)
        .await
        .with_context(|| format!("filling {table}"))?;
        sqlx::query(&format!("ANALYZE {table}"))
            .execute(&pool)
            .await?;
        eprintln!(
            "idem bench verify: {table} filled in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }
    pool.close().await;
    let dir = TempDir::new("verify")?;
    let config = dir.0.join("verify.toml");
    std::fs::write(&config, verify_toml(&url))?;
    eprintln!("idem bench verify: running idem verify");
    let started = Instant::now();
    let child = Child::spawn(
        "verify",
        &[
            "verify".to_owned(),
            "--config".to_owned(),
            config.display().to_string(),
            "--json".to_owned(),
        ],
        &[],
        &dir.0,
    )?;
    let (status, peak) = child.wait_with_peak().await?;
    let elapsed = started.elapsed();
    if !status.success() {
        let log = std::fs::read_to_string(dir.0.join("verify.log")).unwrap_or_default();
        bail!(
            "idem verify exited with {status}:\n{}",
            last_chars(&log, 2000)
        );
    }
    Ok((elapsed, peak))
}

fn last_chars(s: &str, n: usize) -> &str {
    let start = s.len().saturating_sub(n);
    let start = (start..s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(s.len());
    &s[start..]
}

fn verify_toml(url: &str) -> String {
    format!(
        r#"[[check]]
name = "bench"
event_type = "order.paid"
source = {{ db = "{url}", query = "SELECT payment_id, amount_minor FROM bench_source", key = "payment_id", amount = "amount_minor" }}
target = {{ db = "{url}", query = "SELECT payment_id, amount_minor FROM bench_target", key = "payment_id", amount = "amount_minor" }}
"#
    )
}
