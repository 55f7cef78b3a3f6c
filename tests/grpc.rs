//! Envoy's rate-limit service (`[server] grpc_listen`), through a tonic client of
//! the same Envoy messages as the server: descriptors with and without values, nested ones,
//! `hits_addend`, several descriptors in one request, unknown domains and descriptors,
//! shadow mode, an exact admission count under concurrency, and Redis dying under load.

use quotad_testkit as common;

use std::time::{Duration, Instant};

use common::grpc::RateLimitServiceClient;
use common::grpc::descriptor as desc;
use common::{Config, Descriptor, Policy, Quotad, RedisServer, free_port, runtime, wait_for};
use quotad_daemon::envoy::{
    Code, RateLimitDescriptor, RateLimitRequest, RateLimitResponse, UInt64Value, Unit,
};
use tonic::transport::Channel;

mod raw {
    //! A client that sends bytes Envoy's types cannot hold (values that are not UTF-8, a
    //! message that is not protobuf), through tonic's generic client.
    use prost::Message;
    use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
    use tonic::transport::Channel;

    use super::RateLimitResponse;

    /// `RateLimitRequest` with `bytes` where Envoy's has `string` (the same wire format).
    #[derive(Clone, PartialEq, Message)]
    pub struct Request {
        #[prost(bytes = "vec", tag = "1")]
        pub domain: Vec<u8>,
        #[prost(message, repeated, tag = "2")]
        pub descriptors: Vec<Descriptor>,
    }

    #[derive(Clone, PartialEq, Message)]
    pub struct Descriptor {
        #[prost(message, repeated, tag = "1")]
        pub entries: Vec<Entry>,
    }

    #[derive(Clone, PartialEq, Message)]
    pub struct Entry {
        #[prost(bytes = "vec", tag = "1")]
        pub key: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub value: Vec<u8>,
    }

    /// Sends `body` as the message bytes.
    #[derive(Default)]
    struct Bytes;
    struct Enc;
    struct Dec;

    impl Codec for Bytes {
        type Encode = Vec<u8>;
        type Decode = RateLimitResponse;
        type Encoder = Enc;
        type Decoder = Dec;
        fn encoder(&mut self) -> Enc {
            Enc
        }
        fn decoder(&mut self) -> Dec {
            Dec
        }
    }

    impl Encoder for Enc {
        type Item = Vec<u8>;
        type Error = tonic::Status;
        fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
            prost::bytes::BufMut::put_slice(buf, &item);
            Ok(())
        }
    }

    impl Decoder for Dec {
        type Item = RateLimitResponse;
        type Error = tonic::Status;
        fn decode(
            &mut self,
            buf: &mut DecodeBuf<'_>,
        ) -> Result<Option<RateLimitResponse>, tonic::Status> {
            RateLimitResponse::decode(buf)
                .map(Some)
                .map_err(|e| tonic::Status::internal(e.to_string()))
        }
    }

    /// `ShouldRateLimit` with `body` as the request message.
    pub async fn call(port: u16, body: Vec<u8>) -> Result<RateLimitResponse, tonic::Status> {
        let channel = Channel::from_shared(format!("http://127.0.0.1:{port}"))
            .expect("uri")
            .connect()
            .await
            .expect("connect");
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.expect("ready");
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        );
        grpc.unary(tonic::Request::new(body), path, Bytes)
            .await
            .map(|r| r.into_inner())
    }
}

const DOMAIN: &str = "edge";

/// A daemon serving `config` with its gRPC listener; the port it listens on.
fn serve(config: &str) -> (Quotad, u16) {
    let port = free_port();
    let q = Quotad::serve_with(config, &format!("grpc_listen = \"127.0.0.1:{port}\""));
    (q, port)
}

async fn client(port: u16) -> RateLimitServiceClient {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match Channel::from_shared(format!("http://127.0.0.1:{port}"))
            .expect("uri")
            .connect()
            .await
        {
            Ok(c) => return RateLimitServiceClient::new(c),
            Err(e) if Instant::now() > deadline => panic!("cannot connect: {e}"),
            Err(_) => tokio::task::yield_now().await,
        }
    }
}

fn with_hits(mut d: RateLimitDescriptor, hits: u64) -> RateLimitDescriptor {
    d.hits_addend = Some(UInt64Value { value: hits });
    d
}

