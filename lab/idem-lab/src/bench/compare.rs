//! `idem-lab bench compare BASE OTHER`: two runs' reports side by side, each figure of the
//! second divided by the same figure of the first (TLS over plain text, a change over the code
//! before it). Both runs carry their own ceilings, so the comparison shows what the change cost
//! idem beside what it cost the hardware's leanest way of doing the same work.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use serde_json::{Map, Value, json};

use super::figures::Figure;
use super::report::{fmt, number};

/// `idem-lab bench compare`.
#[derive(Args, Debug)]
pub(super) struct CompareArgs {
    /// The first run's report (`idem-lab bench --json`): the divisor.
    base: PathBuf,
    /// The second run's report, divided by the first.
    other: PathBuf,
    /// What the first run is, in the output (default: its file name).
    #[arg(long)]
    base_label: Option<String>,
    /// What the second run is, in the output (default: its file name).
    #[arg(long)]
    other_label: Option<String>,
    /// Print the comparison as JSON, both reports included.
    #[arg(long)]
    json: bool,
}

/// Runs `idem-lab bench compare`.
pub(super) fn run(args: &CompareArgs) -> anyhow::Result<()> {
    let base = read(&args.base)?;
    let other = read(&args.other)?;
    let label = |l: &Option<String>, p: &Path| {
        l.clone().unwrap_or_else(|| {
            p.file_stem()
                .map_or_else(String::new, |s| s.to_string_lossy().into_owned())
        })
    };
    let labels = (
        label(&args.base_label, &args.base),
        label(&args.other_label, &args.other),
    );
    let c = comparison(&base, &other, (&labels.0, &labels.1));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&c)?);
    } else {
        print!("{}", table(&c));
    }
    Ok(())
}

fn read(path: &Path) -> anyhow::Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a bench report (JSON)", path.display()))?;
    if !v["figures"].is_object() {
        anyhow::bail!(
            "{} is not a report of idem-lab bench --json: it has no figures",
            path.display()
        );
    }
    Ok(v)
}

/// `other / base`, where both are numbers and the base is not zero.
fn ratio(base: &Value, other: &Value) -> Option<f64> {
    match (base.as_f64(), other.as_f64()) {
        (Some(b), Some(o)) if b != 0.0 => Some(o / b),
        _ => None,
    }
}

/// The comparison of two reports: every figure both have (`other / base`), every ratio of both
/// side by side, and the two reports.
pub(super) fn comparison(base: &Value, other: &Value, labels: (&str, &str)) -> Value {
    let mut figures = Map::new();
    if let (Some(b), Some(o)) = (base["figures"].as_object(), other["figures"].as_object()) {
        for (key, bv) in b {
            let Some(ov) = o.get(key) else { continue };
            figures.insert(
                key.clone(),
                json!({
                    "base": bv,
                    "other": ov,
                    "ratio": ratio(bv, ov).map_or(Value::Null, number),
                }),
            );
        }
    }
    let mut ratios = Map::new();
    if let (Some(b), Some(o)) = (base["ratios"].as_object(), other["ratios"].as_object()) {
        for (key, br) in b {
            let Some(or) = o.get(key) else { continue };
            ratios.insert(
                key.clone(),
                json!({ "what": br["what"], "base": br["value"], "other": or["value"] }),
            );
        }
    }
    json!({
        "what": format!("{} / {}: each figure of the second run divided by the first's", labels.1, labels.0),
        "base": { "label": labels.0, "report": base },
        "other": { "label": labels.1, "report": other },
        "figures": figures,
        "ratios": ratios,
    })
}

/// A figure's label with the run's settings in it (`{n}` connections, `{b}` and `{r}` batch
/// sizes, `{p}` partitions).
fn label(text: &str, config: &Value) -> String {
    let get = |k: &str| {
        config[k]
            .as_u64()
            .map_or_else(|| "?".to_owned(), |v| v.to_string())
    };
    text.replace("{n}", &get("connections"))
        .replace("{b}", &get("batch_size"))
        .replace("{r}", &get("relay_batch_size"))
        .replace("{p}", &get("partitions"))
}

