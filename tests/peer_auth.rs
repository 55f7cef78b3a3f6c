//! The peer endpoint moves budget, so it must refuse what it cannot trust: requests without
//! signatures, with a wrong secret, a tampered body, an old timestamp, an unknown sender,
//! a body that speaks for another region, and replays of a valid request. Each is refused
//! and counted by reason, and none changes the region's lease state; a valid request is
//! answered with a signed grant (the positive control).
//!
//! Process daemons (`Quotad::start`): the eviction test reads the daemon's log lines, and
//! the peer endpoint is met as another region meets it, in the binary a deployment runs.

use quotad_testkit as common;

use std::time::Duration;

use common::federation::{eu_with_silent_us, even_escrow};
use common::{Policy, Quotad, RedisServer, wait_for};
use quotad_core::coordinator::RegionId;
use quotad_core::coordinator::message::{Exchange, ExchangeReply, KeyReport, PolicyReport};
use quotad_daemon::testing::federation::{self as auth, HEADER_SIGNATURE, Signed};
use serde_json::Value;

const SECRET: &[u8] = b"peer-auth-test-secret-0123456789";
// Regions sorted: eu = 0 (the daemon), us = 1 (the peer the test plays).
const US: RegionId = RegionId(1);

fn config(redis: &str) -> String {
    config_with(redis, "1s", "250ms")
}

fn config_with(redis: &str, lease: &str, round: &str) -> String {
    eu_with_silent_us(redis, &String::from_utf8_lossy(SECRET))
        .policy(
            Policy::new("g", "token_bucket", 1000, "1s")
                .global(even_escrow().set("lease", lease).set("round", round)),
        )
        .to_toml()
}