async fn ask(
    c: &mut RateLimitServiceClient,
    domain: &str,
    descriptors: Vec<RateLimitDescriptor>,
) -> RateLimitResponse {
    c.should_rate_limit(RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    })
    .await
    .expect("ShouldRateLimit")
    .into_inner()
}

fn code(r: &RateLimitResponse) -> Code {
    Code::try_from(r.overall_code).expect("a known code")
}

fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key == name)
        .map(|h| h.value.as_str())
}

/// `per_ip` 3/min on any remote address (5 for 10.7.7.7, an override); `path` 2/min on `path=/login` only; plan=free →
/// user: `free_user` 2/h (plan=free alone: not limited); `big` 10/h; `shadowed` 1/min in
/// shadow. Token buckets: no window boundary can reset a count in the middle of a test.
fn config(redis: &RedisServer) -> String {
    let tb =
        |name: &str, limit: u64, window: &str| Policy::new(name, "token_bucket", limit, window);
    Config::redis(&redis.url())
        .policy(tb("per_ip", 3, "1m").with_override("key", "10.7.7.7", 5))
        .policy(tb("path", 2, "1m"))
        .policy(tb("free_user", 2, "1h"))
        .policy(tb("big", 10, "1h"))
        .policy(tb("shadowed", 1, "1m").shadow())
        .descriptor(DOMAIN, Descriptor::new("remote_address").policy("per_ip"))
        .descriptor(
            DOMAIN,
            Descriptor::new("path").value("/login").policy("path"),
        )
        .descriptor(
            DOMAIN,
            Descriptor::new("plan")
                .value("free")
                .child(Descriptor::new("user").policy("free_user")),
        )
        .descriptor(DOMAIN, Descriptor::new("bulk").policy("big"))
        .descriptor(DOMAIN, Descriptor::new("canary").policy("shadowed"))
        .to_toml()
}

#[test]
fn descriptors_with_and_without_values() {
    let redis = RedisServer::start();
    let (_q, port) = serve(&config(&redis));
    runtime().block_on(async {
        let mut c = client(port).await;
        for i in 1..=3u32 {
            let r = ask(
                &mut c,
                DOMAIN,
                vec![desc(&[("remote_address", "10.0.0.1")])],
            )
            .await;
            assert_eq!(code(&r), Code::Ok, "{r:?}");
            let s = &r.statuses[0];
            assert_eq!(s.limit_remaining, 3 - i);
            let limit = s.current_limit.as_ref().expect("a current limit");
            assert_eq!(
                (limit.requests_per_unit, Unit::try_from(limit.unit).unwrap()),
                (3, Unit::Minute)
            );
            assert_eq!(limit.name, "per_ip");
            let reset = s.duration_until_reset.as_ref().expect("a reset");
            assert!(reset.seconds <= 60, "{reset:?}");
            // One member per enforced policy, each with its pk (api/headers.rs).
            assert!(
                header(&r, "ratelimit-policy")
                    .is_some_and(|h| h.starts_with("\"per_ip\";q=3;w=60;pk=:")),
                "{r:?}"
            );
        }
        let r = ask(
            &mut c,
            DOMAIN,
            vec![desc(&[("remote_address", "10.0.0.1")])],
        )
        .await;
        assert_eq!(code(&r), Code::OverLimit, "the 4th of 3");
        assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
        assert!(header(&r, "retry-after").is_some(), "{r:?}");
        // Each value is its own key.
        let r = ask(
            &mut c,
            DOMAIN,
            vec![desc(&[("remote_address", "10.0.0.2")])],
        )
        .await;
        assert_eq!(code(&r), Code::Ok);
        assert!(
            redis.keys().iter().any(|k| k.contains("10.0.0.2")),
            "{:?}",
            redis.keys()
        );

        // A value-specific descriptor: only that value is limited.
        for _ in 0..2 {
            let r = ask(&mut c, DOMAIN, vec![desc(&[("path", "/login")])]).await;
            assert_eq!(code(&r), Code::Ok);
        }
        let r = ask(&mut c, DOMAIN, vec![desc(&[("path", "/login")])]).await;
        assert_eq!(code(&r), Code::OverLimit);
        for _ in 0..5 {
            let r = ask(&mut c, DOMAIN, vec![desc(&[("path", "/home")])]).await;
            assert_eq!(code(&r), Code::Ok, "no descriptor for /home");
            assert_eq!(r.statuses[0].current_limit, None, "not limited: {r:?}");
        }
    });
}

