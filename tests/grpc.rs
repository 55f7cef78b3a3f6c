//! Envoy's rate-limit service (`[server] grpc_listen`), through a tonic client built from
//! the same envoy-types as the server: descriptors with and without values, nested ones,
//! `hits_addend`, several descriptors in one request, unknown domains and descriptors,
//! shadow mode, an exact admission count under concurrency, and Redis dying under load.

use quotad_testkit as common;

use std::time::{Duration, Instant};

use common::{Config, Descriptor, Policy, Quotad, RedisServer, free_port};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use tonic::transport::Channel;

const DOMAIN: &str = "edge";

/// A daemon serving `config` with its gRPC listener; the port it listens on.
fn serve(config: &str) -> (Quotad, u16) {
    let port = free_port();
    let q = Quotad::serve_with(config, &format!("grpc_listen = \"127.0.0.1:{port}\""));
    (q, port)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

async fn client(port: u16) -> RateLimitServiceClient<Channel> {
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

/// A request descriptor from `(key, value)` entries.
fn desc(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..Default::default()
    }
}

fn with_hits(mut d: RateLimitDescriptor, hits: u64) -> RateLimitDescriptor {
    d.hits_addend = Some(UInt64Value { value: hits });
    d
}

async fn ask(
    c: &mut RateLimitServiceClient<Channel>,
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

/// `per_ip` 3/min on any remote address; `path` 2/s on `path=/login` only; plan=free →
/// user: `free_user` 2/h (plan=free alone: not limited); `shadowed` 1/min in shadow.
fn config(redis: &RedisServer) -> String {
    Config::redis(&redis.url())
        .policy(Policy::new("per_ip", "fixed_window", 3, "1m"))
        .policy(Policy::new("path", "fixed_window", 2, "1s"))
        .policy(Policy::new("free_user", "fixed_window", 2, "1h"))
        .policy(Policy::new("big", "fixed_window", 10, "1m"))
        .policy(Policy::new("shadowed", "fixed_window", 1, "1m").shadow())
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
            assert_eq!(
                header(&r, "ratelimit-policy"),
                Some("\"per_ip\";q=3;w=60"),
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
        // A cost no window could hold is a malformed request.
        let e = c
            .should_rate_limit(RateLimitRequest {
                domain: DOMAIN.into(),
                descriptors: vec![with_hits(bulk(), 11)],
                hits_addend: 0,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
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
        // login (2/s) is spent, per_ip has 1 left: over limit, and per_ip is refunded.
        let r = ask(&mut c, DOMAIN, vec![ip(), login(), unmatched()]).await;
        assert_eq!(code(&r), Code::OverLimit, "{r:?}");
        let codes: Vec<i32> = r.statuses.iter().map(|s| s.code).collect();
        assert_eq!(
            codes,
            [Code::Ok as i32, Code::OverLimit as i32, Code::Ok as i32]
        );
        assert_eq!(
            header(&r, "ratelimit-policy"),
            Some("\"path\";q=2;w=1"),
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

/// 500 concurrent requests on one descriptor at limit 100: exactly 100 admitted.
#[test]
fn concurrent_requests_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(Policy::new("hundred", "fixed_window", 100, "1h"))
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
    assert_eq!(ok, 100);
    let allowed = q.metric("quotad_decisions_total{outcome=\"allowed\",policy=\"hundred\"}");
    let denied = q.metric("quotad_decisions_total{outcome=\"denied\",policy=\"hundred\"}");
    assert_eq!((allowed, denied), (100.0, 400.0), "every decision counted");
}