fn exchange(want: f64, t_req: i64) -> Vec<u8> {
    let msg = Exchange {
        from: US,
        incarnation: 1,
        to_incarnation: 0,
        t_req,
        policies: vec![PolicyReport {
            name: "g".into(),
            applied: 1,
            keys: vec![KeyReport {
                key: "k".into(),
                demand: 900.0,
                want: Some(want),
                release: None,
                held: None,
                freed: false,
            }],
        }],
    };
    serde_json::to_vec(&msg).unwrap()
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

struct Peer {
    rt: tokio::runtime::Runtime,
    client: reqwest::Client,
    url: String,
}

impl Peer {
    /// POSTs `body` with the given auth headers; returns (status, reply signature, body).
    fn post(&self, signed: Option<&Signed>, body: &[u8]) -> (u16, Option<String>, Vec<u8>) {
        self.post_to("/v1/peer/exchange", signed, body)
    }

    /// Each request of `refused` (reason, signature, body, status) is refused with its
    /// status and reason, and not signed.
    fn assert_refused(&self, path: &str, refused: &[(&str, Option<Signed>, Vec<u8>, u16)]) {
        for (reason, signed, b, want) in refused {
            let (status, sig, reply) = self.post_to(path, signed.as_ref(), b);
            assert_eq!(
                status,
                *want,
                "{reason}: {}",
                String::from_utf8_lossy(&reply)
            );
            assert!(sig.is_none(), "{reason}: refusals are not signed replies");
            let err: Value = serde_json::from_slice(&reply).unwrap();
            assert_eq!(err["error"]["code"], *reason);
        }
    }

    fn post_to(
        &self,
        path: &str,
        signed: Option<&Signed>,
        body: &[u8],
    ) -> (u16, Option<String>, Vec<u8>) {
        self.rt.block_on(async {
            let mut req = self
                .client
                .post(format!("{}{path}", self.url))
                .header("content-type", "application/json")
                .body(body.to_vec());
            if let Some(s) = signed {
                for (name, value) in s.headers() {
                    req = req.header(name, value);
                }
            }
            let resp = req.send().await.unwrap();
            let status = resp.status().as_u16();
            let sig = resp
                .headers()
                .get(HEADER_SIGNATURE)
                .map(|v| v.to_str().unwrap().to_owned());
            (status, sig, resp.bytes().await.unwrap().to_vec())
        })
    }
}

/// A counter of the coordinator's, as `/v1/status` shows it.
fn stat(q: &Quotad, field: &str) -> Option<u64> {
    q.json("/v1/status")["coordinator"]["stats"][field].as_u64()
}

/// Waits until `/v1/status` was published by a round that started after this call: it
/// then shows every message the coordinator took before (it is published within a tenth
/// of a round of a message, and at the end of every round).
fn after_a_round(q: &Quotad) {
    let r0 = stat(q, "rounds").expect("rounds in /v1/status");
    wait_for("a round", Duration::from_secs(10), || {
        (stat(q, "rounds")? > r0 + 1).then_some(())
    });
}

/// The lease state of key "k" in eu's Redis: the book's reservations field.
fn reservations(redis: &RedisServer) -> Option<String> {
    redis::cmd("HGET")
        .arg("rl:g:g:{rl:g}:{k}")
        .arg("r")
        .query(&mut redis.conn())
        .unwrap()
}

#[test]
fn peer_requests_must_be_signed_fresh_and_unique() {
    let redis = RedisServer::start();
    let q = Quotad::start(&config(&redis.url()));
    wait_for("eu to coordinate", Duration::from_secs(10), || {
        let v: Value = q.json("/v1/status");
        (v["coordinator"]["leader"] == true).then_some(())
    });
    let peer = Peer::new(&q);
    let body = exchange(400.0, 0);
    let sign = |from: &str, secret: &[u8], ts: i64, body: &[u8]| {
        auth::sign_request(secret, from, "eu", ts, body)
    };

    let refused: Vec<(&str, Option<Signed>, Vec<u8>, u16)> = vec![
        ("unauthenticated", None, body.clone(), 401),
        (
            "bad_signature",
            Some(sign("us", b"wrong-secret-wrong-secret", now_ms(), &body)),
            body.clone(),
            401,
        ),
        (
            "bad_signature",
            Some(sign("us", SECRET, now_ms(), &exchange(1.0, 0))),
            body.clone(),
            401,
        ),
        (
            "stale",
            Some(sign("us", SECRET, now_ms() - 3_600_000, &body)),
            body.clone(),
            401,
        ),
        (
            "unknown_peer",
            Some(sign("ap", SECRET, now_ms(), &body)),
            body.clone(),
            401,
        ),
        (
            "malformed",
            Some(sign("us", SECRET, now_ms(), b"{\"f\":0}")),
            b"{\"f\":0}".to_vec(),
            400,
        ),
    ];
    peer.assert_refused("/v1/peer/exchange", &refused);
    for reason in ["unauthenticated", "stale", "unknown_peer", "malformed"] {
        assert_eq!(
            q.metric(&format!(
                "quotad_exchange_rejected_total{{reason=\"{reason}\"}}"
            )),
            1.0,
            "{reason}"
        );
    }
    assert_eq!(
        q.metric("quotad_exchange_rejected_total{reason=\"bad_signature\"}"),
        2.0
    );
    after_a_round(&q);
    assert_eq!(stat(&q, "grants"), Some(0));
    assert_eq!(stat(&q, "grants_withheld"), Some(0));
    assert_eq!(
        reservations(&redis),
        None,
        "nothing reserved for a refused request"
    );

    // The positive control: a valid request gets a loan (once the learning period after
    // the coordinator's start has passed), signed over our nonce.
    let started = std::time::Instant::now();
    let mut answered = 0;
    let (signed, grant) = wait_for("a grant", Duration::from_secs(10), || {
        let s = sign("us", SECRET, now_ms(), &body);
        let (status, sig, reply) = peer.post(Some(&s), &body);
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&reply));
        answered += 1;
        assert!(auth::verify_reply(
            SECRET,
            &s.nonce,
            &reply,
            &sig.expect("signed reply")
        ));
        let r: ExchangeReply = serde_json::from_slice(&reply).unwrap();
        // During the learning period after the coordinator's start, grants are of 0.
        let lent = r
            .policies
            .iter()
            .flat_map(|p| &p.keys)
            .filter_map(|k| k.grant)
            .any(|g| g.amount > 0.0);
        lent.then_some((s, r))
    });
    assert_eq!(grant.from, RegionId(0));
    println!("first loan after {:?}", started.elapsed());
    let held = reservations(&redis).expect("the grant's reservation is in Redis");
    assert!(!held.is_empty());
    // Every answered request asked for a loan: granted (0 while learning) or withheld.
    let grants = wait_for(
        "the status to show every answer",
        Duration::from_secs(10),
        || {
            let g = stat(&q, "grants")?;
            (g + stat(&q, "grants_withheld")? >= answered).then_some(g)
        },
    );

    // Replaying that exact request (same nonce, same signature) changes nothing.
    let (status, _, reply) = peer.post(Some(&signed), &body);
    assert_eq!(status, 401, "{}", String::from_utf8_lossy(&reply));
    assert_eq!(
        q.metric("quotad_exchange_rejected_total{reason=\"replay\"}"),
        1.0
    );
    assert_eq!(reservations(&redis).as_deref(), Some(held.as_str()));
    after_a_round(&q);
    assert_eq!(stat(&q, "grants"), Some(grants));
}

