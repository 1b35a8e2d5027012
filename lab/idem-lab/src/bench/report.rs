//! Figures, the spread of the sampled ones, how each phase ended, ratios against the same run's
//! ceilings, and their table and JSON forms.

use std::fmt::Write as _;

use serde_json::{Value, json};

use std::time::Duration;

use super::RunArgs;
use super::figures::{Figure, LOADS, Of, RATIOS, Target};
use super::latency::LatencyRun;
use super::plan::Phase;
use super::spread::{Outcome, Spread};
use crate::broker::SecuredMode;

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
type Ratio = (&'static str, String, String, Option<f64>, Target);

/// What a run measured.
pub(super) struct Report {
    config: Value,
    environment: serde_json::Map<String, Value>,
    figures: Vec<(Figure, f64)>,
    samples: Vec<(Figure, Vec<f64>)>,
    /// The latency runs' figures: load (percent), what, value.
    latency: Vec<(u32, &'static str, f64)>,
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
            latency: vec![],
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
    pub(super) fn figure(&mut self, figure: Figure, value: f64) {
        debug_assert!(!figure.sampled(), "{figure:?} is sampled");
        self.figures.push((figure, value));
    }

    /// Records one sample of a sampled figure (a ceiling, a business transaction rate).
    pub(super) fn sample(&mut self, figure: Figure, value: f64) {
        debug_assert!(figure.sampled(), "{figure:?} is measured once");
        match self.samples.iter_mut().find(|(f, _)| *f == figure) {
            Some((_, v)) => v.push(value),
            None => self.samples.push((figure, vec![value])),
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
    pub(super) fn peak(&mut self, figure: Figure, bytes: Option<u64>) {
        self.figure(figure, bytes.map_or(f64::NAN, crate::num::mib));
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
            self.latency.push((pct, suffix, value));
        }
    }

    /// A latency run's figure: `what` at `pct` percent of the sustained rate.
    fn latency_figure(&self, pct: u32, what: &str) -> Option<f64> {
        self.latency
            .iter()
            .find(|(p, w, _)| *p == pct && *w == what)
            .map(|(_, _, v)| *v)
    }

    /// Every figure: those measured once, and the median of each sampled one.
    fn all_figures(&self) -> Vec<(Figure, f64)> {
        let medians = self
            .samples
            .iter()
            .map(|(f, v)| (*f, Spread::of(v).map_or(f64::NAN, |s| s.median)));
        self.figures.iter().copied().chain(medians).collect()
    }

    /// A figure's value (a sampled one's median), if it was measured and is finite.
    fn get(&self, figure: Figure) -> Option<f64> {
        self.all_figures()
            .into_iter()
            .find(|(f, _)| *f == figure)
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
        let produce_us = self.get(Figure::CeilingCdcProduceCpu)?;
        let decode_us = 1e6 / self.get(Figure::CeilingCdcDecode)?;
        (produce_us + decode_us > 0.0).then(|| cores * 1e6 / (produce_us + decode_us))
    }

    /// The value of a ratio: `None` where a figure is missing or a divisor is not positive.
    fn value(&self, of: Of) -> Option<f64> {
        let div = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        let min = |a: Figure, b: Figure| Some(self.get(a)?.min(self.get(b)?));
        match of {
            Of::Div(a, b) => div(self.get(a), self.get(b)),
            Of::DivMin(a, b, c) => div(self.get(a), min(b, c)),
            Of::Plain(f) => self.get(f),
            Of::LatencyP99(pct) => self.latency_figure(pct, "p99_ms").filter(|v| v.is_finite()),
            Of::CdcFloorVsProduce => div(self.cdc_floor(), self.get(Figure::CeilingCdcProduce)),
        }
    }

    /// Each of [`RATIOS`] from the figures.
    fn ratios(&self) -> Vec<Ratio> {
        RATIOS
            .iter()
            .map(|d| {
                let value = self.value(d.of);
                (d.key, self.label(d.what), d.of.bound(), value, d.target)
            })
            .collect()
    }

    /// The report as JSON: config, environment, phases (how each ended), figures, the
    /// sampled figures' spread, ratios (value, bound, target, met).
    pub(super) fn json(&self) -> Value {
        let latency = self
            .latency
            .iter()
            .map(|(pct, what, v)| (format!("latency_{pct}pct_{what}"), number(*v)));
        let figures: serde_json::Map<String, Value> = self
            .all_figures()
            .into_iter()
            .map(|(f, v)| (f.key().to_owned(), number(v)))
            .chain(latency)
            .collect();
        let spread: serde_json::Map<String, Value> = self
            .samples
            .iter()
            .map(|(f, v)| (f.key().to_owned(), spread_json(v)))
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
        for &figure in Figure::ALL {
            let (label, unit) = (figure.label(), figure.unit());
            let spread = self
                .samples
                .iter()
                .find(|(f, _)| *f == figure)
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
            } else if let Some((_, v)) = self.figures.iter().find(|(f, _)| *f == figure) {
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
            let g = |what: &str| self.latency_figure(pct, what).unwrap_or(f64::NAN);
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

/// The load average of the last 1, 5 and 15 minutes (`/proc/loadavg`), or nothing.
pub(super) fn load_average() -> String {
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
            (Figure::ConsumerDrain, 800.0),
            (Figure::RelayDrain, 450.0),
            (Figure::ConsumerNoInboxDrain, 0.0),
            (Figure::E2eSustained, 900.0),
        ] {
            r.figure(k, v);
        }
        r.latency.push((50, "p99_ms", 12.5));
        // The ceiling swings; the ratio takes its median, not its best or worst sample.
        for v in [1000.0, 4000.0, 1600.0] {
            r.sample(Figure::CeilingConsumer1, v);
        }
        for v in [600.0, 700.0] {
            r.sample(Figure::CeilingRelay, v);
        }
        r.sample(Figure::KafkaProduce, 500.0);
        r.sample(Figure::CeilingWriters, 1000.0);
        r.figure(Figure::CdcDrain, 400.0);
        for v in [450.0, 500.0, 550.0] {
            r.sample(Figure::CeilingCdcProduce, v);
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
        let json = r.json();
        assert_eq!(labels.len(), RATIOS.len());
        assert_eq!(json["figures"]["latency_50pct_p99_ms"], 12.5);
        assert!(
            labels.contains(&"consumer drain / its ceiling at batch 200, 1 connection".to_owned())
        );
        assert!(
            labels.contains(&"business tx with outbox / order alone, 4 connections".to_owned())
        );
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
        r.sample(Figure::CeilingCdcProduce, 200_000.0);
        // 6 µs a record on every core, 4 µs a row of decoding: 10 µs, two cores: 200k rows/s.
        r.sample(Figure::CeilingCdcProduceCpu, 6.0);
        r.sample(Figure::CeilingCdcDecode, 250_000.0);
        assert_eq!(r.cdc_floor(), Some(200_000.0));
        assert_eq!(ratio(&r, "cdc_floor_vs_produce"), Some(1.0));
        r.figure(Figure::CdcDrain, 50_000.0);
        r.figure(Figure::CdcDrainCpuBound, 62_500.0);
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
