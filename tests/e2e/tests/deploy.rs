//! The files under `deploy/` against the code: the Grafana dashboard is valid JSON wired to a
//! `${DS_PROMETHEUS}` datasource input, and every metric the dashboard, the alert rules and
//! their tests name is one the code exports (or `idem verify`'s gauge, documented) and is
//! listed in `docs/operating/metrics.md`, which lists nothing else. `promtool check rules` / `test rules`
//! (in `scripts/test`) check the rules themselves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_owned()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// Every `idem_…` token in `text` (metric names, and whatever else is spelled that way).
fn tokens(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("idem_") {
        let starts_word = !rest[..i]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let word: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        // `idem_` alone is the default table prefix, not a metric.
        if starts_word && word.len() > "idem_".len() {
            out.insert(word.clone());
        }
        rest = &rest[i + word.len()..];
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Metric names the code defines: `"idem_…"` string literals in the source files of the
/// workspace's crates that register collectors in a Prometheus registry (so table and header
/// names elsewhere do not count).
fn metrics_in_code() -> BTreeSet<String> {
    let mut files = vec![];
    // Crates sit one level down, in their role's folder (core/, engines/, stores/, ...).
    for group in std::fs::read_dir(root()).unwrap() {
        let group = group.unwrap().path();
        if !group.is_dir() {
            continue;
        }
        for entry in std::fs::read_dir(&group).unwrap() {
            let src = entry.unwrap().path().join("src");
            if src.is_dir() {
                rust_files(&src, &mut files);
            }
        }
    }
    let mut names = BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        if !text.contains(".register(Box::new(") {
            continue;
        }
        for t in tokens(&text) {
            if text.contains(&format!("\"{t}\"")) {
                names.insert(t);
            }
        }
    }
    names
}

/// The metric a query token refers to: histogram series (`_bucket`, `_sum`, `_count`) name
/// their histogram.
fn metric_of(token: &str, known: &BTreeSet<String>) -> String {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = token.strip_suffix(suffix)
            && known.contains(base)
        {
            return base.to_owned();
        }
    }
    token.to_owned()
}

/// Metric names in the first column of docs/operating/metrics.md's tables.
fn documented() -> BTreeSet<String> {
    read("docs/operating/metrics.md")
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|n| n.starts_with("idem_"))
        .map(str::to_owned)
        .collect()
}

fn expressions(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr" | "definition", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => expressions(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| expressions(v, out)),
        _ => {}
    }
}

#[test]
fn the_dashboard_is_grafana_json_on_a_prometheus_datasource_input() {
    let d: serde_json::Value = serde_json::from_str(&read("deploy/grafana/idem-dashboard.json"))
        .expect("the dashboard is valid JSON");
    assert_eq!(d["__inputs"][0]["name"], "DS_PROMETHEUS");
    assert_eq!(d["__inputs"][0]["pluginId"], "prometheus");
    assert!(d["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(d["uid"].as_str().is_some_and(|t| !t.is_empty()));
    let panels = d["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    for p in panels {
        assert!(
            ids.insert(p["id"].as_u64().unwrap()),
            "duplicate panel id in {p}"
        );
        for k in ["h", "w", "x", "y"] {
            assert!(p["gridPos"][k].is_u64(), "gridPos.{k} of {}", p["title"]);
        }
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "{}", p["title"]);
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{} has no query", p["title"]);
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${DS_PROMETHEUS}", "{}", p["title"]);
            assert!(t["expr"].as_str().is_some_and(|e| e.contains("idem_")));
        }
    }
    for v in d["templating"]["list"].as_array().unwrap() {
        assert_eq!(v["datasource"]["uid"], "${DS_PROMETHEUS}");
    }
}

#[test]
fn every_metric_the_deploy_files_name_is_exported_and_documented() {
    let code = metrics_in_code();
    assert!(
        code.contains("idem_outbox_published_total") && code.contains("idem_consumer_lag"),
        "the scan finds the metric modules: {code:?}"
    );
    let docs = documented();
    let d: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana/idem-dashboard.json")).unwrap();
    let mut exprs = vec![];
    expressions(&d, &mut exprs);
    let sources = [
        ("deploy/grafana/idem-dashboard.json", exprs.join("\n")),
        (
            "deploy/prometheus/idem-alerts.yml",
            read("deploy/prometheus/idem-alerts.yml"),
        ),
        (
            "deploy/prometheus/idem-alerts.test.yml",
            read("deploy/prometheus/idem-alerts.test.yml"),
        ),
    ];
    for (file, text) in &sources {
        let used: BTreeSet<String> = tokens(text).iter().map(|t| metric_of(t, &code)).collect();
        assert!(!used.is_empty(), "{file} names no metric");
        for m in &used {
            assert!(code.contains(m), "{file} uses {m}, which no code exports");
            assert!(
                docs.contains(m),
                "{file} uses {m}, which docs/operating/metrics.md does not list"
            );
        }
    }
    // The alert rules and the dashboard cover the reconciliation gap too.
    for (file, text) in &sources[..2] {
        assert!(text.contains("idem_reconciliation_gap"), "{file}");
    }
}

#[test]
fn the_metrics_page_lists_every_metric_and_nothing_else() {
    let code = metrics_in_code();
    let docs = documented();
    for m in &code {
        assert!(
            docs.contains(m),
            "docs/operating/metrics.md does not list {m}"
        );
    }
    for m in &docs {
        assert!(
            code.contains(m),
            "docs/operating/metrics.md lists {m}, which no code exports"
        );
    }
}