#[test]
fn nested_descriptors_limit_the_full_path() {
    let redis = RedisServer::start();
    let (_q, port) = serve(&config(&redis));
    runtime().block_on(async {
        let mut c = client(port).await;
        let free = |user: &str| desc(&[("plan", "free"), ("user", user)]);
        for _ in 0..2 {
            assert_eq!(
                code(&ask(&mut c, DOMAIN, vec![free("ann")]).await),
                Code::Ok
            );
        }
        let r = ask(&mut c, DOMAIN, vec![free("ann")]).await;
        assert_eq!(code(&r), Code::OverLimit, "{r:?}");
        let limit = r.statuses[0].current_limit.clone().unwrap();
        assert_eq!(
            (limit.name.as_str(), limit.unit),
            ("free_user", Unit::Hour as i32)
        );
        assert_eq!(
            code(&ask(&mut c, DOMAIN, vec![free("bob")]).await),
            Code::Ok
        );
        // The key is the entry values joined with "|".
        assert!(
            redis.keys().iter().any(|k| k.contains("free|ann")),
            "{:?}",
            redis.keys()
        );
        // plan=free alone names no policy; plan=paid has no descriptor.
        for d in [
            desc(&[("plan", "free")]),
            desc(&[("plan", "paid"), ("user", "ann")]),
        ] {
            for _ in 0..5 {
                let r = ask(&mut c, DOMAIN, vec![d.clone()]).await;
                assert_eq!(code(&r), Code::Ok, "{r:?}");
                assert_eq!(r.statuses[0].current_limit, None);
            }
        }
    });
}

