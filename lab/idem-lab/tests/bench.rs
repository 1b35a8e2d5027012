//! `idem-lab bench` runs end to end in a tiny configuration (PostgreSQL, the suite's Apache Kafka
//! broker, the relay and settlement as child processes) and reports every figure and ratio. Not
//! a performance test: nothing here asserts a timing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use serde_json::Value;

const FIGURES: &[&str] = &[
    "round_trip_us",
    "pg_insert_1conn_per_s",
    "pg_insert_nconn_per_s",
    "ceiling_relay_per_s",
    "ceiling_consumer_1conn_per_s",
    "ceiling_consumer_partitions_per_s",
    "ceiling_writers_per_s",
    "kafka_produce_per_s",
    "kafka_consume_per_s",
    "business_tx_1conn_per_s",
    "business_tx_outbox_1conn_per_s",
    "business_tx_nconn_per_s",
    "business_tx_outbox_nconn_per_s",
    "business_tx_plain_1conn_per_s",
    "business_tx_plain_nconn_per_s",
    "business_tx_message_1conn_per_s",
    "business_tx_message_nconn_per_s",
    "business_tx_message_separate_1conn_per_s",
    "business_tx_message_separate_nconn_per_s",
    "relay_drain_per_s",
    "ceiling_cdc_produce_per_s",
    "ceiling_cdc_decode_per_s",
    "cdc_drain_per_s",
    "cdc_peak_rss_mib",
    "ceiling_cdc_produce_cpu_us_per_row",
    "cdc_drain_cpu_us_per_row",
    "cdc_relay_cpu_us_per_row",
    "cdc_walsender_cpu_us_per_row",
    "cdc_drain_cpu_bound_per_s",
    "relay_peak_rss_mib",
    "consumer_drain_per_s",
    "consumer_peak_rss_mib",
    "consumer_no_inbox_drain_per_s",
    "duplicates_drain_per_s",
    "e2e_writers_per_s",
    "e2e_sustained_per_s",
];

const LATENCY: &[&str] = &[
    "target_per_s",
    "rate_per_s",
    "p50_ms",
    "p99_ms",
    "p999_ms",
    "max_ms",
    "samples",
    "unsettled",
    "relay_stage_p50_ms",
    "relay_stage_p99_ms",
    "consumer_stage_p50_ms",
    "consumer_stage_p99_ms",
];

/// Sampled on each side of the phase they bound: their spread is reported.
const SAMPLED: &[&str] = &[
    "round_trip_us",
    "ceiling_relay_per_s",
    "kafka_produce_per_s",
    "ceiling_consumer_1conn_per_s",
    "ceiling_consumer_partitions_per_s",
    "ceiling_writers_per_s",
    "business_tx_nconn_per_s",
    "business_tx_outbox_nconn_per_s",
    "business_tx_message_nconn_per_s",
    "business_tx_message_separate_nconn_per_s",
    "ceiling_cdc_produce_per_s",
    "ceiling_cdc_decode_per_s",
    "ceiling_cdc_produce_cpu_us_per_row",
];

const RATIOS: &[&str] = &[
    "consumer_drain_vs_ceiling",
    "consumer_drain_vs_ceiling_partitions",
    "relay_drain_vs_ceiling",
    "sustained_vs_writers_alone",
    "outbox_tx_1conn",
    "outbox_tx_nconn",
    "dedup_vs_no_dedup",
    "latency_p99_at_50pct_ms",
    "relay_peak_rss_mib",
    "consumer_peak_rss_mib",
    "outbox_vs_plain_row_1conn",
    "outbox_vs_plain_row_nconn",
    "duplicates_vs_drain",
    "cdc_drain_vs_produce",
    "cdc_drain_vs_ceiling",
    "cdc_cpu_bound_vs_produce",
    "cdc_floor_vs_produce",
    "cdc_drain_vs_cpu_bound",
    "message_tx_nconn",
    "message_tx_1conn",
    "message_separate_tx_nconn",
    "cdc_peak_rss_mib",
];

