//! Figures, ratios against the same run's baselines, and their table and JSON forms.

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::RunArgs;
use super::latency::LatencyRun;

/// Every figure of a full run: key, label, unit. `{n}`, `{b}` and `{r}` stand for the
/// connections, the consumer batch size and the relay batch size.
pub const FIGURES: &[(&str, &str, &str)] = &[
    (
        "pg_insert_1conn_per_s",
        "PostgreSQL durable single-row insert, 1 connection",
        "rows/s",
    ),
    (
        "pg_insert_nconn_per_s",
        "PostgreSQL durable single-row insert, {n} connections",
        "rows/s",
    ),
    (
        "consumer_sql_per_s",
        "consumer SQL directly: inbox insert + settlement, batch {b}",
        "events/s",
    ),
    (
        "consumer_sql_no_inbox_per_s",
        "consumer SQL directly: settlement only, batch {b}",
        "events/s",
    ),
    (
        "relay_sql_per_s",
        "relay claim-and-mark SQL directly, batch {r}",
        "rows/s",
    ),
    (
        "kafka_produce_per_s",
        "raw rdkafka produce (idempotent, acks=all)",
        "records/s",
    ),
    ("kafka_consume_per_s", "raw rdkafka consume", "records/s"),
    (
        "business_tx_1conn_per_s",
        "business transaction, 1 connection",
        "tx/s",
    ),
    (
        "business_tx_outbox_1conn_per_s",
        "business transaction + outbox insert, 1 connection",
        "tx/s",
    ),
    (
        "business_tx_plain_1conn_per_s",
        "business transaction + plain second row, 1 connection",
        "tx/s",
    ),
    (
        "business_tx_nconn_per_s",
        "business transaction, {n} connections",
        "tx/s",
    ),
    (
        "business_tx_outbox_nconn_per_s",
        "business transaction + outbox insert, {n} connections",
        "tx/s",
    ),
    (
        "business_tx_plain_nconn_per_s",
        "business transaction + plain second row, {n} connections",
        "tx/s",
    ),
    (
        "relay_drain_per_s",
        "relay drain of the backlog (idem relay)",
        "rows/s",
    ),
    ("relay_peak_rss_mib", "relay peak RSS while draining", "MiB"),
    (
        "consumer_drain_per_s",
        "consumer drain of the backlog (idem settlement)",
        "events/s",
    ),
    (
        "consumer_peak_rss_mib",
        "consumer peak RSS while draining",
        "MiB",
    ),
    (
        "consumer_no_inbox_drain_per_s",
        "consumer drain without the inbox",
        "events/s",
    ),
    (
        "duplicates_drain_per_s",
        "consumer drain of 100 % redelivered duplicates",
        "events/s",
    ),
    (
        "e2e_writers_per_s",
        "orders written during the sustained run ({n} writers)",
        "orders/s",
    ),
    (
        "e2e_sustained_per_s",
        "sustained end to end (order committed → settled)",
        "orders/s",
    ),
];

/// Load levels of the latency runs, percent of the sustained rate.
pub const LOADS: [u32; 3] = [25, 50, 80];

#[derive(Clone, Copy, Debug)]
enum Target {
    AtLeast(f64),
    AtMost(f64),
    /// Explains another figure; no target.
    Info,
}

impl Target {
    fn met(self, v: f64) -> bool {
        match self {
            Target::AtLeast(t) => v >= t,
            Target::AtMost(t) => v <= t,
            Target::Info => true,
        }
    }

    fn text(self) -> String {
        match self {
            Target::AtLeast(t) => format!(">= {t}"),
            Target::AtMost(t) => format!("<= {t}"),
            Target::Info => "-".to_owned(),
        }
    }
}

