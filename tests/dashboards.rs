//! The operational files stay in step with the code (no Redis needed):
//!
//! - every `quotad_*` metric used by a Grafana dashboard (dashboards/*.json) or by the
//!   Prometheus rules (deploy/prometheus/*.yml) is defined in crates/daemon/src/metrics.rs;
//! - the config embedded in the Kubernetes ConfigMap (deploy/kubernetes/quotad.yaml) passes
//!   `quotad validate`, listens on every interface, and fits in the pod's grace period.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Files in `dir` (relative to the crate root) whose name ends with one of `exts`, sorted.
fn files(dir: &str, exts: &[&str]) -> Vec<PathBuf> {
    let dir = root().join(dir);
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| {
            p.extension()
                .and_then(|x| x.to_str())
                .is_some_and(|x| exts.contains(&x))
        })
        .collect();
    found.sort();
    assert!(
        !found.is_empty(),
        "no {exts:?} files in {}: nothing to check",
        dir.display()
    );
    found
}

/// The constructors in crates/daemon/src/metrics.rs whose first argument is a metric name, and whether
/// the metric is a histogram.
const CONSTRUCTORS: [(&str, bool); 4] = [
    ("Opts::new(", false),
    ("HistogramOpts::new(", true),
    ("IntCounter::new(", false),
    ("IntGauge::new(", false),
];

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every series name crates/daemon/src/metrics.rs exports: the string literal passed to each constructor
/// in [`CONSTRUCTORS`]; a histogram also exports `_bucket`, `_sum` and `_count`.
fn defined_metrics(src: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (ctor, histogram) in CONSTRUCTORS {
        for (at, _) in src.match_indices(ctor) {
            // `Opts::new(` also matches inside `HistogramOpts::new(`: whole paths only.
            if src[..at].chars().next_back().is_some_and(is_ident) {
                continue;
            }
            let args = src[at + ctor.len()..].trim_start();
            let name = args
                .strip_prefix('"')
                .and_then(|rest| rest.split_once('"'))
                .map(|(name, _)| name)
                .unwrap_or_else(|| {
                    panic!(
                        "crates/daemon/src/metrics.rs: the first argument of {ctor}...) at byte {at} is not a \
                         string literal; this test reads metric names from literals only"
                    )
                });
            if histogram {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
            names.insert(name.to_owned());
        }
    }
    names
}

/// The `quotad_[a-z0-9_]+` metric names in `text`. A name that continues a longer
/// identifier is skipped, and so is one after a `:`, which is the metric part of a
/// recording rule's `level:metric:operations` name, not a series quotad exports.
fn used_metrics(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (at, _) in text.match_indices("quotad_") {
        if text[..at]
            .chars()
            .next_back()
            .is_some_and(|c| is_ident(c) || c == ':')
        {
            continue;
        }
        let len = text[at..]
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(text.len() - at);
        names.insert(text[at..at + len].to_owned());
    }
    names
}

/// The names in `text` that crates/daemon/src/metrics.rs does not define.
fn unknown_metrics(text: &str, defined: &BTreeSet<String>) -> Vec<String> {
    used_metrics(text)
        .into_iter()
        .filter(|n| !defined.contains(n))
        .collect()
}

fn catalogue() -> BTreeSet<String> {
    let defined = defined_metrics(&read(&root().join("crates/daemon/src/metrics.rs")));
    assert!(
        defined.iter().any(|n| n.ends_with("_bucket")),
        "no metric names (or no histogram) found in crates/daemon/src/metrics.rs: {defined:?}"
    );
    defined
}

/// The query strings of a dashboard: panel and annotation `expr`s, template variable
/// `query` / `definition`s.
fn expressions(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr" | "query" | "definition", serde_json::Value::String(s)) => {
                        out.push(s.clone())
                    }
                    _ => expressions(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| expressions(v, out)),
        _ => {}
    }
}

#[test]
fn the_checker_reports_a_misspelled_metric() {
    let defined = catalogue();
    assert!(defined.contains("quotad_decisions_total"), "{defined:?}");
    let text = "sum(rate(quotad_decisions_totl[5m])) / job:quotad_decisions:rate5m + \
                notquotad_x + quotad_decisions_total";
    assert_eq!(
        unknown_metrics(text, &defined),
        ["quotad_decisions_totl"],
        "the scanner must flag exactly the misspelled name"
    );
}

