//! `quotad demo` (the README's run command): it starts three regions (or `--regions N`),
//! prints a row of the table every second, and Ctrl-C stops everything: the process exits
//! 0 and every redis-server it started is gone.

use quotad_testkit as common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::quotad_binary;

/// Children of `pid`, from /proc.
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // Fields after the command name (which may contain spaces) close with ')'.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let ppid = rest
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
    })
}

#[test]
fn the_demo_runs_and_ctrl_c_leaves_no_process_behind() {
    let mut demo = Command::new(quotad_binary())
        .args(["demo", "--duration", "60s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn quotad demo");
    let pid = demo.id();
    let mut lines = BufReader::new(demo.stdout.take().unwrap()).lines();
    let started = Instant::now();
    let mut rows = Vec::new();
    while rows.len() < 3 {
        assert!(started.elapsed() < Duration::from_secs(30), "no table rows");
        let line = lines.next().expect("demo output").expect("utf-8");
        let cells: Vec<&str> = line.split_whitespace().collect();
        // A row: t, then (offered, enforced, admitted) per region, then the total.
        if cells.len() == 11 && cells.iter().all(|c| c.parse::<f64>().is_ok()) {
            rows.push(
                cells
                    .iter()
                    .map(|c| c.parse::<f64>().unwrap())
                    .collect::<Vec<f64>>(),
            );
        }
    }
    // Three real redis-servers (the test machine has redis-server on PATH).
    let redis: Vec<u32> = children(pid);
    assert_eq!(redis.len(), 3, "one redis-server per region: {redis:?}");
    // Before any lending (the learning period), every region enforces its escrow.
    let last = rows.last().unwrap();
    assert_eq!(
        (last[2], last[5], last[8]),
        (600.0, 300.0, 100.0),
        "{rows:?}"
    );

    assert!(
        Command::new("kill")
            .args(["-INT", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = demo.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "demo did not stop on SIGINT");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(rest.iter().any(|l| l.contains("stopped")), "{rest:?}");
    for r in redis {
        assert!(!alive(r), "redis-server {r} survived the demo");
    }
    assert!(
        !std::path::Path::new(&std::env::temp_dir().join(format!("quotad-demo-{pid}"))).exists()
    );
}

/// Without Redis (`--embedded`, as on a machine with no redis-server): the same table,
/// and the script's end stops the demo by itself.
#[test]
fn the_demo_runs_on_the_embedded_store() {
    let text = run_to_the_end(&["--embedded", "--duration", "3s"]);
    assert!(text.contains("embedded store"), "{text}");
    let rows = text
        .lines()
        .filter(|l| {
            let cells: Vec<&str> = l.split_whitespace().collect();
            cells.len() == 11 && cells.iter().all(|c| c.parse::<f64>().is_ok())
        })
        .count();
    assert!(rows >= 2, "{text}");
}

/// `--regions 5`: five regions, a redis-server each; before any lending each enforces its
/// escrow (weights 6/3/1/2/2 of 1,000/s) and the offered load is the script's 1,200/s.
/// With `--keys`, a second policy's keys are offered too and the end reports, per region,
/// what their exchange cost, and the demo key's most admitted in a second. More than ten
/// regions, or more than 100,000 keys, is refused before anything starts.
#[test]
fn the_demo_runs_any_number_of_regions_up_to_ten() {
    let text = run_to_the_end(&["--regions", "5", "--keys", "100", "--duration", "3s"]);
    assert!(text.contains("5 regions (a redis-server each)"), "{text}");
    // A row: t, then (offered, enforced, admitted) per region, then the total.
    let rows: Vec<Vec<f64>> = text
        .lines()
        .map(|l| l.split_whitespace().map(|c| c.parse::<f64>()).collect())
        .filter_map(|cells: Vec<Result<f64, _>>| {
            (cells.len() == 17)
                .then(|| cells.into_iter().collect::<Result<Vec<f64>, _>>().ok())
                .flatten()
        })
        .collect();
    let last = rows.last().unwrap_or_else(|| panic!("no rows:\n{text}"));
    let offered: f64 = (0..5).map(|r| last[1 + 3 * r]).sum();
    let enforced: Vec<f64> = (0..5).map(|r| last[2 + 3 * r]).collect();
    assert_eq!(offered, 1200.0, "{text}");
    assert_eq!(enforced, vec![429.0, 214.0, 71.0, 143.0, 143.0], "{text}");
    let most: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("customer-42: at most "))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no bound line:\n{text}"));
    assert!(most <= 1200, "{text}");
    let exchange: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("bulk keys' exchange"))
        .skip(2)
        .take(5)
        .collect();
    assert_eq!(exchange.len(), 5, "{text}");
    // region, tracked, rounds, round mean, "ms", bytes/round, bytes/key, coordinator CPU,
    // Redis CPU: every figure a number (the coordinator ran, its Redis answered).
    for line in exchange {
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cells.len(), 9, "{line}");
        let figures: Vec<f64> = [1, 2, 3, 5, 6, 7, 8]
            .iter()
            .filter_map(|&i| cells[i].parse().ok())
            .collect();
        assert_eq!(figures.len(), 7, "{line}");
    }

    for (flag, value) in [("--regions", "11"), ("--keys", "100001")] {
        let refused = Command::new(quotad_binary())
            .args(["demo", flag, value])
            .output()
            .expect("run quotad demo");
        assert!(!refused.status.success());
        assert!(String::from_utf8_lossy(&refused.stderr).contains(flag));
    }
}

/// Runs `quotad demo` with `args` until it ends by itself; its output, once it exited 0.
fn run_to_the_end(args: &[&str]) -> String {
    let out = Command::new(quotad_binary())
        .arg("demo")
        .args(args)
        .output()
        .expect("run quotad demo");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}