/// The ratios: key, label, target.
const RATIOS: &[(&str, &str, Target)] = &[
    (
        "consumer_drain_vs_sql",
        "consumer drain / its SQL at batch {b}",
        Target::AtLeast(0.8),
    ),
    (
        "relay_drain_vs_limit",
        "relay drain / min(claim-and-mark SQL, raw produce)",
        Target::AtLeast(0.8),
    ),
    (
        "outbox_tx_1conn",
        "business tx with outbox / without, 1 connection",
        Target::AtLeast(0.9),
    ),
    (
        "outbox_tx_nconn",
        "business tx with outbox / without, {n} connections",
        Target::AtLeast(0.9),
    ),
    (
        "dedup_vs_no_dedup",
        "consumer drain with inbox / without",
        Target::AtLeast(0.75),
    ),
    (
        "latency_p99_at_50pct_ms",
        "commit → settlement p99 at 50 % load, ms",
        Target::AtMost(50.0),
    ),
    (
        "relay_peak_rss_mib",
        "relay peak RSS, MiB",
        Target::AtMost(150.0),
    ),
    (
        "consumer_peak_rss_mib",
        "consumer peak RSS, MiB",
        Target::AtMost(150.0),
    ),
    (
        "outbox_vs_plain_row_1conn",
        "business tx with outbox / with a plain second row, 1 connection",
        Target::Info,
    ),
    (
        "outbox_vs_plain_row_nconn",
        "business tx with outbox / with a plain second row, {n} connections",
        Target::Info,
    ),
    (
        "duplicates_vs_drain",
        "consumer drain of duplicates / of new events",
        Target::Info,
    ),
];

/// What a run measured.
pub struct Report {
    config: Value,
    environment: serde_json::Map<String, Value>,
    figures: Vec<(String, f64)>,
    ratios: Vec<(&'static str, String, Option<f64>, Target)>,
    n: u32,
    b: usize,
    r: u32,
}

impl Report {
    /// An empty report of a run with `args` against `broker`.
    pub fn new(args: &RunArgs, broker: &str) -> Self {
        let mut environment = serde_json::Map::new();
        environment.insert("broker".into(), json!(broker));
        environment.insert(
            "cores".into(),
            json!(std::thread::available_parallelism().map_or(0, |n| n.get())),
        );
        environment.insert("load_average_at_start".into(), json!(load_average()));
        Report {
            config: json!({
                "backlog": args.backlog,
                "batch_size": args.batch_size,
                "relay_batch_size": args.relay_batch_size,
                "message_size": args.message_size,
                "seconds": args.seconds,
                "connections": args.connections,
                "partitions": args.partitions,
                "brokers": args.brokers,
                "consumer_config": args.consumer_config.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>(),
                "producer_config": args.producer_config.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>(),
            }),
            environment,
            figures: vec![],
            ratios: vec![],
            n: args.connections,
            b: args.batch_size,
            r: args.relay_batch_size,
        }
    }

    /// Notes a fact about the machine.
    pub fn environment(&mut self, key: &str, value: &str) {
        self.environment.insert(key.into(), json!(value));
    }

    /// Records a figure.
    pub fn figure(&mut self, key: &str, value: f64) {
        self.figures.push((key.to_owned(), value));
    }

    /// Records a peak RSS in bytes as MiB (NaN if it could not be read).
    pub fn peak(&mut self, key: &str, bytes: Option<u64>) {
        self.figure(key, bytes.map_or(f64::NAN, |b| b as f64 / 1048576.0));
    }

    /// Records one latency run.
    pub fn latency(&mut self, pct: u32, run: &LatencyRun) {
        for (suffix, value) in [
            ("target_per_s", run.target_rate),
            ("rate_per_s", run.achieved_rate),
            ("p50_ms", run.p50_ms),
            ("p99_ms", run.p99_ms),
            ("p999_ms", run.p999_ms),
            ("max_ms", run.max_ms),
            ("samples", run.samples as f64),
            ("unsettled", run.unsettled as f64),
            ("relay_stage_p50_ms", run.relay_stage_ms.0),
            ("relay_stage_p99_ms", run.relay_stage_ms.1),
            ("consumer_stage_p50_ms", run.consumer_stage_ms.0),
            ("consumer_stage_p99_ms", run.consumer_stage_ms.1),
        ] {
            self.figure(&format!("latency_{pct}pct_{suffix}"), value);
        }
    }

