//! Debian's `prometheus` on a free loopback port, scraping quotad daemons every second and
//! evaluating a rules file every second; queried through its HTTP API. Stopped on drop.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::{free_port, request, wait_for};

pub fn prometheus_available() -> bool {
    Command::new("prometheus")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

pub struct Prometheus {
    pub port: u16,
    child: Child,
    pub dir: tempfile::TempDir,
}

impl Prometheus {
    /// Scrapes `127.0.0.1:<port>/metrics` of each of `targets` (job `quotad`) and
    /// evaluates `rules`, both every second.
    pub fn start(targets: &[u16], rules: &Path) -> Prometheus {
        assert!(
            prometheus_available(),
            "prometheus not found: the dashboard test runs Debian's. Install it with \
             `apt-get install -y prometheus` (or run `bash .ci/run`, which does)"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let targets: Vec<String> = targets.iter().map(|p| format!("'127.0.0.1:{p}'")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n\
             rule_files:\n  - '{}'\n\
             scrape_configs:\n  - job_name: quotad\n    static_configs:\n      - targets: [{}]\n",
            rules.display(),
            targets.join(", ")
        );
        let path = dir.path().join("prometheus.yml");
        std::fs::write(&path, config).expect("write prometheus.yml");
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn prometheus");
        let p = Prometheus { port, child, dir };
        wait_for("prometheus ready", Duration::from_secs(30), || {
            matches!(request(port, "GET", "/-/ready", &[], ""), Ok((200, _, _))).then_some(())
        });
        p
    }

    /// GET `path` of the HTTP API; its `data`.
    fn api(&self, path: &str) -> Value {
        let (status, _, body) = request(self.port, "GET", path, &[], "").expect("prometheus API");
        let v: Value = serde_json::from_str(&body).unwrap_or_default();
        assert!(
            status == 200 && v["status"] == "success",
            "GET {path}: {status} {body}"
        );
        v["data"].clone()
    }

    /// The series an instant query returns now.
    pub fn query(&self, expr: &str) -> Vec<Value> {
        let data = self.api(&format!("/api/v1/query?query={}", encode(expr)));
        data["result"].as_array().cloned().unwrap_or_default()
    }

    /// Every rule of the loaded rules files: (type `alerting` or `recording`, name, query).
    pub fn rules(&self) -> Vec<(String, String, String)> {
        let data = self.api("/api/v1/rules");
        let mut out = Vec::new();
        for group in data["groups"].as_array().into_iter().flatten() {
            for r in group["rules"].as_array().into_iter().flatten() {
                let s = |k: &str| r[k].as_str().unwrap_or_default().to_owned();
                out.push((s("type"), s("name"), s("query")));
            }
        }
        out
    }

    /// Whether every target was scraped successfully at least `n` times in a row.
    pub fn scraped(&self, targets: usize, n: u32) -> bool {
        let up = self.query(&format!(
            "count(count_over_time(up{{job=\"quotad\"}}[1h]) >= {n})"
        ));
        up.first()
            .and_then(|v| v["value"][1].as_str())
            .and_then(|s| s.parse::<usize>().ok())
            == Some(targets)
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encodes a query parameter (every byte but the unreserved ones).
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
