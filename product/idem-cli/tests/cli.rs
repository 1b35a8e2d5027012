//! The `idem` command line: migrations, enqueue validation, status, refused settings.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .output()
        .unwrap()
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

struct Db {
    _dir: tempfile::TempDir,
    url: String,
}

fn sqlite() -> Db {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("cli.db").display());
    let o = idem(&["migrate", "--db", &url]);
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(
        text(&o).0.contains(
            "applied [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]"
        ),
        "{:?}",
        text(&o)
    );
    Db { _dir: dir, url }
}

fn pending(db: &Db) -> serde_json::Value {
    let o = idem(&["outbox", "status", "--db", &db.url, "--json"]);
    assert!(o.status.success(), "{:?}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn migrate_twice_is_a_no_op() {
    let db = sqlite();
    let o = idem(&["migrate", "--db", &db.url]);
    assert!(o.status.success());
    assert!(text(&o).0.contains("up to date (version 23)"));
}

#[test]
fn bad_events_are_refused_with_a_clear_error_and_nothing_is_written() {
    let db = sqlite();
    let base = ["outbox", "enqueue", "--db", &db.url];
    let cases: [(&[&str], &str); 4] = [
        (
            &[
                "--aggregate-type",
                "order",
                "--aggregate-id",
                "o-1",
                "--event-type",
                "order.paid",
                "--payload",
                "{not json",
            ],
            "payload is not valid JSON",
        ),
        (
            &[
                "--aggregate-type",
                "order",
                "--aggregate-id",
                "",
                "--event-type",
                "order.paid",
                "--payload",
                "{}",
            ],
            "aggregate_id is empty",
        ),
        (
            &[
                "--aggregate-type",
                "order",
                "--aggregate-id",
                "o-1",
                "--event-type",
                "order paid!\u{1}",
                "--payload",
                "{}",
            ],
            "event_type",
        ),
        (
            &[
                "--aggregate-type",
                "order",
                "--aggregate-id",
                "o-1",
                "--event-type",
                "order.paid",
                "--payload",
                "{}",
                "--header",
                "ce_id=x",
            ],
            "reserved",
        ),
    ];
    for (args, message) in cases {
        let o = idem(&[&base[..], args].concat());
        assert_eq!(o.status.code(), Some(1), "{args:?} was accepted");
        let stderr = text(&o).1;
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    assert_eq!(pending(&db)["pending"], 0, "nothing was written");
    let ok = idem(
        &[
            &base[..],
            &[
                "--aggregate-type",
                "order",
                "--aggregate-id",
                "o-1",
                "--event-type",
                "order.paid",
                "--payload",
                "{}",
            ],
        ]
        .concat(),
    );
    assert!(ok.status.success(), "{:?}", text(&ok));
    assert_eq!(pending(&db)["pending"], 1);
}

#[test]
fn unsafe_producer_settings_and_bad_table_names_are_refused() {
    let db = sqlite();
    let o = idem(&[
        "relay",
        "--db",
        &db.url,
        "--brokers",
        "127.0.0.1:1",
        "--producer-config",
        "acks=1",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).1.contains("acks=1 is refused"), "{:?}", text(&o));
    let o = idem(&[
        "relay",
        "--db",
        &db.url,
        "--brokers",
        "127.0.0.1:1",
        "--producer-config",
        "enable.idempotence=false",
    ]);
    assert!(
        text(&o).1.contains("enable.idempotence=false is refused"),
        "{:?}",
        text(&o)
    );
    let o = idem(&[
        "migrate",
        "--db",
        &db.url,
        "--table-prefix",
        "x\"; drop table y; --",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).1.contains("invalid SQL identifier"),
        "{:?}",
        text(&o)
    );
}

#[test]
fn relay_without_tables_says_to_migrate() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("empty.db").display());
    let o = idem(&["relay", "--db", &url, "--brokers", "127.0.0.1:1"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).1.contains("idem migrate"), "{:?}", text(&o));
}