fn idem_bench(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_idem-lab"))
        .arg("bench")
        .args(args)
        .args(["--db", &idem_conformance::pg::admin_url(), "--json"])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "idem bench {args:?} failed:\n{stderr}"
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", String::from_utf8_lossy(&out.stdout)))
}

/// A tiny run's arguments on the suite's broker, then `extra`.
fn tiny(brokers: &str, extra: &[&str]) -> Vec<String> {
    let args: Vec<String> = [
        "--brokers",
        brokers,
        "--backlog",
        "300",
        "--batch-size",
        "50",
        "--relay-batch-size",
        "100",
        "--phase",
        "500ms",
        "--connections",
        "2",
    ]
    .iter()
    .chain(extra)
    .map(|s| (*s).to_owned())
    .collect();
    args
}

#[test]
fn a_tiny_bench_run_reports_every_figure_and_ratio() {
    let brokers = idem_conformance::kafka::shared();
    let args = tiny(&brokers, &[]);
    let report = idem_bench(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let figures = &report["figures"];
    let mut expected: Vec<String> = FIGURES.iter().map(|s| (*s).to_owned()).collect();
    for pct in [25, 50, 80] {
        expected.extend(LATENCY.iter().map(|s| format!("latency_{pct}pct_{s}")));
    }
    for key in &expected {
        assert!(
            figures[key].is_number(),
            "figure {key} missing or not a number in {figures:#}"
        );
    }
    assert!(figures["relay_drain_per_s"].as_f64().unwrap() > 0.0);
    assert!(figures["relay_peak_rss_mib"].as_f64().unwrap() > 1.0);
    assert!(figures["cdc_drain_per_s"].as_f64().unwrap() > 0.0);
    assert!(figures["cdc_peak_rss_mib"].as_f64().unwrap() > 1.0);
    // The relay process's own start (connections, the producer) costs CPU.
    assert!(figures["cdc_relay_cpu_us_per_row"].as_f64().unwrap() > 0.0);
    assert!(figures["cdc_drain_cpu_bound_per_s"].as_f64().unwrap() > 0.0);
    // Two runs of each ceiling on each side of its phase (the default).
    for key in SAMPLED {
        let s = &report["spread"][key];
        let samples = s["samples"].as_array().map_or(0, Vec::len);
        assert!(samples >= 2, "spread of {key}: {s}");
        let (min, median, max) = (s["min"].as_f64(), s["median"].as_f64(), s["max"].as_f64());
        assert!(min <= median && median <= max, "spread of {key}: {s}");
        assert_eq!(
            figures[key].as_f64(),
            median,
            "{key}: the figure is the median"
        );
    }
    assert_eq!(
        report["spread"]["ceiling_relay_per_s"]["samples"]
            .as_array()
            .map(Vec::len),
        Some(4)
    );
    let phases = report["phases"].as_object().unwrap();
    assert_eq!(phases.len(), 23, "{phases:#?}");
    for (phase, p) in phases {
        assert_eq!(p["status"], "done", "phase {phase}: {p}");
    }
    for key in RATIOS {
        let r = &report["ratios"][key];
        assert!(r["value"].is_number(), "ratio {key}: {r}");
        assert!(r["bound"].is_string(), "ratio {key}: {r}");
        assert!(r["target"].is_string(), "ratio {key}: {r}");
        assert!(r["met"].is_boolean(), "ratio {key}: {r}");
    }
    assert!(report["targets_met"].is_boolean());
    assert_eq!(report["config"]["backlog"], 300);
    assert_eq!(report["environment"]["broker"], "external", "{report:#}");
}

/// A hostile session locks every outbox row while the relay republishes: that phase makes no
/// progress, is reported failed with its reason, the duplicates that need it are skipped, and
/// the run still measures the rest and exits with its report (at main it waited out the drain
/// timeout and then failed the whole run).
#[test]
fn a_stuck_phase_is_reported_and_the_run_goes_on() {
    let brokers = idem_conformance::kafka::shared();
    let args = tiny(
        &brokers,
        &[
            "--stall",
            "10s",
            "--ceiling-runs",
            "1",
            "--lock-outbox-during-republish",
        ],
    );
    let report = idem_bench(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let phases = &report["phases"];
    assert_eq!(phases["republish"]["status"], "failed", "{phases:#}");
    let why = phases["republish"]["reason"].as_str().unwrap();
    assert!(why.contains("no progress"), "{why}");
    assert_eq!(phases["duplicates"]["status"], "skipped", "{phases:#}");
    for later in ["writers_before", "sustained", "writers_after", "latency"] {
        assert_eq!(phases[later]["status"], "done", "{later}: {phases:#}");
    }
    let figures = &report["figures"];
    assert!(figures["duplicates_drain_per_s"].is_null(), "{figures:#}");
    assert!(figures["e2e_sustained_per_s"].is_number(), "{figures:#}");
    assert!(report["ratios"]["duplicates_vs_drain"]["value"].is_null());
    assert_eq!(report["ratios"]["duplicates_vs_drain"]["met"], false);
    assert_eq!(report["targets_met"], false);
}

#[test]
fn bench_verify_reports_time_and_peak_memory() {
    let report = idem_bench(&["verify", "--rows", "2000"]);
    assert_eq!(report["rows_per_side"], 2000);
    for key in ["verify_seconds", "verify_rows_per_s", "verify_peak_rss_mib"] {
        assert!(report["figures"][key].is_number(), "{key}: {report}");
    }
    assert!(report["figures"]["verify_peak_rss_mib"].as_f64().unwrap() > 1.0);
    assert!(report["ratios"]["verify_peak_rss_mib"]["met"].is_boolean());
}

#[test]
fn bench_claims_drains_every_shape_and_depth_between_two_lean_drains() {
    let report = idem_bench(&["claims", "--depths", "2000,3000", "--batch-size", "100"]);
    let drains = report["drains"].as_array().unwrap();
    let seen: Vec<(String, u64)> = drains
        .iter()
        .map(|d| {
            (
                d["shape"].as_str().unwrap().to_owned(),
                d["depth"].as_u64().unwrap(),
            )
        })
        .collect();
    let mut expected = vec![];
    for depth in [2000, 3000] {
        for shape in ["single", "round-robin", "grouped", "deep"] {
            expected.push((shape.to_owned(), depth));
        }
    }
    assert_eq!(seen, expected, "{report:#}");
    for d in drains {
        for key in [
            "lean_before_per_s",
            "store_per_s",
            "lean_after_per_s",
            "ratio",
        ] {
            assert!(d[key].as_f64().unwrap() > 0.0, "{key}: {d}");
        }
        let share = d["store_claim_share"].as_f64().unwrap();
        assert!(share > 0.0 && share < 1.0, "{d}");
    }
}

#[test]
fn bench_console_times_every_page_and_drops_its_database() {
    let sizes = [
        ("--outbox-rows", "3000"),
        ("--pending-rows", "200"),
        ("--parked-rows", "100"),
        ("--inbox-rows", "3000"),
        ("--dead-letters", "600"),
        ("--effect-intents", "1000"),
        ("--unknown-intents", "50"),
        ("--parked-intents", "50"),
        ("--audit-rows", "100"),
        ("--requests", "5"),
        ("--warmup", "1"),
        ("--spread", "0s"),
    ];
    let child = Command::new(env!("CARGO_BIN_EXE_idem-lab"))
        .args([
            "bench",
            "console",
            "--json",
            "--db",
            &idem_conformance::pg::admin_url(),
        ])
        .args(sizes.iter().flat_map(|(k, v)| [k, v]))
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "idem-lab bench console failed:\n{stderr}"
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let pages = report["pages"].as_array().unwrap();
    assert!(pages.len() >= 12, "{report:#}");
    for page in pages.iter().chain(report["floors"].as_array().unwrap()) {
        assert!(page["failed"].is_null(), "{page}");
        assert!(page["p99_ms"].as_f64().unwrap() > 0.0, "{page}");
    }
    for page in pages {
        assert!(page["bytes"].as_u64().unwrap() > 0, "{page}");
    }
    for (key, ratio) in report["ratios"].as_object().unwrap() {
        assert!(ratio["met"].is_boolean(), "{key}: {ratio}");
    }
    assert_eq!(
        report["targets"]["letter_group"], "settlement",
        "{report:#}"
    );
    let left: i64 = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let pool = sqlx::PgPool::connect(&idem_conformance::pg::admin_url())
            .await
            .unwrap();
        sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname LIKE $1")
            .bind(format!("idem\\_bench\\_{pid}\\_%"))
            .fetch_one(&pool)
            .await
            .unwrap()
    });
    assert_eq!(left, 0, "the bench left its database behind");
}