/// The authentication header lines of a signed request, for raw HTTP.
fn auth_lines(s: &Signed) -> String {
    s.headers()
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect()
}

impl Peer {
    fn new(q: &Quotad) -> Peer {
        Peer {
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            client: reqwest::Client::new(),
            url: q.url(),
        }
    }

    /// One signed request for a loan of 400: the amount granted (0 during the learning
    /// period), or None when no grant came back.
    fn ask(&self) -> Option<f64> {
        let body = exchange(400.0, 0);
        let s = auth::sign_request(SECRET, "us", "eu", now_ms(), &body);
        let (status, _, reply) = self.post(Some(&s), &body);
        if status != 200 {
            return None;
        }
        let r: ExchangeReply = serde_json::from_slice(&reply).ok()?;
        r.policies
            .iter()
            .flat_map(|p| &p.keys)
            .find_map(|k| k.grant)
            .map(|g| g.amount)
    }
}

/// With a replica attached, a lender grants only once the replica acknowledged the
/// reservation (WAIT): while the replica is stopped, no loan leaves (the requests are
/// answered without a grant, and counted as withheld); when it resumes, loans do again.
#[test]
fn a_lender_grants_only_what_a_replica_acknowledged() {
    let primary = RedisServer::start();
    let replica = RedisServer::start();
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(primary.port)
        .query(&mut replica.conn())
        .unwrap();
    wait_for("the replica to attach", Duration::from_secs(10), || {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut primary.conn())
            .ok()?;
        info.contains("connected_slaves:1").then_some(())
    });
    let q = Quotad::start(&config_with(&primary.url(), "2s", "500ms"));
    let peer = Peer::new(&q);
    wait_for(
        "a loan with the replica up",
        Duration::from_secs(15),
        || (peer.ask()? > 0.0).then_some(()),
    );

    after_a_round(&q);
    replica.signal("-STOP");
    let withheld_before = stat(&q, "grants_withheld").unwrap();
    let (waits_before, rounds_before) = (wait_calls(&primary), stat(&q, "rounds").unwrap());
    // Asked until four requests were answered without a grant (withheld; one that reaches
    // the coordinator while it probes the replica at a round can be answered 503 first):
    // never a loan.
    let mut asked = 0;
    wait_for("withheld grants counted", Duration::from_secs(10), || {
        let got = peer.ask();
        asked += 1;
        assert!(
            got.is_none_or(|a| a == 0.0),
            "a loan of {got:?} left without the replica's ack"
        );
        (stat(&q, "grants_withheld")? >= withheld_before + 4).then_some(())
    });
    // A stalled replica costs one `WAIT` timeout per round (the round probes it), not one
    // per message: each would block the coordinator for the whole timeout.
    let waits = wait_calls(&primary) - waits_before;
    let rounds = stat(&q, "rounds").unwrap() - rounds_before;
    assert!(
        waits <= rounds + 2,
        "{waits} WAITs in {rounds} rounds for {asked} requests"
    );
    replica.signal("-CONT");
    wait_for(
        "loans again once the replica acknowledges",
        Duration::from_secs(15),
        || (peer.ask()? > 0.0).then_some(()),
    );
}

