//! The files under `deploy/` against the code: the Grafana dashboard is valid JSON wired to a
//! `${DS_PROMETHEUS}` datasource input, and every metric the dashboard, the alert rules and
//! their tests name is one the code exports (or `idem verify`'s gauge, documented) and is
//! listed in `docs/operating/metrics.md`, which lists nothing else. `promtool check rules` / `test rules`
//! (in `scripts/test`) check the rules themselves.
//!
//! The Kubernetes manifests under `deploy/kubernetes/` against what a schema cannot say
//! (`scripts/check-deploy` validates them against the API's schemas): every container runs
//! unprivileged on a read-only root, has both probes on the metrics port and resource bounds,
//! gets its secrets as files, and is given only flags that `idem <subcommand> --help` lists;
//! the Kustomization lists every manifest but the Secret example.
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

/// The anchors a markdown file defines: `<a id="…">` and its headings' GitHub slugs (a `#`
/// line inside a fenced block is code, not a heading).
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for part in markdown.split("<a id=\"").skip(1) {
        out.insert(part.split('"').next().unwrap().to_owned());
    }
    let mut fenced = false;
    let prose = markdown.lines().filter(|l| {
        if l.starts_with("```") {
            fenced = !fenced;
        }
        !fenced
    });
    for heading in prose.filter(|l| l.starts_with('#')) {
        let slug: String = heading
            .trim_start_matches('#')
            .trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        out.insert(slug);
    }
    out
}

/// Every alert carries a `runbook` that resolves: a file of the repository and an anchor in
/// it, so the link an on-call engineer follows lands on what to do.
#[test]
fn every_alert_has_a_runbook_that_resolves_to_its_section() {
    let rules: serde_yaml::Value =
        serde_yaml::from_str(&read("deploy/prometheus/idem-alerts.yml")).unwrap();
    let mut alerts = 0;
    for group in rules["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            let Some(alert) = rule["alert"].as_str() else {
                continue;
            };
            alerts += 1;
            let runbook = rule["annotations"]["runbook"]
                .as_str()
                .unwrap_or_else(|| panic!("{alert} has no runbook annotation"));
            let (file, anchor) = runbook
                .split_once('#')
                .unwrap_or_else(|| panic!("{alert}: {runbook} names no section"));
            let text = std::fs::read_to_string(root().join(file))
                .unwrap_or_else(|e| panic!("{alert}: {file}: {e}"));
            assert!(
                anchors(&text).contains(anchor),
                "{alert}: {file} has no section #{anchor}"
            );
        }
    }
    assert!(alerts >= 20, "only {alerts} alerts");
    let planted = "## What to do\n| `x`<a id=\"idem_x_total\"></a> |\n```sh\n# not-a-heading\n```";
    assert!(anchors(planted).contains("idem_x_total") && anchors(planted).contains("what-to-do"));
    assert!(!anchors(planted).contains("idem_y_total"));
    assert!(!anchors(planted).contains("not-a-heading"));
}

/// Every document of every `.yaml` file in deploy/kubernetes/, with its file's name.
fn manifests() -> Vec<(String, serde_json::Value)> {
    use serde::Deserialize as _;
    let dir = root().join("deploy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut out = vec![];
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&f).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v = serde_json::Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{name} is not YAML: {e}"));
            if !v.is_null() {
                out.push((name.clone(), v));
            }
        }
    }
    assert!(!out.is_empty(), "no manifest in {}", dir.display());
    out
}

/// The pod templates of the workloads: (file, workload name, pod spec).
fn pod_specs() -> Vec<(String, String, serde_json::Value)> {
    let specs: Vec<_> = manifests()
        .into_iter()
        .filter(|(_, m)| {
            matches!(
                m["kind"].as_str(),
                Some("Deployment" | "StatefulSet" | "DaemonSet" | "Job")
            )
        })
        .map(|(f, m)| {
            let name = m["metadata"]["name"].as_str().unwrap().to_owned();
            (f, name, m["spec"]["template"]["spec"].clone())
        })
        .collect();
    let names: BTreeSet<&str> = specs.iter().map(|(_, n, _)| n.as_str()).collect();
    for w in ["idem-relay", "idem-cdc-relay", "idem-dispatcher"] {
        assert!(
            names.contains(w),
            "no workload {w} in deploy/kubernetes: {names:?}"
        );
    }
    specs
}

/// Every container of a pod spec, init containers too.
fn containers(spec: &serde_json::Value) -> Vec<&serde_json::Value> {
    let mut out = vec![];
    for key in ["initContainers", "containers"] {
        if let Some(list) = spec[key].as_array() {
            out.extend(list);
        }
    }
    assert!(!out.is_empty(), "a pod without containers: {spec}");
    out
}

/// A security setting as it applies to a container: its own, else the pod's.
fn effective<'a>(
    pod: &'a serde_json::Value,
    container: &'a serde_json::Value,
    pointer: &str,
) -> &'a serde_json::Value {
    match container["securityContext"].pointer(pointer) {
        Some(v) if !v.is_null() => v,
        _ => pod["securityContext"]
            .pointer(pointer)
            .unwrap_or(&serde_json::Value::Null),
    }
}

