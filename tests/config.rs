//! Config validation through the real binary: every rejected config has a fixture file in
//! tests/fixtures/config/bad/ and an asserted message naming file, line and field; every
//! shipped example validates.

use quotad_testkit as common;

use std::process::Command;

use common::{fixture, quotad_binary};

/// (fixture, expected lines: "line: field: message fragment")
const BAD: &[(&str, &[&str])] = &[
    (
        "global_escrow_missing_region.toml",
        &["12: policy[0].global.escrow: no weight for region \"eu-west\""],
    ),
    (
        "global_escrow_below_one_unit.toml",
        &[
            "13: policy[0].global.escrow: \"eu-west\" would hold 0.20 units at its escrow (burst 20 times weight 1 of 100): less than one, so cut off from its peers it admits nothing; raise the burst to at least 100",
        ],
    ),
    (
        "global_escrow_unknown_region.toml",
        &["12: policy[0].global.escrow: \"ap-south\" is neither this region nor a [[peer]]"],
    ),
    (
        "global_exchange_encoding.toml",
        &["4: coordinator.exchange_encoding: must be \"binary\" or \"json\""],
    ),
    (
        "global_runtime_limits_embedded.toml",
        &[
            "14: policy[0].runtime_limits.max_keys: runtime limits of a global policy need the Redis store",
        ],
    ),
    (
        "global_sense_too_long.toml",
        &["4: coordinator.sense: must be between 0s and 500ms"],
    ),
    (
        "global_lease_not_above_round.toml",
        &["13: policy[0].global.lease: must be longer than round (1s)"],
    ),
    (
        "global_mixed_timings.toml",
        &["21: policy[1].global.lease: every global policy must use the same lease and round"],
    ),
    (
        "global_no_peers.toml",
        &["8: policy[0].global.escrow: a global policy needs at least one [[peer]]"],
    ),
    (
        "global_window_algorithm.toml",
        &[
            "8: policy[0].algorithm: a global policy must be token_bucket or gcra",
            "11: policy[0].on_store_error: \"local\" cannot keep a global budget",
            "14: policy[0].global.allocation: unknown allocation \"fair\"",
        ],
    ),
    (
        "peer_problems.toml",
        &[
            "4: peer[0].url: \"https://10.0.0.1:8686\": must be http://HOST:PORT",
            "5: peer[0].secret: must be at least 16 bytes",
            "7: peer[1].region: duplicate peer region \"us-east\"",
            "10: peer[2].region: \"eu-west\" is this daemon's own region",
            "13: peer[3].url: a peer needs url",
            "13: peer[3].secret: a peer needs a shared secret",
        ],
    ),
    ("syntax.toml", &["1: (syntax): unclosed array table"]),
    (
        "unknown_top_key.toml",
        &["1: colour: unknown field `colour`"],
    ),
    (
        "unknown_store_key.toml",
        &["2: store.where: unknown field `where`"],
    ),
    (
        "unknown_policy_key.toml",
        &["4: policy[0].limt: unknown field `limt`"],
    ),
    (
        "missing_limit.toml",
        &["1: policy[0].limit: missing field `limit`"],
    ),
    (
        "wrong_type.toml",
        &["4: policy[0].limit: invalid type: string \"ten\", expected an integer"],
    ),
    (
        "zero_limit.toml",
        &["4: policy[0].limit: must be between 1 and 1000000000, got 0"],
    ),
    (
        "negative_limit.toml",
        &["4: policy[0].limit: must be between 1 and 1000000000, got -5"],
    ),
    ("bad_window.toml", &["5: policy[0].window: not a duration"]),
    (
        "window_too_small.toml",
        &["5: policy[0].window: must be between 1ms and 1year"],
    ),
    (
        "unknown_algorithm.toml",
        &["3: policy[0].algorithm: unknown algorithm \"leaky\""],
    ),
    (
        "burst_on_fixed_window.toml",
        &["6: policy[0].burst: burst applies only to token_bucket and gcra"],
    ),
    (
        "zero_burst.toml",
        &["6: policy[0].burst: must be between 1 and"],
    ),
    (
        "bad_fail_mode.toml",
        &["6: policy[0].on_store_error: unknown mode \"maybe\""],
    ),
    (
        "duplicate_policy.toml",
        &["8: policy[1].name: duplicate policy name \"api\""],
    ),
    (
        "bad_policy_name.toml",
        &["2: policy[0].name: must be 1-64 characters"],
    ),
    ("no_policies.toml", &["1: policy: no [[policy]] is defined"]),
    (
        "bad_listen.toml",
        &[
            "2: server.listen: must be an IP address and port (\"127.0.0.1:8686\") or a Unix socket",
            "3: server.grpc_listen: a Unix socket needs an absolute path",
        ],
    ),
    (
        "bad_redis_url.toml",
        &["2: store.redis: must be \"memory\", redis://"],
    ),
    (
        "tls_problems.toml",
        &[
            "3: store.tls_ca_file: cannot read",
            "4: store.tls_cert_file: cannot read",
            "4: store.tls_key_file: required with store.tls_cert_file",
        ],
    ),
    (
        "forward_auth_problems.toml",
        &[
            "7: policy[0].forward_auth.key: \"cookie:x\": expected \"header:<name>\"",
            "8: policy[0].forward_auth.trusted_hops: must be between 1 and 16, got 0",
            "9: policy[0].forward_auth.denied_status: must be between 400 and 499, got 500",
            "10: policy[0].forward_auth.on_missing_key: must be \"deny\", \"allow\"",
            "11: policy[0].forward_auth.cost: must be between 0 and 3, got 4",
            "20: policy[1].forward_auth.cost: must be between 0 and 2, got 5",
        ],
    ),
    (
        "override_problems.toml",
        &[
            "8: policy[0].override[0].key: name exactly one of key, prefix or glob",
            "13: policy[0].override[1].burst: burst applies only to token_bucket and gcra",
            "15: policy[0].override[2].key: must not be empty",
            "24: policy[0].override[5].key: duplicate override: override[4] names the same key; this one would never apply",
            "27: policy[0].override[6].prefix: duplicate override: override[3] names the same prefix",
        ],
    ),
    (
        "override_global.toml",
        &[
            "55: policy[0].override[0].limit: a global policy's budget is split between regions per key",
        ],
    ),
    (
        "descriptor_problems.toml",
        &[
            "10: descriptor[0].policy: unknown policy \"nope\"",
            "13: descriptor[1].domain: a top-level descriptor needs its domain",
        ],
    ),
    (
        "log_problems.toml",
        &[
            "2: log.format: must be \"text\" or \"json\"",
            "3: log.requests: must be a share of requests from 0 (off) to 1 (every request)",
        ],
    ),
    (
        "secret_sources.toml",
        &[
            "5: store.password_file: set only one of store.password, store.password_file",
            "7: coordinator.secret_file: must be at least 16 bytes",
            "11: peer[0].secret_env: the environment variable QUOTAD_TEST_SECRET_THAT_IS_NEVER_SET is not set",
            "15: peer[1].secret_file: ",
            "19: peer[2].secret_file: the secret is empty",
            "23: peer[3].secret_env: must be the name of an environment variable",
        ],
    ),
    (
        "secret_not_utf8.toml",
        &["3: store.password_file: the secret is not UTF-8 text"],
    ),
    (
        "tls_without_rediss.toml",
        &["3: store.tls_ca_file: TLS files are set but no URL is rediss://"],
    ),
    (
        "credentials_without_redis.toml",
        &["3: store.username: only with a Redis store"],
    ),
    (
        "two_topologies.toml",
        &[
            "3: store.redis_cluster: choose one topology: store.redis and store.redis_cluster are both set",
        ],
    ),
    (
        "sentinel_problems.toml",
        &[
            "2: store.redis_sentinels: needs at least one redis:// or rediss:// URL",
            "2: store.redis_sentinel_master: required with store.redis_sentinels",
        ],
    ),
    (
        "cluster_bad_seed.toml",
        &["2: store.redis_cluster: must be redis://[USER:PASSWORD@]HOST:PORT or rediss://"],
    ),
    (
        "zero_timeout.toml",
        &["3: store.timeout: must be between 1ms and 10s"],
    ),
    (
        "bad_key_prefix.toml",
        &["2: store.key_prefix: must be 1-64 characters"],
    ),
    (
        "zero_max_batch.toml",
        &["2: server.max_batch: must be between 1 and 1024, got 0"],
    ),
    (
        "shutdown_delay_too_long.toml",
        &["3: server.shutdown_delay: must be shorter than server.drain_timeout (5s)"],
    ),
    (
        "gcra_too_fast.toml",
        &["4: policy[0].limit: gcra needs window / limit of at least 1us"],
    ),
    (
        "burst_refill_too_long.toml",
        &["4: policy[0].limit: refilling burst 1000 at 1 per 1day takes longer than a year"],
    ),
    (
        "hot_key_rate_on_a_sliding_window.toml",
        &[
            "6: policy[0].hot_key_rate: hot-key slices need fixed_window, token_bucket or gcra, not sliding_window",
        ],
    ),
    (
        "concurrency_problems.toml",
        &[
            "10: policy[0].limit: must be between 1 and 10000, got 20000",
            "11: policy[0].window: must be between 100ms and 1day",
            "12: policy[0].burst: a concurrency limit has no burst",
            "13: policy[0].hot_key_rate: hot-key slices are units of a rate taken ahead",
            "14: policy[0].settle_within: a lease is released, not settled",
            "15: policy[0].shadow: a concurrency limit cannot be in shadow mode",
            "17: policy[0].global.escrow: a concurrency limit cannot be global",
            "19: policy[0].forward_auth.key: a proxy's auth subrequest cannot release what it acquired",
            "22: policy[0].override[0].limit: per-key overrides are not supported for concurrency limits",
            "33: descriptor[0].policy: \"jobs\" is a concurrency limit",
        ],
    ),
    (
        "settlement_problems.toml",
        &[
            "12: policy[0].settle_within: settlement needs token_bucket, gcra or fixed_window, not sliding_window",
            "20: policy[1].settle_within: settlement and hot_key_rate do not mix",
            "27: policy[2].settle_within: must be between 1s and 1day",
            "34: policy[3].settle_within: a global policy cannot take settlements",
            "48: descriptor[0].charge: policy \"plain\" takes no settlements",
            "53: descriptor[1].charge: a charged descriptor needs its policy on the same node",
        ],
    ),
    (
        "reserved_policy_name.toml",
        &["2: policy[0].name: \"coordinator\" is reserved"],
    ),
    (
        "calendar_problems.toml",
        &[
            "5: policy[0].window: window = \"month\" needs time_zone, where its periods start at midnight",
            "12: policy[1].time_zone: unknown time zone \"Mars/Olympus_Mons\"",
            "18: policy[2].window: a calendar period needs fixed_window, not token_bucket: a bucket refills continuously",
            "25: policy[3].window: a calendar period needs fixed_window, not sliding_window",
            "33: policy[4].time_zone: a time zone places calendar periods",
            "41: policy[5].hot_key_rate: hot-key slices are not taken from calendar periods",
            "52: policy[6].override[0].window: an override of a calendar period keeps the policy's period",
        ],
    ),
    (
        "sliding_log_too_big.toml",
        &["4: policy[0].limit: sliding_log keeps one entry per admission"],
    ),
    (
        "multiple_errors.toml",
        &[
            "1: region: must be 1-64 characters",
            "3: server.drain_timeout: not a duration",
            "7: policy[0].limit: must be between 1 and 1000000000, got 0",
            "14: policy[1].on_store_error: unknown mode \"sometimes\"",
        ],
    ),
];