#[test]
fn parked_rows_are_listed_and_retried_from_the_cli() {
    let db = sqlite();
    let o = idem(&[
        "outbox",
        "enqueue",
        "--db",
        &db.url,
        "--aggregate-type",
        "order",
        "--aggregate-id",
        "o-1",
        "--event-type",
        "order.paid",
        "--payload",
        "{}",
    ]);
    let id = text(&o).0.trim().to_owned();
    let pool_url = db.url.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let pool = sqlx::SqlitePool::connect(&pool_url).await.unwrap();
        sqlx::query("UPDATE idem_outbox SET status = 'parked', attempts = 5, last_error = 'message too large'")
            .execute(&pool)
            .await
            .unwrap();
    });
    let o = idem(&["outbox", "parked", "--db", &db.url]);
    let out = text(&o).0;
    assert!(
        out.contains(&id) && out.contains("message too large") && out.contains("attempts=5"),
        "{out}"
    );
    let o = idem(&[
        "outbox",
        "retry",
        "--db",
        &db.url,
        "--event-id",
        &id,
        "--reason",
        "topic created",
    ]);
    assert!(
        text(&o).0.contains("returned 1 parked row"),
        "{:?}",
        text(&o)
    );
    assert_eq!(pending(&db)["pending"], 1);
    assert_eq!(pending(&db)["parked"], 0);
    let audit = rt.block_on(async {
        let pool = sqlx::SqlitePool::connect(&pool_url).await.unwrap();
        sqlx::query_as::<_, (String, String, String, i64)>(
            "SELECT action, target, reason, affected FROM idem_audit",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    });
    assert_eq!(
        audit,
        [(
            "outbox.retry".to_owned(),
            format!("outbox events {id}"),
            "topic created".to_owned(),
            1
        )],
        "the retry is audited"
    );
}

/// The subcommands `help` lists in `idem <path> --help`.
fn subcommands(path: &[&str]) -> Vec<String> {
    let mut args = path.to_vec();
    args.push("--help");
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

/// The operator tool knows nothing of the lab's reference pipeline: no help text names its
/// tables, its group or its effect, and no default stands in for the user's own.
#[test]
fn no_help_names_the_reference_pipeline() {
    let mut paths: Vec<Vec<String>> = vec![vec![]];
    let mut seen = 0;
    while let Some(path) = paths.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).collect();
        let mut help = args.clone();
        help.push("--help");
        let (out, err) = text(&idem(&help));
        assert!(!out.is_empty(), "idem {} --help: {err}", args.join(" "));
        // "crash points" are idem's own words.
        let lower = out.to_lowercase().replace("crash points", "crash-sites");
        for word in ["points", "settlement", "orders", "order.paid"] {
            assert!(
                !lower.contains(word),
                "`idem {} --help` names the reference pipeline ({word}):\n{out}",
                args.join(" ")
            );
        }
        seen += 1;
        for sub in subcommands(&args) {
            let mut next = path.clone();
            next.push(sub);
            paths.push(next);
        }
    }
    assert!(seen > 20, "only {seen} help pages were read");
}

/// Every flag of every command that takes a length of time takes it in the one syntax
/// (`500ms`, `30s`, `5m`, `1h`, `7d`): none is named for a unit (`--timeout-secs`,
/// `--lock-timeout-ms`), and `--timeout 2s` or `--retention 1d` is read by every command alike.
#[test]
fn no_flag_is_named_for_a_unit_of_time() {
    let mut paths: Vec<Vec<String>> = vec![vec![]];
    let mut flags = 0;
    while let Some(path) = paths.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).chain(["--help"]).collect();
        let (out, _) = text(&idem(&args));
        for flag in out.split_whitespace().filter(|w| w.starts_with("--")) {
            let name = flag.trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
            flags += 1;
            for unit in [
                "-ms", "-millis", "-secs", "-seconds", "-minutes", "-hours", "-days",
            ] {
                assert!(
                    !name.ends_with(unit),
                    "`idem {}` has {name}: take a duration (`30s`) instead",
                    path.join(" ")
                );
            }
        }
        for sub in subcommands(&path.iter().map(String::as_str).collect::<Vec<_>>()) {
            let mut next = path.clone();
            next.push(sub);
            paths.push(next);
        }
    }
    assert!(flags > 100, "only {flags} flags were read");
}