/// The bench over TLS: every Kafka client of the run (the children, the raw produce and consume
/// ceilings, the topics' admin client) logs in with SCRAM over TLS to a broker that has no other
/// listener, and every PostgreSQL session (the bench's own, the children's pools, the CDC
/// relay's walsender) is encrypted under `verify-full`. The password given in a file appears in
/// no output and not in the report.
#[test]
fn a_tiny_bench_run_over_tls_uses_tls_for_every_client() {
    use idem_conformance::kafka::{Security, secured};
    let k = secured(Security::SaslSsl);
    let (user, password) = k.user("SCRAM-SHA-512");
    let dir = tempfile::tempdir().unwrap();
    let password_file = dir.path().join("kafka-password");
    std::fs::write(&password_file, format!("{password}\n")).unwrap();
    let ca = idem_conformance::pg::PgTlsMaterial::get().ca();
    let db = format!(
        "{}?sslmode=verify-full&sslrootcert={ca}",
        idem_conformance::pg::admin_url().split('?').next().unwrap()
    );
    let args = tiny(k.brokers(), &["--ceiling-runs", "1", "--db", &db, "--json"]);
    let out = Command::new(env!("CARGO_BIN_EXE_idem-lab"))
        .arg("bench")
        .args(&args)
        .env("RUST_LOG", "warn")
        .env("IDEM_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
        .env("IDEM_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
        .env("IDEM_KAFKA_SASL_USERNAME", &user)
        .env("IDEM_KAFKA_SASL_PASSWORD_FILE", &password_file)
        .env("IDEM_KAFKA_SSL_CA", k.pki("ca.pem"))
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "idem bench over TLS failed:\n{stderr}"
    );
    assert!(!stdout.contains(&password) && !stderr.contains(&password));
    let report: Value = serde_json::from_str(&stdout).unwrap();
    for (phase, p) in report["phases"].as_object().unwrap() {
        assert_eq!(p["status"], "done", "phase {phase}: {p}");
    }
    let security = &report["config"]["kafka_security"];
    assert_eq!(security["protocol"], "SASL_SSL", "{security}");
    assert_eq!(security["sasl_mechanism"], "SCRAM-SHA-512", "{security}");
    assert_eq!(report["config"]["postgres_sslmode"], "verify-full");
    let env = &report["environment"];
    assert!(
        env["postgres_tls_bench"]
            .as_str()
            .unwrap()
            .starts_with("TLS"),
        "{env}"
    );
    for key in ["postgres_tls_cdc_drain", "postgres_tls_sustained"] {
        let census = env[key].as_str().unwrap();
        let (encrypted, all) = census.split_once(" of ").unwrap();
        let all = all.trim_end_matches(" encrypted");
        assert!(encrypted == all && all != "0", "{key}: {census}");
    }
    assert!(
        k.broker_log().contains(&format!("User:{user}")),
        "the broker logged no request of {user}"
    );
}
