//! The lab's own commands on the command line: the Kafka-transactions negative control refuses
//! to run outside chaos, and `idem-lab dead-letters replay` re-applies dead letters through the
//! reference handlers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};

/// Runs `idem-lab` with `args`, no crash point armed.
fn idem(args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-lab"));
    cmd.args(args).env_remove("IDEM_CRASH_POINTS");
    cmd.output().unwrap()
}

/// Standard output and standard error, as text.
fn text(o: &Output) -> (String, String) {
    let lossy = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (lossy(&o.stdout), lossy(&o.stderr))
}

/// A migrated SQLite database in a directory of its own.
struct Db {
    _dir: tempfile::TempDir,
    url: String,
}

fn sqlite() -> Db {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("lab.db").display());
    let o = idem(&["migrate", "--db", &url]);
    assert!(o.status.success(), "{:?}", text(&o));
    Db { _dir: dir, url }
}

/// The Kafka-transactions consumer applies effects twice on purpose: outside `idem-lab chaos
/// --break kafka-transactions` it refuses to start, before touching any database or broker.
#[test]
fn the_kafka_transactions_negative_control_refuses_to_run_outside_chaos() {
    let o = Command::new(env!("CARGO_BIN_EXE_idem-lab"))
        .args([
            "kafka-txn-settlement",
            "--db",
            "postgres://nobody@127.0.0.1:1/none",
            "--brokers",
            "127.0.0.1:1",
            "--group",
            "g",
            "--topic",
            "t",
        ])
        .env_remove("IDEM_BREAK")
        .env_remove("IDEM_CRASH_POINTS")
        .output()
        .unwrap();
    let (_, stderr) = text(&o);
    assert!(!o.status.success(), "{stderr}");
    assert!(stderr.contains("negative control"), "{stderr}");
    assert!(
        stderr.contains("idem-lab chaos --break kafka-transactions"),
        "{stderr}"
    );
}

