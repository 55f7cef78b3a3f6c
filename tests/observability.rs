//! What an on-call engineer reads off `/metrics`: each entry point's decision time, every
//! HTTP answer by route and status, every gRPC answer by code, Redis call latency, the
//! process's own resources, and which commit is running.

use quotad_testkit as common;

use std::time::Duration;

use common::{Config, Descriptor, Policy, Quotad, RedisServer, free_port, request};
use serde_json::json;

/// Calls `ShouldRateLimit` once with `domain` and one `user` descriptor; its gRPC code.
fn grpc_call(port: u16, domain: &str) -> tonic::Code {
    common::wait_for("the gRPC listener", Duration::from_secs(10), || {
        match common::grpc::should_rate_limit(port, domain, &[("user", "ann")]) {
            Err(tonic::Code::Unavailable) => None,
            Ok(_) => Some(tonic::Code::Ok),
            Err(code) => Some(code),
        }
    })
}

/// `git rev-parse --short=12 HEAD` of this checkout, if git can say.
fn checkout_revision() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

#[test]
fn every_entry_point_is_timed_and_every_answer_counted() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(Policy::new("api", "token_bucket", 100, "1m"))
        .policy(Policy::new("edge", "token_bucket", 100, "1m").forward_auth(
            &["header:x-api-key"],
            "deny",
            429,
        ))
        .descriptor("edge", Descriptor::new("user").policy("api"))
        .to_toml();
    let grpc = free_port();
    let q = Quotad::start_with(&config, &format!("grpc_listen = \"127.0.0.1:{grpc}\""));

    let (status, _) = q.check(&json!({"policy": "api", "key": "k"}));
    assert_eq!(status, 200);
    let (status, _) = q.check(&json!({"policy": "nope", "key": "k"}));
    assert_eq!(status, 404);
    let (status, _, _) =
        request(q.port, "GET", "/v1/authz/edge", &[("x-api-key", "k1")], "").expect("authz");
    assert_eq!(status, 200);
    let (status, _, _) = request(q.port, "GET", "/no/such/route", &[], "").expect("404");
    assert_eq!(status, 404);
    assert_eq!(grpc_call(grpc, "edge"), tonic::Code::Ok);
    assert_eq!(grpc_call(grpc, ""), tonic::Code::InvalidArgument);

    let count = |series: &str| q.metric(series);
    for entry in ["http", "forward_auth", "grpc"] {
        assert_eq!(
            count(&format!(
                "quotad_check_duration_seconds_count{{entry=\"{entry}\"}}"
            )),
            1.0,
            "{entry} timed once"
        );
    }
    for (route, status, n) in [
        ("/v1/check", "200", 1.0),
        ("/v1/check", "404", 1.0),
        ("/v1/authz/{policy}", "200", 1.0),
        ("other", "404", 1.0),
    ] {
        assert_eq!(
            count(&format!(
                "quotad_http_responses_total{{route=\"{route}\",status=\"{status}\"}}"
            )),
            n,
            "{route} {status}"
        );
    }
    assert_eq!(count("quotad_grpc_responses_total{code=\"OK\"}"), 1.0);
    assert_eq!(
        count("quotad_grpc_responses_total{code=\"INVALID_ARGUMENT\"}"),
        1.0
    );
    assert!(count("quotad_store_call_duration_seconds_count") >= 3.0);
    assert!(count("process_resident_memory_bytes") > 1e6);
    assert!(count("process_open_fds") > 3.0);
    assert!(count("process_start_time_seconds") > 1.7e9);

    let (_, text) = q.get("/metrics");
    let build = text
        .lines()
        .find(|l| l.starts_with("quotad_build_info{"))
        .expect("quotad_build_info");
    assert!(
        build.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))),
        "{build}"
    );
    if let Some(rev) = checkout_revision() {
        assert!(build.contains(&format!("revision=\"{rev}\"")), "{build}");
    }
}

/// `[log] format = "json"`: every line the daemon writes, from start to shutdown, is one
/// JSON object with a timestamp, a level and a message. The request log is off until
/// `[log] requests` turns it on (a reload suffices), and then it names the entry point,
/// route, status, trace id, policy and outcome, and the key only by its hash.
#[test]
fn json_logs_are_one_object_per_line_and_the_request_log_is_opt_in() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .log("format", "json")
        .policy(Policy::new("api", "token_bucket", 1, "1h"))
        .to_toml();
    let mut q = Quotad::start(&config);
    for _ in 0..3 {
        q.check(&json!({"policy": "api", "key": "sk_live_do_not_log"}));
    }
    let request_lines = |q: &Quotad| {
        q.log()
            .lines()
            .filter(|l| l.contains("quotad::request"))
            .count()
    };
    assert_eq!(request_lines(&q), 0, "the request log is off by default");

    let text = q.config_file_text(
        &config.replace("format = \"json\"", "format = \"json\"\nrequests = 1.0"),
    );
    assert_eq!(q.reload(&text), "ok");
    let (status, _, _) = request(
        q.port,
        "POST",
        "/v1/check",
        &[
            ("content-type", "application/json"),
            (
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
        ],
        r#"{"policy":"api","key":"sk_live_do_not_log"}"#,
    )
    .expect("check");
    assert_eq!(status, 200);
    common::wait_for("the request line", Duration::from_secs(5), || {
        (request_lines(&q) == 1).then_some(())
    });
    // A reload that would change the format keeps it as it runs, by name; the request
    // log's sample in the same file (off again) applies.
    let text = q.config_file_text(&config.replace("format = \"json\"", "format = \"text\""));
    assert_eq!(q.reload(&text), "partial");
    assert!(
        q.log()
            .contains("[log] format cannot change without a restart")
    );
    q.kill();

    let log = q.log();
    let mut lines = 0;
    for line in log.lines() {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON object ({e}): {line}"));
        for field in ["timestamp", "level", "message"] {
            assert!(v.get(field).is_some(), "no {field}: {line}");
        }
        lines += 1;
    }
    assert!(lines >= 4, "{log}");
    let request: serde_json::Value = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["target"] == "quotad::request")
        .expect("a request line");
    assert_eq!(request["entry"], "http", "{request}");
    assert_eq!(request["route"], "/v1/check");
    assert_eq!(request["status"], "200");
    assert_eq!(request["policy"], "api");
    assert_eq!(request["outcome"], "denied");
    assert_eq!(request["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(request["key_sha256"].as_str().map(str::len), Some(12));
    assert!(!log.contains("sk_live_do_not_log"), "a key in the log");
}