/// The comparison as text: the figures of [`Figure::ALL`] both runs have, then the ratios.
pub(super) fn table(c: &Value) -> String {
    use std::fmt::Write as _;
    let (bl, ol) = (
        c["base"]["label"].as_str().unwrap_or("base"),
        c["other"]["label"].as_str().unwrap_or("other"),
    );
    let mut out = String::new();
    for side in ["base", "other"] {
        let r = &c[side]["report"];
        let env = |k: &str| r["environment"][k].as_str().unwrap_or("-").to_owned();
        let _ = writeln!(
            out,
            "{}: kafka {}, postgres sslmode {}, load average {} → {}",
            c[side]["label"].as_str().unwrap_or(side),
            r["config"]["kafka_security"]["protocol"]
                .as_str()
                .unwrap_or("PLAINTEXT"),
            r["config"]["postgres_sslmode"].as_str().unwrap_or("-"),
            env("load_average_at_start"),
            env("load_average_at_end"),
        );
    }
    let config = &c["base"]["report"]["config"];
    let _ = writeln!(
        out,
        "\n  {:<72} {:>10} {:>10} {:>7}",
        "figure", bl, ol, "ratio"
    );
    let num = |v: &Value| v.as_f64().map_or_else(|| "-".to_owned(), fmt);
    let exact = |v: &Value| {
        v.as_f64()
            .map_or_else(|| "-".to_owned(), |v| format!("{v:.3}"))
    };
    for &figure in Figure::ALL {
        let (text, unit) = (figure.label(), figure.unit());
        let f = &c["figures"][figure.key()];
        if f.is_null() {
            continue;
        }
        let _ = writeln!(
            out,
            "  {:<72} {:>10} {:>10} {:>7} {unit}",
            label(text, config),
            num(&f["base"]),
            num(&f["other"]),
            exact(&f["ratio"]),
        );
    }
    let _ = writeln!(out, "\n  {:<72} {:>10} {:>10}", "ratio", bl, ol);
    if let Some(ratios) = c["ratios"].as_object() {
        for (key, r) in ratios {
            let _ = writeln!(
                out,
                "  {key:<72} {:>10} {:>10}",
                exact(&r["base"]),
                exact(&r["other"])
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_figure_of_the_other_run_is_divided_by_the_base_s() {
        let base = json!({
            "config": { "connections": 4 },
            "figures": { "relay_drain_per_s": 40000.0, "round_trip_us": 50.0, "only_here": 1.0 },
            "ratios": { "relay_drain_vs_ceiling": { "what": "relay / ceiling", "value": 0.5 } },
        });
        let other = json!({
            "config": { "connections": 4, "kafka_security": { "protocol": "SASL_SSL" } },
            "figures": { "relay_drain_per_s": 30000.0, "round_trip_us": 0.0 },
            "ratios": { "relay_drain_vs_ceiling": { "what": "relay / ceiling", "value": 0.6 } },
        });
        let c = comparison(&base, &other, ("plain", "tls"));
        assert_eq!(c["figures"]["relay_drain_per_s"]["ratio"], 0.75);
        assert_eq!(c["figures"]["round_trip_us"]["ratio"], 0.0);
        assert!(c["figures"]["only_here"].is_null());
        assert_eq!(c["ratios"]["relay_drain_vs_ceiling"]["other"], 0.6);
        assert_eq!(c["other"]["label"], "tls");
        let text = table(&c);
        assert!(text.contains("tls: kafka SASL_SSL"), "{text}");
        assert!(text.contains("plain: kafka PLAINTEXT"), "{text}");
        let relay = text.lines().find(|l| l.contains("40000")).unwrap();
        assert!(
            relay.contains("30000") && relay.contains("0.750"),
            "{relay}"
        );
        // A zero base has no ratio.
        let zero = json!({ "figures": { "x": 0.0 } });
        let c = comparison(&zero, &zero, ("a", "b"));
        assert!(c["figures"]["x"]["ratio"].is_null());
    }
}