/// A topic mapping Kafka cannot take is refused before anything connects, by both relays (the
/// broker address is a closed port: a relay that got as far as the broker would say so).
#[test]
fn a_topic_mapping_kafka_cannot_take_is_refused_at_start() {
    let db = sqlite();
    for args in [
        vec![
            "relay",
            "--db",
            &db.url,
            "--brokers",
            "127.0.0.1:1",
            "--topic",
            "order=my topic",
        ],
        vec![
            "relay",
            "--db",
            &db.url,
            "--brokers",
            "127.0.0.1:1",
            "--topic-prefix",
            "events/",
        ],
        vec![
            "cdc",
            "relay",
            "--db",
            "postgres://nobody@127.0.0.1:1/none",
            "--brokers",
            "127.0.0.1:1",
            "--topic",
            "order=my topic",
        ],
    ] {
        let o = idem(&args);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("--topic-prefix / --topic"), "{args:?}: {err}");
    }
}

/// The shell and TOML blocks of a markdown file: (language, text).
fn blocks(markdown: &str) -> Vec<(String, String)> {
    let mut out = vec![];
    let mut parts = markdown.split("```");
    parts.next();
    while let (Some(block), _) = (parts.next(), parts.next()) {
        let (lang, body) = block.split_once('\n').unwrap_or((block, ""));
        out.push((lang.trim().to_owned(), body.to_owned()));
    }
    out
}

/// The `idem` command lines of a shell block, continuations joined and comments dropped.
fn idem_lines(sh: &str) -> Vec<String> {
    let mut out = vec![];
    let mut line = String::new();
    for l in sh.lines() {
        let l = l.split(" #").next().unwrap().trim_end();
        match l.strip_suffix('\\') {
            Some(head) => line.push_str(head),
            None => {
                line.push_str(l);
                let done = std::mem::take(&mut line);
                if done.trim_start().starts_with("idem ") {
                    out.push(done.trim().trim_end_matches('&').trim().to_owned());
                }
            }
        }
    }
    out
}

fn doc(rel: &str) -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    std::fs::read_to_string(root.join(rel)).unwrap()
}

