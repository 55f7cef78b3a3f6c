//! quotad on a TLS-only Redis (`rediss://`): with the CA that signed the server's
//! certificate it enforces, and its keys are in that Redis (read back over TLS by the
//! redis crate, not by quotad); with a CA that signed nothing the server presents it never
//! connects, every policy answers with its fail mode (never a 5xx), and the log names the
//! certificate problem. Also with mutual TLS: a client certificate the server requires.

use quotad_testkit as common;

use std::path::Path;
use std::time::Duration;

use common::tls::TlsRedis;
use common::{Config, Policy, Quotad, wait_for};
use serde_json::json;

/// A policy of 5 per day (no window ends during a test) that fails closed, and one that
/// fails open.
fn config(redis: &TlsRedis, ca: &Path) -> Config {
    Config::redis(&redis.url())
        .store("tls_ca_file", ca.display().to_string())
        .store("probe_interval", "100ms")
        // What is tested is trust, not latency: on a busy machine the first call over a
        // new TLS connection may take longer than the default 50 ms, and must not turn
        // into a fail_closed the assertions read as a refused certificate.
        .store("timeout", "500ms")
        .policy(Policy::new("five", "fixed_window", 5, "1d").on_store_error("closed"))
        .policy(Policy::new("open", "fixed_window", 5, "1d").on_store_error("open"))
}

/// A connection of the redis crate to `redis`, trusting its CA (and with its client
/// certificate when it requires one).
fn tls_conn(redis: &TlsRedis) -> redis::Connection {
    // Err: installed already by another test of this binary.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let read = |p: &Path| std::fs::read(p).expect("read PEM");
    let certs = redis::TlsCertificates {
        client_tls: redis
            .client
            .as_ref()
            .map(|(cert, key)| redis::ClientTlsConfig {
                client_cert: read(cert),
                client_key: read(key),
            }),
        root_cert: Some(read(&redis.ca)),
    };
    redis::Client::build_with_tls(redis.url(), certs)
        .expect("TLS client")
        .get_connection_with_timeout(Duration::from_secs(2))
        .expect("connect over TLS")
}

/// The storage keys whose user key is `key` (by SCAN).
fn keys_of(conn: &mut redis::Connection, key: &str) -> Vec<String> {
    let pattern = format!("*{{{key}}}");
    let mut cursor: u64 = 0;
    let mut out = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query(conn)
            .expect("SCAN");
        out.extend(batch);
        if next == 0 {
            return out;
        }
        cursor = next;
    }
}

fn outcome(q: &Quotad, policy: &str, key: &str) -> String {
    let (status, body) = q.check(&json!({"policy": policy, "key": key, "cost": 1}));
    assert_eq!(status, 200, "{policy}/{key}: {body}");
    body["outcome"].as_str().unwrap_or("?").to_owned()
}

/// Waits for the store to be connected, then: 5 allowed, then denied, and the count is in
/// the TLS Redis under the key's storage key.
fn enforces_over_tls(q: &Quotad, redis: &TlsRedis) {
    wait_for(
        "quotad to connect to the TLS redis",
        Duration::from_secs(10),
        || (q.metric("quotad_store_up") == 1.0).then_some(()),
    );
    let outcomes: Vec<String> = (0..7).map(|_| outcome(q, "five", "alice")).collect();
    assert_eq!(
        outcomes,
        [
            "allowed", "allowed", "allowed", "allowed", "allowed", "denied", "denied"
        ]
    );
    let mut conn = tls_conn(redis);
    let keys = keys_of(&mut conn, "alice");
    assert_eq!(keys.len(), 1, "one storage key for alice: {keys:?}");
    let n: i64 = redis::cmd("HGET")
        .arg(&keys[0])
        .arg("n")
        .query(&mut conn)
        .expect("HGET");
    assert_eq!(n, 5, "the admitted count is in the TLS redis");
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&keys[0])
        .query(&mut conn)
        .expect("PTTL");
    assert!(pttl > 0, "the key has a TTL ({pttl})");
}

#[test]
fn over_tls_with_the_servers_ca_checks_are_enforced_in_that_redis() {
    let redis = TlsRedis::start();
    let q = Quotad::serve(&config(&redis, &redis.ca).to_toml());
    enforces_over_tls(&q, &redis);
}

#[test]
fn with_an_untrusted_ca_policies_answer_their_fail_mode_and_the_log_names_the_certificate() {
    let redis = TlsRedis::start();
    // A process daemon: its log is the file its stderr goes to.
    let q = Quotad::start(&config(&redis, &redis.untrusted_ca).to_toml());
    // The supervisor's probe (every 100 ms) logs why it cannot connect, once per outage:
    // the rustls error, which names the certificate problem.
    let line = wait_for(
        "the supervisor's log line about the server's certificate",
        Duration::from_secs(10),
        || {
            q.log()
                .lines()
                .find(|l| l.contains("store::redis") && l.contains("certificate"))
                .map(str::to_owned)
        },
    );
    for l in q.log().lines().filter(|l| l.contains("certificate")) {
        eprintln!("log: {l}");
    }
    assert!(
        line.contains("invalid peer certificate: UnknownIssuer"),
        "the line says what is wrong with the certificate: {line}"
    );
    for _ in 0..3 {
        assert_eq!(outcome(&q, "five", "bob"), "fail_closed");
        assert_eq!(outcome(&q, "open", "bob"), "fail_open");
    }
    assert_eq!(q.metric("quotad_store_up"), 0.0);
    assert!(
        redis.ping(&redis.ca),
        "the server itself is fine: only the trust is wrong"
    );
}

#[test]
fn with_mutual_tls_the_client_certificate_is_presented() {
    let redis = TlsRedis::start_mutual();
    let (cert, key) = redis.client.clone().expect("a client certificate");
    let q = Quotad::serve(
        &config(&redis, &redis.ca)
            .store("tls_cert_file", cert.display().to_string())
            .store("tls_key_file", key.display().to_string())
            .to_toml(),
    );
    enforces_over_tls(&q, &redis);
}