#[test]
fn dashboards_use_only_defined_metrics() {
    let defined = catalogue();
    // A set: a template variable repeats its query in `definition`.
    let mut failures = BTreeSet::new();
    for path in files("dashboards", &["json"]) {
        let json: serde_json::Value = serde_json::from_str(&read(&path))
            .unwrap_or_else(|e| panic!("{}: not valid JSON: {e}", path.display()));
        let mut exprs = Vec::new();
        expressions(&json, &mut exprs);
        assert!(
            exprs.iter().any(|e| !used_metrics(e).is_empty()),
            "{}: no expression uses a quotad_ metric",
            path.display()
        );
        for e in &exprs {
            for name in unknown_metrics(e, &defined) {
                failures.insert(format!(
                    "{}: unknown metric {name} in `{e}`",
                    path.display()
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "metrics not defined in crates/daemon/src/metrics.rs:\n{}",
        Vec::from_iter(failures).join("\n")
    );
}

#[test]
fn prometheus_rules_use_only_defined_metrics() {
    let defined = catalogue();
    let mut failures = Vec::new();
    let paths = files("deploy/prometheus", &["yml", "yaml"]);
    assert!(
        paths.iter().any(|p| p.ends_with("quotad-rules.yml")),
        "deploy/prometheus/quotad-rules.yml is missing: {paths:?}"
    );
    for path in paths {
        let text = read(&path);
        assert!(
            !used_metrics(&text).is_empty(),
            "{}: uses no quotad_ metric",
            path.display()
        );
        for (i, line) in text.lines().enumerate() {
            for name in unknown_metrics(line, &defined) {
                failures.push(format!(
                    "{}:{}: unknown metric {name}",
                    path.display(),
                    i + 1
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "metrics not defined in crates/daemon/src/metrics.rs:\n{}",
        failures.join("\n")
    );
}

/// The literal block scalar under `key: |` in `yaml`, de-indented (YAML's own rules for a
/// block with clip chomping: ends at the first non-blank line indented no deeper than the
/// key; trailing blank lines collapse into one final newline).
fn block_scalar(yaml: &str, key: &str) -> Option<String> {
    let indent = |l: &str| l.len() - l.trim_start_matches(' ').len();
    let mut lines = yaml.lines();
    let key_indent = lines.by_ref().find_map(|l| {
        let t = l.trim();
        (t == format!("{key}: |")).then(|| indent(l))
    })?;
    let mut block = Vec::new();
    let mut block_indent = None;
    for line in lines {
        if line.trim().is_empty() {
            block.push("");
            continue;
        }
        let n = indent(line);
        if n <= key_indent {
            break;
        }
        let b = *block_indent.get_or_insert(n);
        if n < b {
            break;
        }
        block.push(&line[b..]);
    }
    while block.last() == Some(&"") {
        block.pop();
    }
    let text = block.join("\n");
    (!text.trim().is_empty()).then(|| text + "\n")
}

#[test]
fn block_scalar_extraction() {
    let yaml = "data:\n  a.toml: |\n    x = 1\n\n    [t]\n      y = 2\n\n  b: 3\n";
    assert_eq!(
        block_scalar(yaml, "a.toml").as_deref(),
        Some("x = 1\n\n[t]\n  y = 2\n")
    );
    assert_eq!(block_scalar(yaml, "b"), None);
}

#[test]
fn kubernetes_configmap_config_validates() {
    let manifest = root().join("deploy/kubernetes/quotad.yaml");
    let yaml = read(&manifest);
    let config = block_scalar(&yaml, "quotad.toml").unwrap_or_else(|| {
        panic!(
            "{}: no `quotad.toml: |` block in the ConfigMap",
            manifest.display()
        )
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("quotad.toml");
    std::fs::write(&path, &config).expect("write the extracted config");

    let out = Command::new(env!("CARGO_BIN_EXE_quotad"))
        .arg("validate")
        .arg(&path)
        .output()
        .expect("run quotad validate");
    assert!(
        out.status.success(),
        "quotad validate rejected the ConfigMap's quotad.toml ({}):\n{}{}\n--- config ---\n{config}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );

    // The same file through the library, for the values the manifest depends on.
    let settings = quotad_daemon::config::Settings::parse("quotad.toml", &config)
        .expect("valid, as quotad validate said");
    let listen = settings.server.listen;
    let pod_address = match &listen {
        quotad_daemon::server::Endpoint::Tcp(a) => a.ip().is_unspecified() && a.port() == 8686,
        quotad_daemon::server::Endpoint::Unix(_) => false,
    };
    assert!(
        pod_address,
        "server.listen is {listen}: in a pod it must be 0.0.0.0:8686 (the probes, the \
         Service and the scrape annotations use port 8686; loopback is unreachable)"
    );
    let grace = yaml
        .lines()
        .find_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds:"))
        .map(|v| v.split('#').next().unwrap_or("").trim())
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or_else(|| panic!("{}: no terminationGracePeriodSeconds", manifest.display()));
    let needed = settings.server.shutdown_delay + settings.server.drain_timeout;
    assert!(
        grace > needed,
        "terminationGracePeriodSeconds ({grace:?}) must exceed shutdown_delay + \
         drain_timeout ({needed:?}), or the kubelet kills quotad mid-drain"
    );
}
