//! The operational files stay in step with the code (no Redis needed):
//!
//! - every `quotad_*` metric used by a Grafana dashboard (dashboards/*.json) or by the
//!   Prometheus rules (deploy/prometheus/*.yml) is defined in crates/daemon/src/metrics.rs;
//! - every dashboard panel shows its queries in their unit.
//!
//! tests/prometheus.rs evaluates the same files on a live Prometheus; tests/kubernetes.rs
//! checks deploy/kubernetes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

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

/// What a panel target's query measures, read from its shape: a quantile of our
/// histograms or a `_seconds` gauge is seconds, a `rate` of bytes is bytes per second,
/// another `rate` (or a `_rate` gauge: units per second) is per second, a ratio of rates is a
/// fraction (bytes over something else: bytes per that thing), an `increase` is a count per
/// interval, a `_bytes` gauge is bytes, anything else a plain number.
fn dimension(expr: &str) -> &'static str {
    let rates = expr.matches("rate(").count() - expr.matches("irate(").count();
    let ratio = expr.split_once(" / ");
    if expr.contains("histogram_quantile") || expr.contains("time() -") {
        "seconds"
    } else if rates >= 2
        && ratio.is_some_and(|(over, under)| over.contains("_bytes") && !under.contains("_bytes"))
    {
        "bytes"
    } else if rates >= 2 && ratio.is_some() {
        "fraction"
    } else if expr.contains("rate(") && expr.contains("_bytes") {
        "bytes per second"
    } else if expr.contains("rate(process_cpu_seconds_total") {
        "number"
    } else if expr.contains("rate(") || expr.contains("_rate{") {
        "per second"
    } else if expr.contains("_seconds{") || expr.contains("_seconds ") {
        "seconds"
    } else if expr.contains("_bytes") {
        "bytes"
    } else {
        "number"
    }
}

/// The Grafana units a dimension may be shown in.
fn units_for(dimension: &str) -> &'static [&'static str] {
    match dimension {
        "seconds" => &["s", "ms", "µs"],
        "fraction" => &["percentunit"],
        "bytes per second" => &["Bps", "binBps"],
        "per second" => &["reqps", "ops", "cps"],
        "bytes" => &["bytes", "decbytes"],
        _ => &["short", "none"],
    }
}

/// Every panel's targets measure one thing, and its unit is one that thing is shown in
/// (a peer's RTT drawn as requests per second, or a count per interval as a rate, is a
/// wrong answer at 3 a.m.).
#[test]
fn every_panel_shows_its_queries_in_their_unit() {
    let mut failures = Vec::new();
    for path in files("dashboards", &["json"]) {
        let json: serde_json::Value = serde_json::from_str(&read(&path)).expect("JSON");
        for panel in panels(&json) {
            let title = panel["title"].as_str().unwrap_or("?");
            let exprs: Vec<&str> = panel["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t["expr"].as_str())
                .collect();
            let dims: BTreeSet<&str> = exprs.iter().map(|e| dimension(e)).collect();
            let unit = panel["fieldConfig"]["defaults"]["unit"]
                .as_str()
                .unwrap_or("");
            match dims.len() {
                0 => {}
                1 => {
                    let dim = dims.first().copied().unwrap_or_default();
                    if !units_for(dim).contains(&unit) {
                        failures.push(format!("{title}: {dim} shown as {unit:?}"));
                    }
                }
                _ => failures.push(format!("{title}: mixes {dims:?} under one unit {unit:?}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The panels of a dashboard, those inside collapsed rows included.
fn panels(dashboard: &serde_json::Value) -> Vec<&serde_json::Value> {
    fn walk<'a>(ps: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Value>) {
        for p in ps.as_array().into_iter().flatten() {
            out.push(p);
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

#[test]
fn the_unit_check_flags_a_mixed_or_wrong_panel() {
    assert_eq!(
        dimension("max by (peer) (quotad_peer_rtt_seconds{x=\"y\"})"),
        "seconds"
    );
    assert_eq!(
        dimension("sum(increase(quotad_store_breaker_opens_total[1m]))"),
        "number"
    );
    assert_eq!(
        dimension("sum(rate(quotad_exchange_bytes_total[1m]))"),
        "bytes per second"
    );
    assert!(!units_for(dimension("quotad_peer_up")).contains(&"reqps"));
}