#[test]
fn the_kustomization_lists_every_manifest_but_the_secret_example() {
    let k = manifests()
        .into_iter()
        .find(|(f, _)| f == "kustomization.yaml")
        .expect("deploy/kubernetes/kustomization.yaml")
        .1;
    assert_eq!(k["kind"], "Kustomization");
    let listed: BTreeSet<String> = k["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .map(|r| r.as_str().unwrap().to_owned())
        .collect();
    let files: BTreeSet<String> = manifests()
        .into_iter()
        .map(|(f, _)| f)
        .filter(|f| f != "kustomization.yaml" && !f.ends_with(".example.yaml"))
        .collect();
    assert_eq!(
        listed, files,
        "kustomization.yaml's resources are the manifests in deploy/kubernetes/ but *.example.yaml"
    );
    let example = manifests()
        .into_iter()
        .filter(|(f, _)| f.ends_with(".example.yaml"))
        .map(|(_, m)| m)
        .collect::<Vec<_>>();
    assert!(
        example.iter().any(|m| m["kind"] == "Secret"),
        "the Secret's example is secret.example.yaml"
    );
    assert!(
        !manifests()
            .iter()
            .any(|(f, m)| m["kind"] == "Secret" && !f.ends_with(".example.yaml")),
        "a Secret outside an *.example.yaml file would be applied with its values"
    );
}

#[test]
fn every_container_runs_as_65532_unprivileged_on_a_read_only_root() {
    for (file, name, pod) in pod_specs() {
        for c in containers(&pod) {
            let at = format!("{file}: {name}/{}", c["name"]);
            let sc = &c["securityContext"];
            assert_eq!(
                effective(&pod, c, "/runAsNonRoot"),
                true,
                "{at}: runAsNonRoot"
            );
            assert_eq!(effective(&pod, c, "/runAsUser"), 65532, "{at}: runAsUser");
            assert_eq!(
                effective(&pod, c, "/seccompProfile/type"),
                "RuntimeDefault",
                "{at}: seccompProfile"
            );
            assert_eq!(
                sc["readOnlyRootFilesystem"], true,
                "{at}: readOnlyRootFilesystem"
            );
            assert_eq!(
                sc["allowPrivilegeEscalation"], false,
                "{at}: allowPrivilegeEscalation"
            );
            assert_ne!(sc["privileged"], true, "{at}: privileged");
            assert!(
                sc["capabilities"]["drop"]
                    .as_array()
                    .is_some_and(|d| d.iter().any(|c| c == "ALL")),
                "{at}: capabilities.drop does not hold ALL"
            );
            assert!(
                sc["capabilities"]["add"]
                    .as_array()
                    .is_none_or(|a| a.is_empty()),
                "{at}: adds capabilities"
            );
            for kind in ["requests", "limits"] {
                for r in ["cpu", "memory"] {
                    assert!(
                        !c["resources"][kind][r].is_null(),
                        "{at}: no resources.{kind}.{r}"
                    );
                }
            }
        }
        // Above the longest graceful stop (a relay's batch: twice message.timeout.ms, 20 s
        // by default; a dispatcher's request: --timeout, 10 s), with room.
        let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
        assert!(
            grace >= 30,
            "{file}: {name}: terminationGracePeriodSeconds {grace} is below idem's stop bound"
        );
        assert_eq!(
            pod["automountServiceAccountToken"], false,
            "{file}: {name}: idem needs no Kubernetes API token"
        );
    }
}

#[test]
fn every_container_is_probed_on_healthz_and_readyz_of_its_metrics_port() {
    for (file, name, pod) in pod_specs() {
        for c in containers(&pod) {
            let at = format!("{file}: {name}/{}", c["name"]);
            let args: Vec<&str> = c["args"]
                .as_array()
                .unwrap_or_else(|| panic!("{at}: no args"))
                .iter()
                .map(|a| a.as_str().unwrap())
                .collect();
            assert!(
                args.contains(&"--metrics-addr=0.0.0.0:9464"),
                "{at}: serves its metrics and probes on 0.0.0.0:9464: {args:?}"
            );
            let port = c["ports"]
                .as_array()
                .and_then(|ps| ps.iter().find(|p| p["name"] == "metrics"))
                .unwrap_or_else(|| panic!("{at}: no port named metrics"));
            assert_eq!(port["containerPort"], 9464, "{at}");
            for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
                let get = &c[probe]["httpGet"];
                assert_eq!(get["path"], path, "{at}: {probe}");
                assert!(
                    get["port"] == "metrics" || get["port"] == 9464,
                    "{at}: {probe} is not on the metrics port: {}",
                    get["port"]
                );
            }
        }
    }
}

/// A name that holds a secret, or a database URL with its password.
fn secret_name(name: &str) -> bool {
    let n = name.to_ascii_uppercase().replace('-', "_");
    ["PASSWORD", "SECRET", "TOKEN", "DB", "AUTHORIZATION"]
        .iter()
        .any(|s| n.ends_with(s))
}