#[test]
fn every_rejected_config_names_file_line_and_field() {
    let dir = fixture("tests/fixtures/config/bad");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = BAD.iter().map(|(f, _)| f.to_string()).collect();
    listed.sort();
    assert_eq!(
        on_disk, listed,
        "every fixture needs an expected message, every expectation a fixture"
    );
    for (file, expected) in BAD {
        let path = dir.join(file);
        let out = Command::new(quotad_binary())
            .arg("validate")
            .arg(&path)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{file} was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(
            lines.len(),
            expected.len(),
            "{file}: expected {} errors, got:\n{stderr}",
            expected.len()
        );
        for (line, want) in lines.iter().zip(expected.iter()) {
            let prefix = format!("{}:", path.display());
            let rest = line
                .strip_prefix(&prefix)
                .unwrap_or_else(|| panic!("{file}: {line:?} does not start with the file name"));
            assert!(
                rest.starts_with(want),
                "{file}: got {rest:?}, want {want:?}..."
            );
        }
        // The daemon refuses to start on it, with the same message.
        let serve = Command::new(quotad_binary())
            .args(["serve", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        assert_eq!(
            serve.status.code(),
            Some(1),
            "{file}: serve started on a bad config"
        );
        assert!(String::from_utf8_lossy(&serve.stderr).contains(expected[0]));
    }
}

#[test]
fn shipped_configs_validate() {
    // With what `validate` says it found: singular and plural.
    for (f, found) in [
        ("config/quotad.toml", "1 policy"),
        ("config/examples/login.toml", "2 policies"),
        ("config/examples/api.toml", "1 policy"),
        ("config/examples/envoy.toml", "3 policies"),
        ("config/examples/llm.toml", "3 policies"),
        ("config/examples/plans.toml", "3 policies"),
    ] {
        let out = Command::new(quotad_binary())
            .arg("validate")
            .arg(fixture(f))
            // login.toml's admin token, as its comment says to start it.
            .env("QUOTAD_ADMIN_TOKEN", "a-token-of-at-least-16-bytes")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{f}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.ends_with(&format!(": ok ({found})\n")),
            "{f}: {stdout}"
        );
    }
}

#[test]
fn a_missing_config_file_is_a_clear_error() {
    let out = Command::new(quotad_binary())
        .args(["validate", "/nonexistent/quotad.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("/nonexistent/quotad.toml:0: (file): cannot read")
    );
}
