//! Figures, the spread of the sampled ones, how each phase ended, ratios against the same run's
//! ceilings, and their table and JSON forms.

use std::fmt::Write as _;

use serde_json::{Value, json};

use std::time::Duration;

use super::RunArgs;
use super::latency::LatencyRun;
use super::plan::Phase;
use super::spread::{Outcome, Spread};
use crate::broker::SecuredMode;

/// Every figure of a full run: key, label, unit. `{n}`, `{b}`, `{r}` and `{p}` stand for the
/// connections, the consumer batch size, the relay batch size and the partitions. The
/// ceilings (keys starting `ceiling_`, `kafka_produce`, `round_trip`) and the business
/// transactions are sampled: the figure is their median, `spread` has min, median and max.
pub(super) const FIGURES: &[(&str, &str, &str)] = &[
    (
        "round_trip_us",
        "round trip of one statement (SELECT 1, 1 connection)",
        "µs",
    ),
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
        "business_tx_message_1conn_per_s",
        "business transaction + logical decoding message in the order's statement (CDC message mode, enqueue_with), 1 connection",
        "tx/s",
    ),
    (
        "business_tx_message_separate_1conn_per_s",
        "business transaction + logical decoding message in a statement of its own (enqueue), 1 connection",
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
        "business_tx_message_nconn_per_s",
        "business transaction + logical decoding message in the order's statement (CDC message mode, enqueue_with), {n} connections",
        "tx/s",
    ),
    (
        "business_tx_message_separate_nconn_per_s",
        "business transaction + logical decoding message in a statement of its own (enqueue), {n} connections",
        "tx/s",
    ),
    (
        "ceiling_relay_per_s",
        "ceiling: lean claim-and-mark, batch {r}, 1 connection",
        "rows/s",
    ),
    (
        "kafka_produce_per_s",
        "ceiling: raw rdkafka produce (idempotent, acks=all)",
        "records/s",
    ),
    (
        "relay_drain_per_s",
        "relay drain of the backlog (idem relay)",
        "rows/s",
    ),
    ("relay_peak_rss_mib", "relay peak RSS while draining", "MiB"),
    (
        "ceiling_cdc_produce_per_s",
        "ceiling: raw rdkafka produce, on each side of the CDC drain",
        "records/s",
    ),
    (
        "ceiling_cdc_decode_per_s",
        "ceiling: the server's pgoutput decoding of the backlog (one statement, no client)",
        "rows/s",
    ),
    (
        "cdc_drain_per_s",
        "CDC relay drain of a backlog from its slot (idem cdc relay)",
        "rows/s",
    ),
    (
        "cdc_peak_rss_mib",
        "CDC relay peak RSS while draining",
        "MiB",
    ),
    (
        "ceiling_cdc_produce_cpu_us_per_row",
        "ceiling: raw produce's CPU time per record, every core (client and broker)",
        "µs",
    ),
    (
        "cdc_drain_cpu_us_per_row",
        "CDC relay drain's CPU time per row, every core (relay, walsender, broker, marks, the bench's polling)",
        "µs",
    ),
    (
        "cdc_relay_cpu_us_per_row",
        "of which the relay process",
        "µs",
    ),
    (
        "cdc_walsender_cpu_us_per_row",
        "of which the walsender",
        "µs",
    ),
    (
        "cdc_drain_cpu_bound_per_s",
        "CDC relay drain's bound on this machine: its cores ÷ the drain's CPU per row",
        "rows/s",
    ),
    ("kafka_consume_per_s", "raw rdkafka consume", "records/s"),
    (
        "ceiling_consumer_1conn_per_s",
        "ceiling: set-based inbox + settlement, batch {b}, 1 connection",
        "events/s",
    ),
    (
        "ceiling_consumer_partitions_per_s",
        "ceiling: the same on {p} connections (one per partition)",
        "events/s",
    ),
    (
        "consumer_drain_per_s",
        "consumer drain of the backlog (idem-lab settlement)",
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
        "ceiling_writers_per_s",
        "ceiling: {n} writers alone (business tx + outbox, no events flowing)",
        "orders/s",
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
pub(super) const LOADS: [u32; 3] = [25, 50, 80];

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

/// A ratio: its key, what it is, what it divides by, its target.
struct RatioDef {
    key: &'static str,
    what: &'static str,
    bound: &'static str,
    target: Target,
}

const fn ratio(
    key: &'static str,
    what: &'static str,
    bound: &'static str,
    target: Target,
) -> RatioDef {
    RatioDef {
        key,
        what,
        bound,
        target,
    }
}

/// The ratios. A bound that is a ceiling is the median of its samples.
const RATIOS: &[RatioDef] = &[
    ratio(
        "consumer_drain_vs_ceiling",
        "consumer drain / its ceiling at batch {b}, 1 connection",
        "median of ceiling_consumer_1conn_per_s",
        Target::AtLeast(0.5),
    ),
    ratio(
        "consumer_drain_vs_ceiling_partitions",
        "consumer drain / its ceiling at batch {b}, {p} connections (one per partition)",
        "median of ceiling_consumer_partitions_per_s",
        Target::Info,
    ),
    ratio(
        "relay_drain_vs_ceiling",
        "relay drain / min(lean claim-and-mark, raw produce) at batch {r}",
        "min(median of ceiling_relay_per_s, median of kafka_produce_per_s)",
        Target::AtLeast(0.5),
    ),
    ratio(
        "cdc_drain_vs_produce",
        "CDC relay drain / raw produce",
        "median of ceiling_cdc_produce_per_s",
        Target::AtLeast(0.8),
    ),
    ratio(
        "cdc_drain_vs_ceiling",
        "CDC relay drain / min(pgoutput decode, raw produce)",
        "min(median of ceiling_cdc_decode_per_s, median of ceiling_cdc_produce_per_s)",
        Target::Info,
    ),
    ratio(
        "cdc_cpu_bound_vs_produce",
        "CDC drain's CPU bound on this machine / raw produce: the most CDC drain / raw produce can be here",
        "median of ceiling_cdc_produce_per_s",
        Target::Info,
    ),
    ratio(
        "cdc_floor_vs_produce",
        "a CDC relay costing nothing on this machine / raw produce: cores ÷ (raw produce's CPU per record + the server's decode per row), the most any CDC drain / raw produce can be here",
        "median of ceiling_cdc_produce_per_s",
        Target::Info,
    ),
    ratio(
        "cdc_drain_vs_cpu_bound",
        "CDC relay drain / its CPU bound on this machine",
        "cdc_drain_cpu_bound_per_s",
        Target::Info,
    ),
    ratio(
        "message_tx_nconn",
        "business tx with a logical decoding message in the order's statement / order alone, {n} connections",
        "median of business_tx_nconn_per_s",
        Target::AtLeast(0.9),
    ),
    ratio(
        "sustained_vs_writers_alone",
        "sustained end to end / {n} writers alone",
        "median of ceiling_writers_per_s",
        Target::AtLeast(0.9),
    ),
    ratio(
        "outbox_tx_nconn",
        "business tx with outbox / order alone, {n} connections",
        "median of business_tx_nconn_per_s",
        Target::AtLeast(0.75),
    ),
    ratio(
        "latency_p99_at_50pct_ms",
        "commit → settlement p99 at 50 % load, ms",
        "-",
        Target::AtMost(50.0),
    ),
    ratio(
        "relay_peak_rss_mib",
        "relay peak RSS while draining, MiB",
        "-",
        Target::AtMost(150.0),
    ),
    ratio(
        "consumer_peak_rss_mib",
        "consumer peak RSS while draining, MiB",
        "-",
        Target::AtMost(150.0),
    ),
    ratio(
        "cdc_peak_rss_mib",
        "CDC relay peak RSS while draining, MiB",
        "-",
        Target::AtMost(150.0),
    ),
    ratio(
        "message_tx_1conn",
        "business tx with a logical decoding message / order alone, 1 connection",
        "median of business_tx_1conn_per_s",
        Target::Info,
    ),
    ratio(
        "message_separate_tx_nconn",
        "business tx with the message in a statement of its own / order alone, {n} connections",
        "median of business_tx_nconn_per_s",
        Target::Info,
    ),
    ratio(
        "outbox_tx_1conn",
        "business tx with outbox / order alone, 1 connection",
        "median of business_tx_1conn_per_s",
        Target::Info,
    ),
    ratio(
        "outbox_vs_plain_row_1conn",
        "business tx with outbox / with a plain second row, 1 connection",
        "median of business_tx_plain_1conn_per_s",
        Target::Info,
    ),
    ratio(
        "outbox_vs_plain_row_nconn",
        "business tx with outbox / with a plain second row, {n} connections",
        "median of business_tx_plain_nconn_per_s",
        Target::Info,
    ),
    ratio(
        "dedup_vs_no_dedup",
        "consumer drain with inbox / without (what the inbox costs)",
        "consumer_no_inbox_drain_per_s",
        Target::Info,
    ),
    ratio(
        "duplicates_vs_drain",
        "consumer drain of duplicates / of new events",
        "consumer_drain_per_s",
        Target::Info,
    ),
];

/// How the run's Kafka clients connect, without a secret: the protocol, the SASL mechanism
/// and user, the CA and client certificate files.
fn security_json(s: &idem_kafka::KafkaSecurity) -> Value {
    let path = |p: &Option<std::path::PathBuf>| p.as_ref().map(|p| p.display().to_string());
    json!({
        "protocol": s.protocol.as_str(),
        "sasl_mechanism": s.mechanism.map(|m| m.as_str()),
        "sasl_username": s.username,
        "ca_file": path(&s.ca_file),
        "client_cert_file": path(&s.cert_file),
    })
}

/// A computed ratio: key, what it is, its bound, value, target.
type Ratio = (&'static str, String, &'static str, Option<f64>, Target);

/// What a run measured.
pub(super) struct Report {
    config: Value,
    environment: serde_json::Map<String, Value>,
    figures: Vec<(String, f64)>,
    samples: Vec<(String, Vec<f64>)>,
    phases: Vec<(Phase, Outcome, f64)>,
    ratios: Vec<Ratio>,
    n: u32,
    b: usize,
    r: u32,
    p: u32,
}

impl Report {
    /// An empty report of a run with `args` against `broker`, its clients connecting with
    /// `security` (recorded without its secrets).
    pub(super) fn new(args: &RunArgs, broker: &str, security: &idem_kafka::KafkaSecurity) -> Self {
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
                "ceiling_runs": args.ceiling_runs,
                "stall_seconds": args.stall_seconds,
                "consumer_config": idem_kafka::security::describe_settings(&args.consumer_config),
                "producer_config": idem_kafka::security::describe_settings(&args.producer_config),
                "broker_security": args.broker_security.map(SecuredMode::as_str),
                "kafka_security": security_json(security),
                "postgres_sslmode": idem_sql::postgres::PgUrl::parse(&args.db)
                    .map_or_else(|_| "unreadable".to_owned(), |u| u.tls.mode.to_string()),
            }),
            environment,
            figures: vec![],
            samples: vec![],
            phases: vec![],
            ratios: vec![],
            n: args.connections,
            b: args.batch_size,
            r: args.relay_batch_size,
            p: super::plan::partitions(args),
        }
    }

    /// Notes a fact about the machine.
    pub(super) fn environment(&mut self, key: &str, value: &str) {
        self.environment.insert(key.into(), json!(value));
    }

    /// Records a figure measured once.
    pub(super) fn figure(&mut self, key: &str, value: f64) {
        self.figures.push((key.to_owned(), value));
    }

    /// Records one sample of a sampled figure (a ceiling, a business transaction rate).
    pub(super) fn sample(&mut self, key: &str, value: f64) {
        match self.samples.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => v.push(value),
            None => self.samples.push((key.to_owned(), vec![value])),
        }
    }

    /// Records how `phase` ended after `took`.
    pub(super) fn outcome(&mut self, phase: Phase, outcome: &Outcome, took: Duration) {
        self.phases
            .push((phase, outcome.clone(), took.as_secs_f64()));
    }

    /// Whether `phase` ran to its end.
    pub(super) fn ended_well(&self, phase: Phase) -> bool {
        self.phases
            .iter()
            .any(|(p, o, _)| *p == phase && *o == Outcome::Done)
    }

    /// Records a peak RSS in bytes as MiB (NaN if it could not be read).
    pub(super) fn peak(&mut self, key: &str, bytes: Option<u64>) {
        self.figure(key, bytes.map_or(f64::NAN, crate::num::mib));
    }

    /// Records one latency run.
    pub(super) fn latency(&mut self, pct: u32, run: &LatencyRun) {
        for (suffix, value) in [
            ("target_per_s", run.target_rate),
            ("rate_per_s", run.achieved_rate),
            ("p50_ms", run.p50_ms),
            ("p99_ms", run.p99_ms),
            ("p999_ms", run.p999_ms),
            ("max_ms", run.max_ms),
            ("samples", crate::num::float(run.samples)),
            ("unsettled", crate::num::float(run.unsettled)),
            ("relay_stage_p50_ms", run.relay_stage_ms.0),
            ("relay_stage_p99_ms", run.relay_stage_ms.1),
            ("consumer_stage_p50_ms", run.consumer_stage_ms.0),
            ("consumer_stage_p99_ms", run.consumer_stage_ms.1),
            ("order_tx_p50_ms", run.order_tx_ms.0),
            ("order_tx_p99_ms", run.order_tx_ms.1),
        ] {
            self.figure(&format!("latency_{pct}pct_{suffix}"), value);
        }
    }

    /// Every figure: those measured once, and the median of each sampled one.
    fn all_figures(&self) -> Vec<(String, f64)> {
        let medians = self
            .samples
            .iter()
            .map(|(k, v)| (k.clone(), Spread::of(v).map_or(f64::NAN, |s| s.median)));
        self.figures.iter().cloned().chain(medians).collect()
    }

    fn get(&self, key: &str) -> Option<f64> {
        self.all_figures()
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
            .filter(|v| v.is_finite())
    }

    fn label(&self, s: &str) -> String {
        s.replace("{n}", &self.n.to_string())
            .replace("{b}", &self.b.to_string())
            .replace("{r}", &self.r.to_string())
            .replace("{p}", &self.p.to_string())
    }

    /// Notes the load at the end and computes the ratios.
    pub(super) fn finish(&mut self) {
        self.environment
            .insert("load_average_at_end".into(), json!(load_average()));
        self.ratios = self.ratios();
    }

    /// The rate of a CDC relay that costs nothing beyond raw produce, with every core busy:
    /// each row still costs raw produce's CPU per record (client and broker) and the server's
    /// decoding (one core at `ceiling_cdc_decode_per_s` rows a second).
    fn cdc_floor(&self) -> Option<f64> {
        let cores = self.environment.get("cores")?.as_f64()?;
        let produce_us = self.get("ceiling_cdc_produce_cpu_us_per_row")?;
        let decode_us = 1e6 / self.get("ceiling_cdc_decode_per_s")?;
        (produce_us + decode_us > 0.0).then(|| cores * 1e6 / (produce_us + decode_us))
    }

    /// Each of [`RATIOS`] from the figures: `None` where a figure is missing or a divisor is
    /// not positive.
    fn ratios(&self) -> Vec<Ratio> {
        let g = |k: &str| self.get(k);
        let div = |a: &str, b: Option<f64>| match (g(a), b) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        let relay_bound = match (g("ceiling_relay_per_s"), g("kafka_produce_per_s")) {
            (Some(a), Some(b)) => Some(a.min(b)),
            _ => None,
        };
        let cdc_bound = match (
            g("ceiling_cdc_decode_per_s"),
            g("ceiling_cdc_produce_per_s"),
        ) {
            (Some(a), Some(b)) => Some(a.min(b)),
            _ => None,
        };
        let drain = "consumer_drain_per_s";
        let (outbox_1, outbox_n) = (
            "business_tx_outbox_1conn_per_s",
            "business_tx_outbox_nconn_per_s",
        );
        let values = [
            div(drain, g("ceiling_consumer_1conn_per_s")),
            div(drain, g("ceiling_consumer_partitions_per_s")),
            div("relay_drain_per_s", relay_bound),
            div("cdc_drain_per_s", g("ceiling_cdc_produce_per_s")),
            div("cdc_drain_per_s", cdc_bound),
            div("cdc_drain_cpu_bound_per_s", g("ceiling_cdc_produce_per_s")),
            self.cdc_floor()
                .zip(g("ceiling_cdc_produce_per_s"))
                .map(|(floor, produce)| floor / produce),
            div("cdc_drain_per_s", g("cdc_drain_cpu_bound_per_s")),
            div(
                "business_tx_message_nconn_per_s",
                g("business_tx_nconn_per_s"),
            ),
            div("e2e_sustained_per_s", g("ceiling_writers_per_s")),
            div(outbox_n, g("business_tx_nconn_per_s")),
            g("latency_50pct_p99_ms"),
            g("relay_peak_rss_mib"),
            g("consumer_peak_rss_mib"),
            g("cdc_peak_rss_mib"),
            div(
                "business_tx_message_1conn_per_s",
                g("business_tx_1conn_per_s"),
            ),
            div(
                "business_tx_message_separate_nconn_per_s",
                g("business_tx_nconn_per_s"),
            ),
            div(outbox_1, g("business_tx_1conn_per_s")),
            div(outbox_1, g("business_tx_plain_1conn_per_s")),
            div(outbox_n, g("business_tx_plain_nconn_per_s")),
            div(drain, g("consumer_no_inbox_drain_per_s")),
            div("duplicates_drain_per_s", g(drain)),
        ];
        RATIOS
            .iter()
            .zip(values)
            .map(|(d, v)| (d.key, self.label(d.what), d.bound, v, d.target))
            .collect()
    }

    /// The report as JSON: config, environment, phases (how each ended), figures, the
    /// sampled figures' spread, ratios (value, bound, target, met).
    pub(super) fn json(&self) -> Value {
        let figures: serde_json::Map<String, Value> = self
            .all_figures()
            .into_iter()
            .map(|(k, v)| (k, number(v)))
            .collect();
        let spread: serde_json::Map<String, Value> = self
            .samples
            .iter()
            .map(|(k, v)| (k.clone(), spread_json(v)))
            .collect();
        let phases: serde_json::Map<String, Value> = self
            .phases
            .iter()
            .map(|(p, o, took)| {
                let mut e = json!({ "status": o.status(), "seconds": number(*took) });
                if let Some(why) = o.reason() {
                    e["reason"] = json!(why);
                }
                (p.key().to_owned(), e)
            })
            .collect();
        let ratios: serde_json::Map<String, Value> = self
            .ratios
            .iter()
            .map(|(k, label, bound, v, t)| {
                (
                    (*k).to_owned(),
                    json!({
                        "what": label,
                        "bound": bound,
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
            "phases": phases,
            "figures": figures,
            "spread": spread,
            "ratios": ratios,
            "targets_met": self.ratios.iter().all(|(_, _, _, v, t)| v.is_some_and(|v| t.met(v))),
        })
    }

    /// The report as a table.
    pub(super) fn table(&self) -> String {
        let mut out = String::new();
        self.table_header(&mut out);
        self.table_figures(&mut out);
        self.table_latency(&mut out);
        self.table_ratios(&mut out);
        self.table_phases(&mut out);
        out
    }

    fn table_header(&self, out: &mut String) {
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
        let _ = writeln!(
            out,
            "  {:<72} {:>10} {:>10} {:>10}",
            "figure (sampled: min, median, max)", "min", "value", "max"
        );
    }

    fn table_figures(&self, out: &mut String) {
        let all = self.all_figures();
        for (key, label, unit) in FIGURES {
            let spread = self
                .samples
                .iter()
                .find(|(k, _)| k == key)
                .and_then(|(_, v)| Spread::of(v).map(|s| (s, v.len())));
            if let Some((s, n)) = spread {
                let label = format!("{} [{n}]", self.label(label));
                let _ = writeln!(
                    out,
                    "  {label:<72} {:>10} {:>10} {:>10} {unit}",
                    fmt(s.min),
                    fmt(s.median),
                    fmt(s.max)
                );
            } else if let Some((_, v)) = all.iter().find(|(k, _)| k == key) {
                let _ = writeln!(
                    out,
                    "  {:<72} {:>10} {:>10} {:>10} {unit}",
                    self.label(label),
                    "",
                    fmt(*v),
                    ""
                );
            }
        }
        let _ = writeln!(out);
    }

    fn table_latency(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "  commit → settlement latency, open loop   rate/s      p50      p99    p99.9      max   samples  order tx p99"
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
                "  at {pct:>2} % of sustained                  {:>9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>13}",
                fmt(g("rate_per_s")),
                fmt(g("p50_ms")),
                fmt(g("p99_ms")),
                fmt(g("p999_ms")),
                fmt(g("max_ms")),
                fmt(g("samples")),
                fmt(g("order_tx_p99_ms")),
            );
        }
        let _ = writeln!(out);
    }

    fn table_ratios(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "  {:<80} {:>8}  {:<8} result",
            "ratio (a ceiling bound is its median)", "value", "target"
        );
        for (_, label, _, v, t) in &self.ratios {
            let result = match v {
                Some(_) if matches!(t, Target::Info) => "",
                Some(v) if t.met(*v) => "met",
                Some(_) => "MISSED",
                None => "not measured",
            };
            let _ = writeln!(
                out,
                "  {:<80} {:>8}  {:<8} {result}",
                label,
                v.map_or("-".to_owned(), |v| format!("{v:.2}")),
                t.text()
            );
        }
    }

    fn table_phases(&self, out: &mut String) {
        for (p, o, took) in &self.phases {
            if let Some(why) = o.reason() {
                let _ = writeln!(
                    out,
                    "  phase {} {} after {took:.0} s: {why}",
                    p.key(),
                    o.status()
                );
            }
        }
    }
}