#[test]
fn secrets_reach_the_containers_as_files_never_as_values() {
    let manifests = manifests();
    // The ConfigMaps hold no secret either (every pod reads them as environment).
    for (file, m) in manifests.iter().filter(|(_, m)| m["kind"] == "ConfigMap") {
        for key in m["data"].as_object().into_iter().flat_map(|d| d.keys()) {
            assert!(!secret_name(key), "{file}: ConfigMap key {key} is a secret");
        }
    }
    let mut files_seen = 0;
    for (file, name, pod) in pod_specs() {
        for c in containers(&pod) {
            let at = format!("{file}: {name}/{}", c["name"]);
            for e in c["env"].as_array().into_iter().flatten() {
                let var = e["name"].as_str().unwrap();
                if secret_name(var) {
                    assert!(
                        e["value"].is_null() && !e["valueFrom"]["secretKeyRef"].is_null(),
                        "{at}: {var} has a literal value: give the secret as a file ({var}_FILE) or a secretKeyRef"
                    );
                }
                // A `_FILE` variable names a file of a mounted Secret, by a key it mounts.
                if let (Some(_), Some(path)) = (var.strip_suffix("_FILE"), e["value"].as_str()) {
                    let mount = c["volumeMounts"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .find(|m| {
                            path.starts_with(&format!("{}/", m["mountPath"].as_str().unwrap()))
                        })
                        .unwrap_or_else(|| panic!("{at}: {var}={path} is in no mounted volume"));
                    assert_eq!(mount["readOnly"], true, "{at}: {path}'s mount is writable");
                    let volume = pod["volumes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .find(|v| v["name"] == mount["name"])
                        .unwrap_or_else(|| panic!("{at}: no volume {}", mount["name"]));
                    let secret = &volume["secret"];
                    assert!(!secret.is_null(), "{at}: {var}'s volume is not a Secret");
                    let rel = &path[mount["mountPath"].as_str().unwrap().len() + 1..];
                    if let Some(items) = secret["items"].as_array() {
                        assert!(
                            items.iter().any(|i| i["path"] == rel),
                            "{at}: {var}={path}: the volume mounts no key at {rel}"
                        );
                    }
                    files_seen += 1;
                }
            }
            for a in c["args"].as_array().into_iter().flatten() {
                let flag = a.as_str().unwrap().split('=').next().unwrap();
                if let Some(flag) = flag.strip_prefix("--") {
                    assert!(
                        !secret_name(flag),
                        "{at}: --{flag} on the command line (visible to every user of the node)"
                    );
                }
            }
        }
    }
    assert!(
        files_seen >= 3,
        "every workload reads its database URL from a file"
    );
}

/// The `idem` binary the flags are checked against: `IDEM_BIN`, else the one in the target
/// directory this test was built in (`cargo build -p idem-cli --bin idem`; the workspace's test
/// run builds it too).
fn idem_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("IDEM_BIN") {
        return p.into();
    }
    // This test runs as <target>/<profile>/deps/deploy-HASH.
    let exe = std::env::current_exe().unwrap();
    let bin = exe.parent().unwrap().parent().unwrap().join("idem");
    assert!(
        bin.is_file(),
        "no idem binary at {}: build it first (`cargo build -p idem-cli --bin idem` with the same \
         CARGO_TARGET_DIR), or name one with IDEM_BIN",
        bin.display()
    );
    bin
}

/// The long flags `idem <subcommand> --help` lists.
fn flags_of(bin: &Path, subcommand: &[&str]) -> BTreeSet<String> {
    let out = std::process::Command::new(bin)
        .args(subcommand)
        .arg("--help")
        .env_clear()
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "idem {} --help failed: {}{}",
        subcommand.join(" "),
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter_map(|w| w.strip_prefix("--"))
        .filter(|w| !w.is_empty())
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_flag_the_manifests_pass_is_one_idem_takes() {
    let bin = idem_bin();
    let mut checked = 0;
    for (file, name, pod) in pod_specs() {
        for c in containers(&pod) {
            let at = format!("{file}: {name}/{}", c["name"]);
            assert!(
                c["command"].is_null(),
                "{at}: the image's entrypoint is idem; give args, not a command"
            );
            let args: Vec<&str> = c["args"]
                .as_array()
                .unwrap_or_else(|| panic!("{at}: no args"))
                .iter()
                .map(|a| a.as_str().unwrap())
                .collect();
            let subcommand: Vec<&str> = args
                .iter()
                .take_while(|a| !a.starts_with('-'))
                .copied()
                .collect();
            assert!(!subcommand.is_empty(), "{at}: no subcommand in {args:?}");
            let known = flags_of(&bin, &subcommand);
            for a in &args[subcommand.len()..] {
                let Some(flag) = a.strip_prefix("--") else {
                    panic!("{at}: {a:?}: give every flag as --flag=value, one argument");
                };
                let flag = flag.split('=').next().unwrap();
                assert!(
                    known.contains(flag),
                    "{at}: `idem {} --help` has no --{flag}",
                    subcommand.join(" ")
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 3, "the manifests pass --metrics-addr at least");
}