#[test]
fn hits_addend_is_the_cost_and_zero_peeks() {
    let redis = RedisServer::start();
    let (_q, port) = serve(&config(&redis));
    runtime().block_on(async {
        let mut c = client(port).await;
        let bulk = || desc(&[("bulk", "job")]);
        let r = ask(&mut c, DOMAIN, vec![with_hits(bulk(), 4)]).await;
        assert_eq!(r.statuses[0].limit_remaining, 6, "{r:?}");
        for _ in 0..3 {
            let r = ask(&mut c, DOMAIN, vec![with_hits(bulk(), 0)]).await;
            assert_eq!(
                (code(&r), r.statuses[0].limit_remaining),
                (Code::Ok, 6),
                "a peek"
            );
        }
        // The request-level hits_addend applies to descriptors without their own.
        let r = c
            .should_rate_limit(RateLimitRequest {
                domain: DOMAIN.into(),
                descriptors: vec![bulk()],
                hits_addend: 5,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.statuses[0].limit_remaining, 1, "{r:?}");
        let r = ask(&mut c, DOMAIN, vec![with_hits(bulk(), 2)]).await;
        assert_eq!(code(&r), Code::OverLimit, "2 more than the 1 left");
        let r = ask(&mut c, DOMAIN, vec![bulk()]).await;
        assert_eq!(
            (code(&r), r.statuses[0].limit_remaining),
            (Code::Ok, 0),
            "the denial charged nothing"
        );
        // A cost no window could hold can never pass: that descriptor is over its limit
        // (not the whole call an error, which Envoy may turn into a pass).
        let r = ask(&mut c, DOMAIN, vec![with_hits(bulk(), 11)]).await;
        assert_eq!(code(&r), Code::OverLimit, "{r:?}");
    });
}

#[test]
fn several_descriptors_the_most_restrictive_wins() {
    let redis = RedisServer::start();
    let (_q, port) = serve(&config(&redis));
    runtime().block_on(async {
        let mut c = client(port).await;
        let ip = || desc(&[("remote_address", "10.1.1.1")]);
        let login = || desc(&[("path", "/login")]);
        let unmatched = || desc(&[("nothing", "here")]);
        for _ in 0..2 {
            let r = ask(&mut c, DOMAIN, vec![ip(), login(), unmatched()]).await;
            assert_eq!(code(&r), Code::Ok, "{r:?}");
            assert_eq!(r.statuses.len(), 3);
            assert_eq!(r.statuses[2].current_limit, None);
        }
        // login (2/min) is spent, per_ip has 1 left: over limit, and per_ip is refunded.
        let r = ask(&mut c, DOMAIN, vec![ip(), login(), unmatched()]).await;
        assert_eq!(code(&r), Code::OverLimit, "{r:?}");
        let codes: Vec<i32> = r.statuses.iter().map(|s| s.code).collect();
        assert_eq!(
            codes,
            [Code::Ok as i32, Code::OverLimit as i32, Code::Ok as i32]
        );
        assert!(
            header(&r, "ratelimit-policy").is_some_and(|h| h.contains("\"path\";q=2;w=60;")),
            "{r:?}"
        );
        let r = ask(&mut c, DOMAIN, vec![ip()]).await;
        assert_eq!(
            (code(&r), r.statuses[0].limit_remaining),
            (Code::Ok, 0),
            "the denied request gave per_ip's unit back: {r:?}"
        );
    });
}

#[test]
fn unknown_domains_and_descriptors_are_not_limited() {
    let redis = RedisServer::start();
    let (_q, port) = serve(&config(&redis));
    runtime().block_on(async {
        let mut c = client(port).await;
        for _ in 0..10 {
            let r = ask(
                &mut c,
                "other",
                vec![desc(&[("remote_address", "1.2.3.4")])],
            )
            .await;
            assert_eq!(code(&r), Code::Ok);
            assert_eq!(r.statuses[0].current_limit, None, "{r:?}");
            assert!(r.response_headers_to_add.is_empty(), "{r:?}");
        }
        let r = ask(&mut c, DOMAIN, vec![desc(&[("no_such_key", "v")])]).await;
        assert_eq!(code(&r), Code::Ok);
        assert_eq!(redis.dbsize(), 0, "nothing was counted");
        let e = c
            .should_rate_limit(RateLimitRequest::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "no domain: {e:?}");
    });
}

#[test]
fn shadow_mode_answers_ok_and_counts_the_denial() {
    let redis = RedisServer::start();
    let (q, port) = serve(&config(&redis));
    runtime().block_on(async {
        let mut c = client(port).await;
        for _ in 0..3 {
            let r = ask(&mut c, DOMAIN, vec![desc(&[("canary", "x")])]).await;
            assert_eq!(code(&r), Code::Ok, "shadow never denies: {r:?}");
        }
    });
    let shadow = q.metric("quotad_decisions_total{outcome=\"shadow\",policy=\"shadowed\"}");
    assert_eq!(shadow, 2.0, "the 2nd and 3rd would have been denied");
}

/// 500 concurrent requests on one descriptor at limit 100: exactly 100 admitted. The
/// store timeout and the admission queue's are generous and the policy fails closed, so
/// that a Redis call slowed by the burst (on a loaded 2-core machine) is neither an
/// unenforced `fail_open` admission nor shed: what is counted is the store's decisions.
#[test]
fn concurrent_requests_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .store("timeout", "2s")
        .store("queue_timeout", "2s")
        .policy(Policy::new("hundred", "fixed_window", 100, "1h").on_store_error("closed"))
        .descriptor(DOMAIN, Descriptor::new("tenant").policy("hundred"))
        .to_toml();
    let (q, port) = serve(&config);
    let ok = runtime().block_on(async {
        let c = client(port).await;
        let tasks: Vec<_> = (0..500)
            .map(|_| {
                let mut c = c.clone();
                tokio::spawn(async move {
                    let r = ask(&mut c, DOMAIN, vec![desc(&[("tenant", "t1")])]).await;
                    code(&r) == Code::Ok
                })
            })
            .collect();
        let mut ok = 0;
        for t in tasks {
            ok += usize::from(t.await.expect("task"));
        }
        ok
    });
    let fallbacks = q.metric("quotad_decisions_total{outcome=\"fail_closed\",policy=\"hundred\"}");
    assert_eq!((ok, fallbacks), (100, 0.0));
    let allowed = q.metric("quotad_decisions_total{outcome=\"allowed\",policy=\"hundred\"}");
    let denied = q.metric("quotad_decisions_total{outcome=\"denied\",policy=\"hundred\"}");
    assert_eq!((allowed, denied), (100.0, 400.0), "every decision counted");
}

const TIMEOUT_MS: u64 = 50;
/// Allowance on top of the store timeout for gRPC, scheduling and a debug build on 2 cores
/// (as tests/failure.rs allows HTTP).
const MARGIN_MS: u64 = 200;

/// One answer under load: when it came, how long it took, and per descriptor (open, closed)
/// its code and remaining.
#[derive(Debug, Clone)]
struct Sample {
    at: Instant,
    latency: Duration,
    result: Result<[(i32, u32); 2], String>,
}