    fn get(&self, key: &str) -> Option<f64> {
        self.figures
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| *v)
            .filter(|v| v.is_finite())
    }

    fn label(&self, s: &str) -> String {
        s.replace("{n}", &self.n.to_string())
            .replace("{b}", &self.b.to_string())
            .replace("{r}", &self.r.to_string())
    }

    /// Notes the load at the end and computes the ratios.
    pub fn finish(&mut self) {
        self.environment
            .insert("load_average_at_end".into(), json!(load_average()));
        self.ratios = self.ratios();
    }

    /// Each of [`RATIOS`] from the figures: `None` where a figure is missing or a divisor is
    /// not positive.
    fn ratios(&self) -> Vec<(&'static str, String, Option<f64>, Target)> {
        let div = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        let limit = match (self.get("relay_sql_per_s"), self.get("kafka_produce_per_s")) {
            (Some(a), Some(b)) => Some(a.min(b)),
            _ => None,
        };
        let values = [
            div(
                self.get("consumer_drain_per_s"),
                self.get("consumer_sql_per_s"),
            ),
            div(self.get("relay_drain_per_s"), limit),
            div(
                self.get("business_tx_outbox_1conn_per_s"),
                self.get("business_tx_1conn_per_s"),
            ),
            div(
                self.get("business_tx_outbox_nconn_per_s"),
                self.get("business_tx_nconn_per_s"),
            ),
            div(
                self.get("consumer_drain_per_s"),
                self.get("consumer_no_inbox_drain_per_s"),
            ),
            self.get("latency_50pct_p99_ms"),
            self.get("relay_peak_rss_mib"),
            self.get("consumer_peak_rss_mib"),
            div(
                self.get("business_tx_outbox_1conn_per_s"),
                self.get("business_tx_plain_1conn_per_s"),
            ),
            div(
                self.get("business_tx_outbox_nconn_per_s"),
                self.get("business_tx_plain_nconn_per_s"),
            ),
            div(
                self.get("duplicates_drain_per_s"),
                self.get("consumer_drain_per_s"),
            ),
        ];
        RATIOS
            .iter()
            .zip(values)
            .map(|((k, label, t), v)| (*k, self.label(label), v, *t))
            .collect()
    }

    /// The report as JSON: config, environment, figures, ratios (value, target, met).
    pub fn json(&self) -> Value {
        let figures: serde_json::Map<String, Value> = self
            .figures
            .iter()
            .map(|(k, v)| (k.clone(), number(*v)))
            .collect();
        let ratios: serde_json::Map<String, Value> = self
            .ratios
            .iter()
            .map(|(k, label, v, t)| {
                (
                    (*k).to_owned(),
                    json!({
                        "what": label,
                        "value": v.map_or(Value::Null, number),
                        "target": t.text(),
                        "met": v.is_some_and(|v| t.met(v)),
                    }),
                )
            })
            .collect();
        json!({
            "config": self.config,
            "environment": self.environment,
            "figures": figures,
            "ratios": ratios,
            "targets_met": self.ratios.iter().all(|(_, _, v, t)| v.is_some_and(|v| t.met(v))),
        })
    }