/// How many `WAIT` commands the server has run.
fn wait_calls(redis: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut redis.conn())
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_wait:calls="))
        .and_then(|v| v.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// A Redis that evicts keys under memory pressure could drop a live reservation: no
/// instance coordinates on it (the region stays on its escrow) and the log says why.
#[test]
fn no_coordinator_runs_on_a_redis_that_evicts_keys() {
    let redis = RedisServer::start();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query(&mut redis.conn())
        .unwrap();
    let q = Quotad::start(&config(&redis.url()));
    wait_for("the refusal in the log", Duration::from_secs(10), || {
        q.log()
            .contains("maxmemory-policy evicts keys")
            .then_some(())
    });
    let status: Value = q.json("/v1/status");
    assert_eq!(status["coordinator"]["leader"], false, "{status}");
    assert_eq!(q.metric("quotad_coordinator_leader{region=\"eu\"}"), 0.0);
    // Checks are still answered, on the escrow (500 of 1000/s here, burst 500).
    let d = q.check1("g", "k");
    assert_eq!(d["allowed"], true, "{d}");
}

/// A signed exchange with values out of bounds (an incarnation of 2^64-1 or an hour
/// ahead, a release seq past 2^53, more keys than a round allows, an over-long key) is
/// refused whole and counted as `invalid`, and changes nothing: the same peer's next
/// valid exchange is answered as if it had never come. A body declared larger than a
/// round can carry is refused from its headers (413, nothing read), and a peer's requests
/// beyond its in-flight budget get 503 `busy` at once.
#[test]
fn absurd_values_are_refused_and_the_peer_keeps_exchanging() {
    let redis = RedisServer::start();
    let q = Quotad::start_with(&config(&redis.url()), "body_timeout = \"1s\"");
    wait_for("eu to coordinate", Duration::from_secs(10), || {
        let v: Value = q.json("/v1/status");
        (v["coordinator"]["leader"] == true).then_some(())
    });
    let peer = Peer::new(&q);
    let signed_post = |msg: &Exchange| {
        let body = serde_json::to_vec(msg).unwrap();
        let s = auth::sign_request(SECRET, "us", "eu", now_ms(), &body);
        peer.post(Some(&s), &body)
    };
    let valid: Exchange = serde_json::from_slice(&exchange(400.0, 0)).unwrap();
    let mut absurd = Vec::new();
    let mut m = valid.clone();
    m.incarnation = u64::MAX;
    absurd.push(("incarnation 2^64-1", m));
    let mut m = valid.clone();
    m.incarnation = now_ms() as u64 + 3_600_000;
    absurd.push(("incarnation an hour ahead", m));
    let mut m = valid.clone();
    m.policies[0].keys[0].release = Some(1 << 60);
    absurd.push(("release seq past 2^53", m));
    let mut m = valid.clone();
    m.policies[0].keys = (0..20_000)
        .map(|i| KeyReport {
            key: format!("k{i}"),
            demand: 1.0,
            want: None,
            release: None,
            held: None,
            freed: false,
        })
        .collect();
    absurd.push(("20,000 keys", m));
    let mut m = valid.clone();
    m.policies[0].keys[0].key = "x".repeat(600);
    absurd.push(("a 600-byte key", m));
    for (what, msg) in &absurd {
        let (status, sig, reply) = signed_post(msg);
        assert_eq!(status, 400, "{what}: {}", String::from_utf8_lossy(&reply));
        assert!(sig.is_none(), "{what}");
        let err: Value = serde_json::from_slice(&reply).unwrap();
        assert_eq!(err["error"]["code"], "invalid", "{what}");
    }
    assert_eq!(
        q.metric("quotad_exchange_rejected_total{reason=\"invalid\"}"),
        absurd.len() as f64
    );
    assert_eq!(
        reservations(&redis),
        None,
        "nothing reserved for a refused request"
    );

    // The same peer, with its real incarnation, is answered (and soon lent to).
    let grant = wait_for(
        "a grant after the refusals",
        Duration::from_secs(10),
        || {
            let (status, sig, reply) = signed_post(&valid);
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&reply));
            assert!(sig.is_some());
            let r: ExchangeReply = serde_json::from_slice(&reply).unwrap();
            r.policies[0].keys[0].grant.filter(|g| g.amount > 0.0)
        },
    );
    assert!(grant.amount > 0.0);

    // Over what a round can carry, from the headers alone: nothing of the body is read.
    let big = 10_000 * (6 * 512 + 128) + 64 * 1024 + 1;
    let s = auth::sign_request(SECRET, "us", "eu", now_ms(), &vec![b' '; big]);
    let mut raw = std::net::TcpStream::connect(("127.0.0.1", q.port)).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    use std::io::{Read, Write};
    write!(
        raw,
        "POST /v1/peer/exchange HTTP/1.1\r\nhost: q\r\ncontent-type: application/json\r\n{}content-length: {big}\r\n\r\n",
        auth_lines(&s)
    )
    .unwrap();
    let mut resp = String::new();
    let _ = raw.read_to_string(&mut resp);
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
    assert!(resp.contains("too_large"), "{resp}");

    // A signed request must declare its length (its budget is reserved from the headers):
    // a chunked body is refused with 411 before it is read.
    let body = b"{}";
    let s = auth::sign_request(SECRET, "us", "eu", now_ms(), body);
    let mut raw = std::net::TcpStream::connect(("127.0.0.1", q.port)).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        raw,
        "POST /v1/peer/exchange HTTP/1.1\r\nhost: q\r\nconnection: close\r\ncontent-type: application/json\r\n{}transfer-encoding: chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n",
        auth_lines(&s)
    )
    .unwrap();
    let mut resp = String::new();
    let _ = raw.read_to_string(&mut resp);
    assert!(resp.starts_with("HTTP/1.1 411"), "{resp}");
    assert!(resp.contains("length_required"), "{resp}");

    // Without the secret, a request that names the peer and claims a body is refused from
    // its headers: nothing read, nothing reserved.
    let mut forged = auth::sign_request(
        b"someone-without-the-secret",
        "us",
        "eu",
        now_ms(),
        &[b' '; 1024],
    );
    forged.from = "us".into();
    let mut c = std::net::TcpStream::connect(("127.0.0.1", q.port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        c,
        "POST /v1/peer/exchange HTTP/1.1\r\nhost: q\r\ncontent-type: application/json\r\n{}content-length: 1024\r\n\r\n",
        auth_lines(&forged)
    )
    .unwrap();
    let mut resp = String::new();
    let _ = c.read_to_string(&mut resp);
    assert!(resp.starts_with("HTTP/1.1 401"), "{resp}");

    // The peer itself (holding the secret) half-sending 4 MiB bodies: a few are read (until
    // the body timeout), the rest are turned away at once, none is held past the timeout.
    // (One signature for all: its nonce is remembered only once a body verifies, and
    // hashing 4 MiB forty times in a debug build would take longer than the body timeout.)
    let len = 4 << 20;
    let s = auth::sign_request(SECRET, "us", "eu", now_ms(), &vec![b' '; len]);
    let half: Vec<std::net::TcpStream> = (0..40)
        .map(|_| {
            let mut c = std::net::TcpStream::connect(("127.0.0.1", q.port)).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            write!(
                c,
                "POST /v1/peer/exchange HTTP/1.1\r\nhost: q\r\ncontent-type: application/json\r\n{}content-length: {len}\r\n\r\n",
                auth_lines(&s),
            )
            .unwrap();
            c.write_all(&vec![b' '; 64 * 1024]).unwrap();
            c
        })
        .collect();
    let started = std::time::Instant::now();
    let mut statuses = Vec::new();
    for mut c in half {
        let mut resp = String::new();
        let _ = c.read_to_string(&mut resp);
        statuses.push(resp.split_whitespace().nth(1).unwrap_or("none").to_owned());
    }
    let busy = statuses.iter().filter(|s| *s == "503").count();
    let timed_out = statuses.iter().filter(|s| *s == "408").count();
    assert!(busy >= 10, "{statuses:?}");
    assert_eq!(busy + timed_out, 40, "{statuses:?}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "held {:?}",
        started.elapsed()
    );
    assert_eq!(
        q.metric("quotad_exchange_rejected_total{reason=\"busy\"}"),
        busy as f64
    );
    // And the peer still gets through.
    let (status, _, reply) = signed_post(&valid);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&reply));
}