fn spread_json(samples: &[f64]) -> Value {
    let s = Spread::of(samples);
    json!({
        "min": s.as_ref().map_or(Value::Null, |s| number(s.min)),
        "median": s.as_ref().map_or(Value::Null, |s| number(s.median)),
        "max": s.as_ref().map_or(Value::Null, |s| number(s.max)),
        "samples": samples.iter().map(|v| number(*v)).collect::<Vec<_>>(),
    })
}

pub(super) fn number(v: f64) -> Value {
    if v.is_finite() {
        json!((v * 1000.0).round() / 1000.0)
    } else {
        Value::Null
    }
}

pub(super) fn fmt(v: f64) -> String {
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
            .and_then(|(_, _, _, v, _)| v)
    }

    #[test]
    fn ratios_divide_each_figure_by_the_median_of_the_ceiling_that_bounds_it() {
        let mut r = Report::new(
            &super::super::plan::sample_args(),
            "embedded",
            &Default::default(),
        );
        for (k, v) in [
            ("consumer_drain_per_s", 800.0),
            ("relay_drain_per_s", 450.0),
            ("consumer_no_inbox_drain_per_s", 0.0),
            ("latency_50pct_p99_ms", 12.5),
            ("e2e_sustained_per_s", 900.0),
        ] {
            r.figure(k, v);
        }
        // The ceiling swings; the ratio takes its median, not its best or worst sample.
        for v in [1000.0, 4000.0, 1600.0] {
            r.sample("ceiling_consumer_1conn_per_s", v);
        }
        for v in [600.0, 700.0] {
            r.sample("ceiling_relay_per_s", v);
        }
        r.sample("kafka_produce_per_s", 500.0);
        r.sample("ceiling_writers_per_s", 1000.0);
        r.figure("cdc_drain_per_s", 400.0);
        for v in [450.0, 500.0, 550.0] {
            r.sample("ceiling_cdc_produce_per_s", v);
        }
        assert_eq!(ratio(&r, "consumer_drain_vs_ceiling"), Some(0.5));
        // The relay is bounded by the slower of its ceiling and the raw produce.
        assert_eq!(ratio(&r, "relay_drain_vs_ceiling"), Some(0.9));
        assert_eq!(ratio(&r, "sustained_vs_writers_alone"), Some(0.9));
        assert_eq!(ratio(&r, "cdc_drain_vs_produce"), Some(0.8));
        assert_eq!(ratio(&r, "latency_p99_at_50pct_ms"), Some(12.5));
        // A zero divisor and a missing figure give no ratio.
        assert_eq!(ratio(&r, "dedup_vs_no_dedup"), None);
        assert_eq!(ratio(&r, "outbox_tx_1conn"), None);
        let labels: Vec<String> = r.ratios().into_iter().map(|(_, l, ..)| l).collect();
        assert_eq!(labels.len(), RATIOS.len());
        assert!(
            labels.contains(&"consumer drain / its ceiling at batch 200, 1 connection".to_owned())
        );
        assert!(
            labels.contains(&"business tx with outbox / order alone, 4 connections".to_owned())
        );
        let json = r.json();
        assert_eq!(json["figures"]["ceiling_consumer_1conn_per_s"], 1600.0);
        let s = &json["spread"]["ceiling_consumer_1conn_per_s"];
        assert_eq!(
            (s["min"].as_f64(), s["max"].as_f64()),
            (Some(1000.0), Some(4000.0))
        );
        assert_eq!(s["samples"].as_array().map(Vec::len), Some(3));
    }

    #[test]
    fn the_cdc_floor_adds_raw_produces_cpu_and_the_servers_decoding_per_row() {
        let mut r = Report::new(
            &super::super::plan::sample_args(),
            "embedded",
            &Default::default(),
        );
        r.environment.insert("cores".into(), json!(2));
        assert_eq!(ratio(&r, "cdc_floor_vs_produce"), None, "no figures yet");
        r.sample("ceiling_cdc_produce_per_s", 200_000.0);
        // 6 µs a record on every core, 4 µs a row of decoding: 10 µs, two cores: 200k rows/s.
        r.sample("ceiling_cdc_produce_cpu_us_per_row", 6.0);
        r.sample("ceiling_cdc_decode_per_s", 250_000.0);
        assert_eq!(r.cdc_floor(), Some(200_000.0));
        assert_eq!(ratio(&r, "cdc_floor_vs_produce"), Some(1.0));
        r.figure("cdc_drain_per_s", 50_000.0);
        r.figure("cdc_drain_cpu_bound_per_s", 62_500.0);
        assert_eq!(ratio(&r, "cdc_drain_vs_cpu_bound"), Some(0.8));
        assert_eq!(ratio(&r, "cdc_cpu_bound_vs_produce"), Some(0.3125));
    }

    #[test]
    fn a_phase_that_did_not_end_well_is_reported_with_its_reason() {
        let mut r = Report::new(
            &super::super::plan::sample_args(),
            "embedded",
            &Default::default(),
        );
        r.outcome(Phase::RelayDrain, &Outcome::Done, Duration::from_secs(3));
        let stuck = Outcome::Failed("rows republished: 0 of 10, no progress for 60 s".into());
        r.outcome(Phase::Republish, &stuck, Duration::from_secs(61));
        assert!(r.ended_well(Phase::RelayDrain));
        assert!(!r.ended_well(Phase::Republish));
        assert!(!r.ended_well(Phase::Duplicates));
        r.finish();
        let json = r.json();
        assert_eq!(json["phases"]["relay_drain"]["status"], "done");
        assert_eq!(json["phases"]["republish"]["status"], "failed");
        assert!(
            json["phases"]["republish"]["reason"]
                .as_str()
                .unwrap()
                .contains("no progress")
        );
        assert_eq!(json["targets_met"], false);
        assert!(r.table().contains("phase republish failed after 61 s"));
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