    /// The report as a table.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let env = |k: &str| {
            self.environment
                .get(k)
                .map(|v| v.to_string().trim_matches('"').to_owned())
                .unwrap_or_default()
        };
        let _ = writeln!(
            out,
            "idem bench: PostgreSQL {}, broker {}, {} cores, load average {} → {}",
            env("postgres"),
            env("broker"),
            env("cores"),
            env("load_average_at_start"),
            env("load_average_at_end"),
        );
        let _ = writeln!(out, "config: {}", self.config);
        let _ = writeln!(out);
        for (key, label, unit) in FIGURES {
            if let Some((_, v)) = self.figures.iter().find(|(k, _)| k == key) {
                let _ = writeln!(out, "  {:<66} {:>12} {unit}", self.label(label), fmt(*v));
            }
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "  commit → settlement latency, open loop   rate/s      p50      p99    p99.9      max   samples"
        );
        for pct in LOADS {
            let g = |s: &str| {
                self.figures
                    .iter()
                    .find(|(k, _)| *k == format!("latency_{pct}pct_{s}"))
                    .map_or(f64::NAN, |(_, v)| *v)
            };
            let _ = writeln!(
                out,
                "  at {pct:>2} % of sustained                  {:>9} {:>8} {:>8} {:>8} {:>8} {:>9}",
                fmt(g("rate_per_s")),
                fmt(g("p50_ms")),
                fmt(g("p99_ms")),
                fmt(g("p999_ms")),
                fmt(g("max_ms")),
                fmt(g("samples")),
            );
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "  {:<60} {:>8}  {:<8} result",
            "ratio", "value", "target"
        );
        for (_, label, v, t) in &self.ratios {
            let result = match v {
                Some(_) if matches!(t, Target::Info) => "",
                Some(v) if t.met(*v) => "met",
                Some(_) => "MISSED",
                None => "not measured",
            };
            let _ = writeln!(
                out,
                "  {:<60} {:>8}  {:<8} {result}",
                label,
                v.map_or("-".to_owned(), |v| format!("{v:.2}")),
                t.text()
            );
        }
        out
    }
}

fn number(v: f64) -> Value {
    if v.is_finite() {
        json!((v * 1000.0).round() / 1000.0)
    } else {
        Value::Null
    }
}

fn fmt(v: f64) -> String {
    if !v.is_finite() {
        "-".to_owned()
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ratio(r: &Report, key: &str) -> Option<f64> {
        r.ratios()
            .into_iter()
            .find(|(k, ..)| *k == key)
            .and_then(|(_, _, v, _)| v)
    }

    #[test]
    fn ratios_divide_each_figure_by_the_baseline_that_bounds_it() {
        let mut r = Report::new(&super::super::plan::sample_args(), "embedded");
        for (k, v) in [
            ("consumer_drain_per_s", 800.0),
            ("consumer_sql_per_s", 1000.0),
            ("relay_drain_per_s", 450.0),
            ("relay_sql_per_s", 600.0),
            ("kafka_produce_per_s", 500.0),
            ("consumer_no_inbox_drain_per_s", 0.0),
            ("latency_50pct_p99_ms", 12.5),
        ] {
            r.figure(k, v);
        }
        assert_eq!(ratio(&r, "consumer_drain_vs_sql"), Some(0.8));
        // The relay is bounded by the slower of its SQL and the raw produce.
        assert_eq!(ratio(&r, "relay_drain_vs_limit"), Some(0.9));
        assert_eq!(ratio(&r, "latency_p99_at_50pct_ms"), Some(12.5));
        // A zero divisor and a missing figure give no ratio.
        assert_eq!(ratio(&r, "dedup_vs_no_dedup"), None);
        assert_eq!(ratio(&r, "outbox_tx_1conn"), None);
        let labels: Vec<String> = r.ratios().into_iter().map(|(_, l, ..)| l).collect();
        assert_eq!(labels.len(), RATIOS.len());
        assert!(labels.contains(&"consumer drain / its SQL at batch 200".to_owned()));
        assert!(labels.contains(&"business tx with outbox / without, 4 connections".to_owned()));
    }

    #[test]
    fn targets_are_met_on_their_side_of_the_bound() {
        assert!(Target::AtLeast(0.8).met(0.8));
        assert!(!Target::AtLeast(0.8).met(0.79));
        assert!(Target::AtMost(50.0).met(50.0));
        assert!(!Target::AtMost(50.0).met(50.1));
        assert!(Target::Info.met(0.0));
    }
}