/// `idem-lab dead-letters replay`: `--dry-run` lists and changes nothing; the replay applies the
/// payment once through the settlement handler and closes the letter; an undecodable letter is
/// reported and left; a closed letter asked for by id is an error.
#[test]
fn dead_letters_are_replayed_from_the_cli_and_a_dry_run_changes_nothing() {
    let db = sqlite();
    let order = idem_reference::PaidOrder::numbered("", 1);
    let event = order.event().unwrap();
    let headers = serde_json::json!({
        "ce_id": event.id().to_string(),
        "ce_type": "order.paid",
        "idem_aggregate_type": "order",
        "idem_aggregate_id": order.order_id,
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pool = rt.block_on(sqlx::SqlitePool::connect(&db.url)).unwrap();
    rt.block_on(async {
        idem_reference::ensure_schema_sqlite(&pool).await.unwrap();
        let insert = "INSERT INTO idem_dead_letters (consumer_group, topic, record_partition, record_offset, \
             event_id, event_type, reason, record_key, payload, headers) VALUES ('settlement', 'outbox.event.order', 0, ?1, ?2, 'order.paid', ?3, ?4, ?5, ?6)";
        sqlx::query(insert)
            .bind(1)
            .bind(event.id().to_string())
            .bind("gave up after 11 transient failures; last: lock timeout")
            .bind(&order.order_id)
            .bind(event.payload())
            .bind(headers.to_string())
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query(insert)
            .bind(2)
            .bind(None::<String>)
            .bind("the record has no ce_id header (event id)")
            .bind("o-x")
            .bind("{}")
            .bind("{}")
            .execute(&pool)
            .await
            .unwrap();
    });
    let state = || {
        rt.block_on(async {
            sqlx::query_as::<_, (i64, i64, i64)>(
                "SELECT (SELECT count(*) FROM settlements), (SELECT count(*) FROM idem_inbox), \
                 (SELECT count(*) FROM idem_dead_letters WHERE replay_outcome IS NULL AND replayed_at IS NULL)",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        })
    };
    let replay = |extra: &[&str]| {
        let mut args = vec![
            "dead-letters",
            "replay",
            "--db",
            &db.url,
            "--group",
            "settlement",
        ];
        args.extend_from_slice(extra);
        idem(&args)
    };

    let o = replay(&["--all", "--dry-run"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let out = text(&o).0;
    assert!(out.contains("#1 ") && out.contains("would replay"), "{out}");
    assert!(
        out.contains("#2 ") && out.contains("not replayed (undecodable)"),
        "{out}"
    );
    assert_eq!(state(), (0, 0, 2), "the dry run changed nothing");

    let o = replay(&["--all", "--by", "ops"]);
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(text(&o).0.contains("  applied\n"), "{:?}", text(&o));
    assert_eq!(
        state(),
        (1, 1, 1),
        "settled once; the undecodable letter left as it was"
    );

    let o = replay(&["--id", "1"]);
    assert!(!o.status.success(), "{:?}", text(&o));
    assert!(
        text(&o).1.contains("no open dead letter #1"),
        "{:?}",
        text(&o)
    );
    let o = replay(&["--all"]);
    assert!(o.status.success(), "{:?}", text(&o));
    assert_eq!(state(), (1, 1, 1), "applied once");

    let o = idem(&["dead-letters", "--db", &db.url, "--group", "settlement"]);
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(text(&o).0.contains("replay: applied at"), "{:?}", text(&o));
    assert!(text(&o).0.contains("by ops"), "{:?}", text(&o));
    let o = replay(&[]);
    assert!(!o.status.success(), "--id or --all is required");
}

/// The reference services create no table in a database they are given: one nobody set up
/// (not migrated, or migrated without the reference tables) stops each at start with what is
/// missing and the command that creates it, before any broker is dialled (the broker given is
/// a closed port); `idem-lab setup` creates both, and is idempotent.
#[test]
fn a_reference_service_refuses_a_database_not_set_up_and_setup_creates_it() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("fresh.db").display());
    let closed = "127.0.0.1:9";
    let services: [Vec<&str>; 3] = [
        vec!["orders", "--db", &url, "--count", "1"],
        vec!["settlement", "--db", &url, "--brokers", closed],
        vec!["points-api", "--db", &url, "--listen", "127.0.0.1:0"],
    ];
    for args in &services {
        let o = idem(args);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "{args:?} started on an empty database");
        assert!(
            err.contains("schema is at version 0") && err.contains("idem-lab setup --db"),
            "{args:?}: {err}"
        );
    }
    let migrated = sqlite();
    let o = idem(&["orders", "--db", &migrated.url, "--count", "1"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("the reference tables orders, settlements")
            && err.contains("idem-lab setup --db"),
        "{err}"
    );
    for _ in 0..2 {
        let o = idem(&["setup", "--db", &url]);
        assert!(o.status.success(), "{:?}", text(&o));
        assert!(text(&o).0.contains("reference tables (orders, settlements"));
    }
    let o = idem(&["orders", "--db", &url, "--count", "3"]);
    assert!(o.status.success(), "{:?}", text(&o));
    // Nothing was created by the refused runs: the migrated database still has no orders table.
    let o = idem(&["orders", "--db", &migrated.url, "--count", "1"]);
    assert!(!o.status.success());
}

/// The subcommands `idem-lab <path> --help` lists.
fn subcommands(path: &[String]) -> Vec<String> {
    let args: Vec<&str> = path.iter().map(String::as_str).chain(["--help"]).collect();
    let (out, _) = text(&idem(&args));
    out.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

/// The lab's flags take lengths of time in the product's one syntax (`40s`, `500ms`): none is
/// named for a unit (`--seconds`, `--lock-timeout-ms`).
#[test]
fn no_lab_flag_is_named_for_a_unit_of_time() {
    let mut paths: Vec<Vec<String>> = vec![vec![]];
    let mut flags = 0;
    while let Some(path) = paths.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).chain(["--help"]).collect();
        let (out, _) = text(&idem(&args));
        for word in out.split_whitespace().filter(|w| w.starts_with("--")) {
            let name = word.trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
            flags += 1;
            for unit in [
                "-ms", "-millis", "-secs", "-seconds", "-minutes", "-hours", "-days",
            ] {
                assert!(
                    !name.ends_with(unit) && name != "--seconds",
                    "`idem-lab {}` has {name}: take a duration (`30s`) instead",
                    path.join(" ")
                );
            }
        }
        for sub in subcommands(&path) {
            let mut next = path.clone();
            next.push(sub);
            paths.push(next);
        }
    }
    assert!(flags > 150, "only {flags} flags were read");
}