/// Every `idem` command the README and the walkthrough show exists, with each flag it is
/// given: `idem <subcommand> --help` lists them. A renamed flag fails here, not in a newcomer's
/// shell.
#[test]
fn every_idem_command_the_docs_show_exists_with_its_flags() {
    let mut checked = 0;
    for file in ["README.md", "docs/integrating/walkthrough.md"] {
        for (_, sh) in blocks(&doc(file)).into_iter().filter(|(l, _)| l == "sh") {
            for line in idem_lines(&sh) {
                let words: Vec<&str> = line.split_whitespace().skip(1).collect();
                let path: Vec<&str> = words
                    .iter()
                    .take_while(|w| !w.starts_with('-'))
                    .copied()
                    .collect();
                let help = idem(&path.iter().copied().chain(["--help"]).collect::<Vec<_>>());
                let (out, err) = text(&help);
                assert!(help.status.success(), "{file}: `{line}`: {err}");
                // The flags the help declares: an option line starts with them.
                let declared: Vec<&str> = out
                    .lines()
                    .map(str::trim_start)
                    .filter(|l| l.starts_with('-'))
                    .flat_map(|l| l.split([' ', ',']).filter(|w| w.starts_with("--")))
                    .collect();
                for flag in words.iter().filter(|w| w.starts_with("--")) {
                    let flag = flag.split('=').next().unwrap();
                    assert!(
                        declared.contains(&flag),
                        "{file}: `{line}`: `idem {}` has no {flag}",
                        path.join(" ")
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 12, "only {checked} command lines checked");
}

/// The walkthrough's `verify.toml` is a config `idem verify --config` accepts.
#[test]
fn the_walkthroughs_verify_config_parses() {
    let tomls: Vec<String> = blocks(&doc("docs/integrating/walkthrough.md"))
        .into_iter()
        .filter(|(l, _)| l == "toml")
        .map(|(_, t)| t)
        .filter(|t| t.contains("[[check]]"))
        .collect();
    assert_eq!(tomls.len(), 1);
    let config = idem_verify::VerifyConfig::from_toml(&tomls[0]).unwrap();
    assert_eq!(config.checks.len(), 1);
}

/// A dead letter seeded by hand: its offset, event id, payload and replay outcome.
struct Letter(
    i64,
    Option<&'static str>,
    &'static str,
    Option<&'static str>,
);

/// Three letters of group `settlement`: #1 replayable, #2 without an event id (undecodable),
/// #3 applied by a replay before (closed).
async fn seed_dead_letters(db: &Db) -> sqlx::SqlitePool {
    let pool = sqlx::SqlitePool::connect(&db.url).await.unwrap();
    let insert = "INSERT INTO idem_dead_letters (consumer_group, topic, record_partition, record_offset, \
         event_id, event_type, reason, record_key, payload, headers, replay_outcome) \
         VALUES ('settlement', 'outbox.event.order', 0, ?1, ?2, 'order.paid', 'the order is unknown', 'o-1', ?3, ?4, ?5)";
    let id = "0190a7c2-5b1e-7c3d-9f00-000000000001";
    let headers = serde_json::json!({
        "ce_id": id, "ce_type": "order.paid",
        "idem_aggregate_type": "order", "idem_aggregate_id": "o-1",
    });
    let order = r#"{"order_id":"o-1"}"#;
    for Letter(offset, event, payload, outcome) in [
        Letter(1, Some(id), order, None),
        Letter(2, None, "{}", None),
        Letter(3, Some(id), order, Some("applied")),
    ] {
        let headers = if event.is_some() {
            headers.to_string()
        } else {
            "{}".into()
        };
        sqlx::query(insert)
            .bind(offset)
            .bind(event)
            .bind(payload)
            .bind(headers)
            .bind(outcome)
            .execute(&pool)
            .await
            .unwrap();
    }
    pool
}

/// `idem dead-letters replay` without `--confirm` is a dry run: it decodes each open letter as
/// the consumer would and changes nothing. `--confirm` records a request on each open letter
/// (the group's running consumer serves it); with `--wait 0s` it returns at once, saying the
/// requests wait for a consumer, and `idem dead-letters` shows them. A letter that is not open
/// cannot be requested by id; `--id` or `--all` is required.
#[test]
fn a_replay_is_a_dry_run_until_confirmed_and_a_confirmed_one_is_requested() {
    let db = sqlite();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pool = rt.block_on(seed_dead_letters(&db));
    let requested = || {
        rt.block_on(
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM idem_dead_letters WHERE replay_requested_at IS NOT NULL",
            )
            .fetch_one(&pool),
        )
        .unwrap()
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

    let o = replay(&["--all"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains("#1 ") && out.contains("would replay"), "{out}");
    assert!(
        out.contains("#2 ") && out.contains("not replayable (undecodable)"),
        "{out}"
    );
    assert!(!out.contains("#3 "), "a closed letter is not listed: {out}");
    assert!(out.contains("add --confirm to hand 2 letter(s)"), "{out}");
    assert_eq!(requested(), 0, "the dry run changed nothing");
    let o = replay(&["--all", "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(rows[0]["outcome"], "would_replay", "{rows}");
    assert_eq!(rows[1]["outcome"], "undecodable", "{rows}");

    let o = replay(&["--all", "--confirm", "--by", "on-call", "--wait", "0s"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(
        err.contains("2 of 2 replay(s) requested and not served yet"),
        "{err}"
    );
    assert_eq!(requested(), 2);
    let audited = rt
        .block_on(
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM idem_audit WHERE action = 'dead_letters.replay' \
                 AND actor = 'on-call' AND affected = 2",
            )
            .fetch_one(&pool),
        )
        .unwrap();
    assert_eq!(
        audited, 1,
        "the confirmed replay is audited, the dry runs are not"
    );
    let o = idem(&["dead-letters", "--db", &db.url, "--group", "settlement"]);
    let (out, _) = text(&o);
    assert_eq!(out.matches("replay requested at").count(), 2, "{out}");
    assert!(out.contains("by on-call"), "{out}");

    let o = replay(&["--id", "3", "--confirm"]);
    assert!(!o.status.success());
    assert!(
        text(&o).1.contains("no open dead letter #3"),
        "{:?}",
        text(&o)
    );
    let o = replay(&["--id", "1", "--confirm", "--wait", "1s"]);
    assert!(!o.status.success(), "no consumer served it");
    assert!(
        text(&o).1.contains("stay requested until one runs"),
        "{:?}",
        text(&o)
    );
    let o = replay(&[]);
    assert!(!o.status.success(), "--id or --all is required");
}

/// `idem effects resolve` and `idem effects retry` settle stuck intents and write the same
/// audit rows as the console's buttons: who, what, why, how many rows.
#[test]
fn settling_stuck_intents_from_the_cli_is_audited() {
    let db = sqlite();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pool = rt.block_on(async {
        let pool = sqlx::SqlitePool::connect(&db.url).await.unwrap();
        for (key, status) in [("k-1", "unknown"), ("k-2", "parked"), ("k-3", "done")] {
            sqlx::query(
                "INSERT INTO idem_effect_intents (idem_key, effect, target, event_id, body, status) \
                 VALUES (?1, 'points.award', 'http://127.0.0.1:9/awards', 'e', '{}', ?2)",
            )
            .bind(key)
            .bind(status)
            .execute(&pool)
            .await
            .unwrap();
        }
        pool
    });
    let statuses = || {
        rt.block_on(
            sqlx::query_scalar::<_, String>("SELECT status FROM idem_effect_intents ORDER BY id")
                .fetch_all(&pool),
        )
        .unwrap()
    };
    let audit = || {
        rt.block_on(
            sqlx::query_as::<_, (String, String, String, i64)>(
                "SELECT action, target, reason, affected FROM idem_audit ORDER BY id",
            )
            .fetch_all(&pool),
        )
        .unwrap()
    };
    let o = idem(&[
        "effects",
        "resolve",
        "--db",
        &db.url,
        "--id",
        "1",
        "--applied",
        "--note",
        "the award is on the remote's page",
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let o = idem(&[
        "effects",
        "retry",
        "--db",
        &db.url,
        "--id",
        "2",
        "--reason",
        "remote back",
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    assert_eq!(statuses(), ["done", "pending", "done"]);
    let o = idem(&[
        "effects",
        "resolve",
        "--db",
        &db.url,
        "--id",
        "3",
        "--applied",
    ]);
    assert!(!o.status.success(), "a done intent is not resolved again");
    assert_eq!(
        audit(),
        [
            (
                "effects.applied".to_owned(),
                "effect intent 1".to_owned(),
                "the award is on the remote's page".to_owned(),
                1
            ),
            (
                "effects.retry".to_owned(),
                "effect intents [2]".to_owned(),
                "remote back".to_owned(),
                1
            ),
        ],
        "each change is audited, the refusal is not"
    );
}

/// `idem console` refuses, before serving, what would expose it or fail later: a non-loopback
/// address without --allow-remote, --allow-remote without a token, a compensation without its
/// effect, a CA bundle it cannot read.
#[test]
fn the_console_refuses_unsafe_or_broken_settings_at_start() {
    let db = sqlite();
    let refused = |extra: &[&str], says: &str| {
        let mut args = vec!["console", "--db", &db.url, "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        let o = idem(&args);
        let (out, err) = text(&o);
        assert!(!o.status.success(), "{extra:?} started: {out}{err}");
        assert!(err.contains(says), "{extra:?}: {err}");
    };
    refused(&["--listen", "0.0.0.0:0"], "loopback only");
    refused(
        &["--listen", "0.0.0.0:0", "--allow-remote"],
        "--allow-remote needs --token",
    );
    refused(
        &["--compensate-url", "http://127.0.0.1:9/reversal"],
        "--effect",
    );
    refused(
        &[
            "--effect",
            "points.award",
            "--compensate-url",
            "http://127.0.0.1:9/reversal",
            "--ca-bundle",
            "/nonexistent/ca.pem",
        ],
        "/nonexistent/ca.pem",
    );
}