/// Enforced: the store decided (the limits are too high to deny), so something remains.
fn enforced(s: &Sample) -> bool {
    matches!(&s.result, Ok(st) if st.iter().all(|&(code, rem)| code == Code::Ok as i32 && rem > 0))
}

/// The fail modes: `open` allows unenforced (nothing known remains), `closed` denies.
fn failed_over(s: &Sample) -> bool {
    matches!(&s.result, Ok([open, closed])
        if *open == (Code::Ok as i32, 0) && closed.0 == Code::OverLimit as i32)
}

async fn wait_samples(
    samples: &std::sync::Mutex<Vec<Sample>>,
    since: Instant,
    what: &str,
    pred: fn(&Sample) -> bool,
) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        {
            let s = samples.lock().unwrap();
            let recent: Vec<&Sample> = s.iter().filter(|x| x.at >= since).collect();
            if recent.len() >= 3 && recent[recent.len() - 3..].iter().all(|x| pred(x)) {
                return Instant::now();
            }
        }
        assert!(Instant::now() < deadline, "no {what} within 10 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[test]
fn redis_killed_mid_load_each_policy_fails_its_way_in_time() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    let mut redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .store("timeout", format!("{TIMEOUT_MS}ms"))
        .store("probe_interval", "100ms")
        .policy(Policy::new("p-open", "token_bucket", 100_000, "1m").on_store_error("open"))
        .policy(Policy::new("p-closed", "fixed_window", 100_000, "1m").on_store_error("closed"))
        .descriptor(DOMAIN, Descriptor::new("open").policy("p-open"))
        .descriptor(DOMAIN, Descriptor::new("closed").policy("p-closed"))
        .to_toml();
    // A process daemon: the latency bound is about the binary, not a daemon sharing this
    // process with the load.
    let port = free_port();
    let q = Quotad::start_with(&config, &format!("grpc_listen = \"127.0.0.1:{port}\""));
    let samples = Arc::new(Mutex::new(Vec::<Sample>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    runtime().block_on(async {
        let c = client(port).await;
        let load: Vec<_> = (0..3)
            .map(|i| {
                let (mut c, samples, stop) = (c.clone(), samples.clone(), stop.clone());
                tokio::spawn(async move {
                    let key = format!("k{i}");
                    while !stop.load(Ordering::Relaxed) {
                        let started = Instant::now();
                        let r = c
                            .should_rate_limit(RateLimitRequest {
                                domain: DOMAIN.into(),
                                descriptors: vec![
                                    desc(&[("open", &key)]),
                                    desc(&[("closed", &key)]),
                                ],
                                hits_addend: 0,
                            })
                            .await;
                        let latency = started.elapsed();
                        let result = r.map_err(|e| e.to_string()).map(|r| {
                            let r = r.into_inner();
                            let s = |i: usize| (r.statuses[i].code, r.statuses[i].limit_remaining);
                            [s(0), s(1)]
                        });
                        samples.lock().unwrap().push(Sample {
                            at: Instant::now(),
                            latency,
                            result,
                        });
                    }
                })
            })
            .collect();
        wait_samples(&samples, Instant::now(), "enforced answers", enforced).await;
        redis.kill();
        wait_samples(&samples, Instant::now(), "fail-mode answers", failed_over).await;
        redis.restart();
        let restarted = Instant::now();
        let back = wait_samples(&samples, restarted, "enforcement again", enforced).await;
        stop.store(true, Ordering::Relaxed);
        for t in load {
            t.await.expect("load task");
        }
        eprintln!("enforcement back {:?} after the restart", back - restarted);
    });
    let samples = samples.lock().unwrap();
    let errors: Vec<_> = samples.iter().filter(|s| s.result.is_err()).collect();
    assert!(
        errors.is_empty(),
        "{} gRPC errors, e.g. {:?}",
        errors.len(),
        errors.first()
    );
    let slowest = samples.iter().map(|s| s.latency).max().unwrap();
    eprintln!("{} answers, slowest {slowest:?}", samples.len());
    assert!(
        slowest <= Duration::from_millis(TIMEOUT_MS + MARGIN_MS),
        "slowest answer {slowest:?} exceeds the {TIMEOUT_MS} ms timeout plus {MARGIN_MS} ms"
    );
    for (policy, outcome) in [("p-open", "fail_open"), ("p-closed", "fail_closed")] {
        let n = q.metric(&format!(
            "quotad_decisions_total{{outcome=\"{outcome}\",policy=\"{policy}\"}}"
        ));
        assert!(n > 0.0, "{policy}: no {outcome} counted");
    }
}

/// The gRPC listener holds at most `server.grpc_max_connections` connections
/// (`quotad_connections_open{listener="grpc"}`); one more waits in the backlog, unanswered, and is
/// served as soon as a slot frees.
#[test]
fn the_grpc_listener_holds_at_most_grpc_max_connections() {
    let redis = RedisServer::start();
    let port = free_port();
    let server = format!("grpc_listen = \"127.0.0.1:{port}\"\ngrpc_max_connections = 2");
    let q = Quotad::serve_with(&config(&redis), &server);
    let rt = runtime();
    rt.block_on(async {
        let ip = || vec![desc(&[("remote_address", "10.9.9.9")])];
        let mut a = client(port).await;
        let mut b = client(port).await;
        ask(&mut a, DOMAIN, ip()).await;
        ask(&mut b, DOMAIN, ip()).await;
        assert_eq!(q.metric("quotad_connections_open{listener=\"grpc\"}"), 2.0);
        // A third connection: TCP connects (the backlog), but nothing answers it.
        let third = tokio::spawn(async move {
            let mut c = client(port).await;
            ask(
                &mut c,
                DOMAIN,
                vec![desc(&[("remote_address", "10.8.8.8")])],
            )
            .await
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!third.is_finished(), "a third connection was served");
        drop(a);
        let r = tokio::time::timeout(Duration::from_secs(10), third)
            .await
            .expect("served once a slot freed")
            .unwrap();
        assert_eq!(code(&r), Code::Ok);
    });
    wait_for("the count to follow", Duration::from_secs(5), || {
        (q.metric("quotad_connections_open{listener=\"grpc\"}") <= 2.0).then_some(())
    });
}

/// Sockets that never send the HTTP/2 preface hold their slots only until
/// `server.header_timeout`: with both slots taken by silent sockets, a real client is
/// served once the server has closed them, and each is counted.
#[test]
fn silent_sockets_lose_their_slot_after_the_header_timeout() {
    use std::io::Read;
    let redis = RedisServer::start();
    let port = free_port();
    let server = format!(
        "grpc_listen = \"127.0.0.1:{port}\"\ngrpc_max_connections = 2\nheader_timeout = \"1s\""
    );
    let q = Quotad::serve_with(&config(&redis), &server);
    let silent: Vec<std::net::TcpStream> = (0..2)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    wait_for("both slots taken", Duration::from_secs(5), || {
        (q.metric("quotad_connections_open{listener=\"grpc\"}") == 2.0).then_some(())
    });
    let r = runtime().block_on(async {
        let mut c = client(port).await;
        let ask = ask(
            &mut c,
            DOMAIN,
            vec![desc(&[("remote_address", "10.7.7.7")])],
        );
        tokio::time::timeout(Duration::from_secs(10), ask)
            .await
            .expect("served once the silent sockets were closed")
    });
    assert_eq!(code(&r), Code::Ok);
    // Closed by the server: whatever it sent (its SETTINGS, maybe a GOAWAY), then EOF.
    for mut s in silent {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut rest = Vec::new();
        match s.read_to_end(&mut rest) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("a silent socket is still open: {e}"),
        }
    }
    assert_eq!(
        q.metric("quotad_connections_closed_total{listener=\"grpc\",reason=\"header_timeout\"}"),
        2.0
    );
}

/// A per-key override applies to gRPC checks as to HTTP ones: the overridden address gets
/// its own limit, reported in `current_limit`.
#[test]
fn an_overridden_key_gets_its_own_limit() {
    let redis = RedisServer::start();
    let (_q, port) = serve(&config(&redis));
    runtime().block_on(async {
        let mut c = client(port).await;
        let mut codes = Vec::new();
        for _ in 0..6 {
            let r = ask(
                &mut c,
                DOMAIN,
                vec![desc(&[("remote_address", "10.7.7.7")])],
            )
            .await;
            codes.push(code(&r));
            let limit = r.statuses[0].current_limit.as_ref().expect("a limit");
            assert_eq!(limit.requests_per_unit, 5, "{r:?}");
        }
        let mut want = vec![Code::Ok; 5];
        want.push(Code::OverLimit);
        assert_eq!(codes, want);
    });
}

/// Descriptors reload with the config: a descriptor added to the file (a wildcard value)
/// limits its requests after SIGHUP, over the same connection, and one removed stops
/// limiting; the policy's counts carry over.
#[test]
fn descriptors_reload_with_the_config() {
    let redis = RedisServer::start();
    let port = free_port();
    let q = Quotad::start_with(
        &config(&redis),
        &format!("grpc_listen = \"127.0.0.1:{port}\""),
    );
    let file = q.dir.path().join("quotad.toml");
    let original = std::fs::read_to_string(&file).unwrap();
    let rt = runtime();
    let mut c = rt.block_on(client(port));
    let tenant = || vec![desc(&[("tenant", "acme-1")])];
    let r = rt.block_on(ask(&mut c, DOMAIN, tenant()));
    assert_eq!(code(&r), Code::Ok);
    assert!(r.statuses[0].current_limit.is_none(), "not limited yet");

    let added = format!(
        "{original}\n[[descriptor]]\ndomain = \"{DOMAIN}\"\nkey = \"tenant\"\nvalue = \"acme-*\"\npolicy = \"path\"\n"
    );
    std::fs::write(&file, added).unwrap();
    q.hup();
    wait_for("the new descriptor limits", Duration::from_secs(5), || {
        let r = rt.block_on(ask(&mut c, DOMAIN, tenant()));
        r.statuses[0].current_limit.is_some().then_some(())
    });
    // `path` allows 2 a minute: the request that saw the limit was the first.
    let r = rt.block_on(ask(&mut c, DOMAIN, tenant()));
    assert_eq!((code(&r), r.statuses[0].limit_remaining), (Code::Ok, 0));
    let r = rt.block_on(ask(&mut c, DOMAIN, tenant()));
    assert_eq!(code(&r), Code::OverLimit);

    std::fs::write(&file, &original).unwrap();
    q.hup();
    wait_for("the descriptor is gone", Duration::from_secs(5), || {
        let r = rt.block_on(ask(&mut c, DOMAIN, tenant()));
        (code(&r) == Code::Ok && r.statuses[0].current_limit.is_none()).then_some(())
    });
    assert_eq!(q.metric("quotad_config_reloads_total{result=\"ok\"}"), 2.0);
}

/// What a client chooses (one header value) fails only its own descriptor: a value of
/// 600 bytes, an empty one, or one that is not UTF-8 is OVER_LIMIT for its policy, the
/// request's other descriptors are decided without being charged, and the call itself
/// succeeds (an error would let Envoy with `failure_mode_deny: false` pass the request
/// past every limit). A message that is not protobuf is INVALID_ARGUMENT, not INTERNAL.
#[test]
fn a_bad_descriptor_value_fails_only_its_own_descriptor() {
    use prost::Message;
    let redis = RedisServer::start();
    let (q, port) = serve(&config(&redis));
    runtime().block_on(async {
        let mut c = client(port).await;
        let ip = || desc(&[("remote_address", "192.0.2.1")]);
        let long = "x".repeat(600);
        for bad in [long.as_str(), ""] {
            let r = ask(&mut c, DOMAIN, vec![ip(), desc(&[("bulk", bad)])]).await;
            assert_eq!(code(&r), Code::OverLimit, "{r:?}");
            assert_eq!(r.statuses[1].code, Code::OverLimit as i32, "{r:?}");
            assert_eq!(r.statuses[0].code, Code::Ok as i32, "{r:?}");
        }
        // Not UTF-8: sent as raw bytes.
        let entry = |k: &str, v: &[u8]| raw::Entry {
            key: k.into(),
            value: v.to_vec(),
        };
        let req = raw::Request {
            domain: DOMAIN.into(),
            descriptors: vec![
                raw::Descriptor {
                    entries: vec![entry("remote_address", b"192.0.2.1")],
                },
                raw::Descriptor {
                    entries: vec![entry("bulk", b"job-\xff")],
                },
            ],
        };
        let r = raw::call(port, req.encode_to_vec())
            .await
            .expect("a bad value is an answer, not an error");
        assert_eq!(code(&r), Code::OverLimit, "{r:?}");
        assert_eq!(r.statuses[1].code, Code::OverLimit as i32, "{r:?}");
        // Nothing of the three requests was charged: per_ip still has its 3.
        for i in 0..3 {
            let r = ask(&mut c, DOMAIN, vec![ip()]).await;
            assert_eq!(code(&r), Code::Ok, "admission {i}: {r:?}");
        }
        assert_eq!(
            code(&ask(&mut c, DOMAIN, vec![ip()]).await),
            Code::OverLimit
        );
        let e = raw::call(port, vec![0xff, 0xff, 0xff])
            .await
            .expect_err("not protobuf");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    });
    assert!(
        q.metric("quotad_grpc_invalid_descriptors_total{policy=\"big\"}") >= 3.0,
        "each bad descriptor counted"
    );
}

/// An entry value holding the separator cannot pose as two entries: `user = "free|ann"`
/// alone and `plan = "free", user = "ann"` are two keys of one policy.
#[test]
fn a_value_with_the_separator_is_not_two_entries() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(Policy::new("per_user", "token_bucket", 2, "1h"))
        .descriptor(DOMAIN, Descriptor::new("user").policy("per_user"))
        .descriptor(
            DOMAIN,
            Descriptor::new("plan")
                .value("free")
                .child(Descriptor::new("user").policy("per_user")),
        )
        .to_toml();
    let (_q, port) = serve(&config);
    runtime().block_on(async {
        let mut c = client(port).await;
        for _ in 0..2 {
            let r = ask(&mut c, DOMAIN, vec![desc(&[("user", "free|ann")])]).await;
            assert_eq!(code(&r), Code::Ok);
        }
        let r = ask(&mut c, DOMAIN, vec![desc(&[("user", "free|ann")])]).await;
        assert_eq!(code(&r), Code::OverLimit);
        let r = ask(
            &mut c,
            DOMAIN,
            vec![desc(&[("plan", "free"), ("user", "ann")])],
        )
        .await;
        assert_eq!(code(&r), Code::Ok, "another key: {r:?}");
    });
}

/// A descriptor marked `charge = true` is Envoy's response path: its hits are charged
/// whole, past what the key has (debt), answered `OK`, and stand even when another
/// descriptor of the call is over its limit; a hit of 0 on it is the request path's peek,
/// `OVER_LIMIT` while the key is in debt.
#[test]
fn a_charged_descriptor_is_counted_never_denied_and_never_given_back() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(
            Policy::new("tokens", "token_bucket", 10, "1h")
                .burst(100)
                .set("settle_within", "1m"),
        )
        .policy(Policy::new("calls", "token_bucket", 1, "1h"))
        .descriptor("llm", Descriptor::new("api_key").policy("tokens").charge())
        .descriptor("llm", Descriptor::new("caller").policy("calls"))
        .to_toml();
    let (q, port) = serve(&config);
    runtime().block_on(async {
        let mut c = client(port).await;
        let tokens = |hits| with_hits(desc(&[("api_key", "k")]), hits);
        let r = ask(&mut c, "llm", vec![tokens(0)]).await;
        assert_eq!(code(&r), Code::Ok, "a peek of a fresh key: {r:?}");
        // 150 of 100: charged whole, answered OK.
        let r = ask(&mut c, "llm", vec![tokens(150)]).await;
        assert_eq!(code(&r), Code::Ok, "{r:?}");
        assert_eq!(r.statuses[0].limit_remaining, 0);
        let r = ask(&mut c, "llm", vec![tokens(0)]).await;
        assert_eq!(code(&r), Code::OverLimit, "in debt: {r:?}");
        // Another descriptor over its limit does not give the charge back.
        let caller = || desc(&[("caller", "c")]);
        assert_eq!(code(&ask(&mut c, "llm", vec![caller()]).await), Code::Ok);
        let r = ask(&mut c, "llm", vec![caller(), tokens(7)]).await;
        assert_eq!(r.statuses[0].code, Code::OverLimit as i32, "{r:?}");
        assert_eq!(r.statuses[1].code, Code::Ok as i32, "{r:?}");
    });
    // 150 + 7 charged: the bucket is 57 in debt (refill in the run: a thousandth).
    let tokens: f64 = redis::cmd("HGET")
        .arg("rl:tokens:tb:{k}")
        .arg("t")
        .query(&mut redis.conn())
        .unwrap();
    assert!((-57.0..-56.9).contains(&tokens), "{tokens}");
    let charged = "quotad_settlements_total{policy=\"tokens\",result=\"charged\"}";
    assert_eq!(q.metric(charged), 2.0);
    let units = "quotad_settled_units_total{direction=\"charged\",policy=\"tokens\"}";
    assert_eq!(q.metric(units), 157.0);
}