/// `POST /v1/peer/limits` hands out a region's runtime limits of global policies, so it is
/// held to what the exchange is: unsigned, badly signed, from an unknown region, speaking
/// for another region, or replayed, it is refused (counted by reason, unsigned); a valid
/// request gets the changes after the version it names, signed over its nonce.
#[test]
fn runtime_limit_pulls_must_be_signed_and_speak_for_their_sender() {
    let redis = RedisServer::start();
    let text = eu_with_silent_us(&redis.url(), &String::from_utf8_lossy(SECRET))
        .policy(
            Policy::new("g", "token_bucket", 1000, "1s")
                .runtime_limits(10)
                .global(even_escrow().set("lease", "1s").set("round", "250ms")),
        )
        .to_toml();
    let q = Quotad::start(&text);
    wait_for("eu to coordinate", Duration::from_secs(10), || {
        let v: Value = q.json("/v1/status");
        (v["coordinator"]["leader"] == true).then_some(())
    });
    let (status, body) = q.admin(
        "PUT",
        "/v1/limits/g/customer-42",
        Some(&serde_json::json!({"limit": 300})),
    );
    assert_eq!(status, 200, "{body}");
    let peer = Peer::new(&q);
    let path = "/v1/peer/limits";
    let ask = |from: &str| {
        serde_json::to_vec(&serde_json::json!({"from": from, "after": {"g": 0}})).unwrap()
    };
    let body = ask("us");
    let sign = |from: &str, secret: &[u8], body: &[u8]| {
        auth::sign_request(secret, from, "eu", now_ms(), body)
    };
    let refused: Vec<(&str, Option<Signed>, Vec<u8>, u16)> = vec![
        ("unauthenticated", None, body.clone(), 401),
        (
            "bad_signature",
            Some(sign("us", b"wrong-secret-wrong-secret", &body)),
            body.clone(),
            401,
        ),
        (
            "unknown_peer",
            Some(sign("ap", SECRET, &body)),
            body.clone(),
            401,
        ),
        (
            "malformed",
            Some(sign("us", SECRET, &ask("ap"))),
            ask("ap"),
            400,
        ),
    ];
    peer.assert_refused(path, &refused);

    let signed = sign("us", SECRET, &body);
    let (status, sig, reply) = peer.post_to(path, Some(&signed), &body);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&reply));
    assert!(auth::verify_reply(
        SECRET,
        &signed.nonce,
        &reply,
        &sig.expect("signed reply")
    ));
    let r: Value = serde_json::from_slice(&reply).unwrap();
    assert_eq!(r["from"], "eu");
    let changes = r["policies"]["g"]["changes"]
        .as_array()
        .expect("g's changes");
    assert_eq!(changes.len(), 1, "{r}");
    assert_eq!(changes[0]["key"], "customer-42");
    let value = changes[0]["value"].as_str().unwrap();
    assert!(
        value.starts_with("300:0:0:") && value.ends_with(":eu"),
        "{value}"
    );
    // Nothing after the version it had.
    let after = changes[0]["version"].as_u64().unwrap();
    let later =
        serde_json::to_vec(&serde_json::json!({"from": "us", "after": {"g": after}})).unwrap();
    let (status, _, reply) = peer.post_to(path, Some(&sign("us", SECRET, &later)), &later);
    assert_eq!(status, 200);
    let r: Value = serde_json::from_slice(&reply).unwrap();
    assert_eq!(r["policies"]["g"]["changes"], serde_json::json!([]), "{r}");

    // The same request again: a replay.
    let (status, _, _) = peer.post_to(path, Some(&signed), &body);
    assert_eq!(status, 401);
    assert_eq!(
        q.metric("quotad_exchange_rejected_total{reason=\"replay\"}"),
        1.0
    );
}
