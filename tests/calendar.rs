//! Calendar periods (`window = "day" | "week" | "month" | "year"` with a `time_zone`): a
//! fixed window that counts per period of the calendar in the zone. Redis's clock picks
//! the period; quotad passes the periods' bounds (`quotad_core::calendar::Periods`). The
//! script against the model across every hard boundary is `differential.rs`
//! (`fixed_window_on_the_calendar_lua_matches_rust`); here, real clocks.

use quotad_testkit as common;

use std::time::Duration;

use common::{Config, Policy, Quotad, RedisServer, header, wait_for};
use quotad_core::algorithm::{Algorithm, Limits, Since};
use quotad_core::calendar::{Calendar, Period};
use quotad_daemon::testing::redis as scripts;
use serde_json::json;

fn redis_now_us(conn: &mut redis::Connection) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
    s * 1_000_000 + us
}

fn jiff_now_us() -> i64 {
    jiff::Timestamp::now().as_microsecond()
}

/// A day's count starts over at midnight by Redis's clock: the script, with no time
/// injected, is given a Berlin day whose midnight was moved to 1.5 s from Redis's now
/// (`Periods::shifted`: the bounds are quotad's to compute, the choice of period Redis's).
/// Before it the key is full and told to retry at midnight; after it, it counts again,
/// and its reset is the next day's real end.
#[test]
fn a_count_of_days_starts_over_at_midnight_by_redis_clock() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let source = scripts::source(Algorithm::FixedWindow);
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(source)
        .query(&mut conn)
        .unwrap();
    let days = Calendar::new(Period::Day, "Europe/Berlin").unwrap();
    let now = redis_now_us(&mut conn);
    let today = days.containing(now);
    let shift = now + 1_500_000 - today.end_us;
    let periods = days.periods(now).shifted(shift);
    let midnight = today.end_us + shift;
    let l = Limits {
        limit: 2,
        window_us: Period::Day.nominal_us(),
        burst: 2,
        since: Since::ZERO,
    };
    let (frame, since) = scripts::frame_args(&l);
    let mut check = |member: &str| -> Vec<i64> {
        redis::cmd("EVALSHA")
            .arg(&sha)
            .arg(1)
            .arg("cal:{day}")
            .arg("check")
            .arg(l.limit)
            .arg(scripts::window_arg(&l, Some(&periods)))
            .arg(l.burst)
            .arg(1)
            .arg(member)
            .arg(&frame)
            .arg(&since)
            .query(&mut conn)
            .unwrap()
    };
    assert_eq!(check("a")[..2], [1, 1]);
    assert_eq!(check("b")[..2], [1, 0]);
    let denied = check("c");
    let asked = redis_now_us(&mut redis.conn());
    assert_eq!(denied[0], 0, "two a day: {denied:?}");
    // Retry at midnight: no later than it is from the instant after the call.
    assert!(
        denied[3] > 0 && denied[3] <= 1_500_000 && denied[3] >= midnight - asked,
        "retry in {} us, midnight in {} us",
        denied[3],
        midnight - asked
    );
    assert_eq!(denied[2], denied[3], "full until midnight, and no debt");
    // The key lives until midnight plus the grace, no longer.
    let pttl: i64 = redis::cmd("PTTL")
        .arg("cal:{day}")
        .query(&mut redis.conn())
        .unwrap();
    assert!((1..=2_500).contains(&pttl), "PTTL {pttl} ms");
    let after = wait_for("midnight by Redis's clock", Duration::from_secs(10), || {
        let v = check("d");
        (v[0] == 1).then_some(v)
    });
    let at = redis_now_us(&mut redis.conn());
    assert!(at >= midnight, "admitted before midnight");
    assert_eq!(after[1], 1, "the new day counts from zero: {after:?}");
    // The new day ends at the next (shifted) midnight: a whole Berlin day after it.
    let tomorrow = days.containing(today.end_us);
    let length = tomorrow.end_us - tomorrow.start_us;
    assert!(
        after[2] <= length && after[2] >= length - (at - midnight) - 1_000_000,
        "reset in {} us, the day is {length} us",
        after[2]
    );
}

/// A monthly quota through quotad: every answer's reset is the month's real end in its
/// zone, a denial's Retry-After and `retry_after_ms` too, the key's TTL the same plus the
/// grace, and `/v1/policies` and Envoy's unit say "month".
#[test]
fn a_monthly_quota_answers_with_its_months_real_end() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(
            Policy::new("plan", "fixed_window", 3, "month").set("time_zone", "America/New_York"),
        )
        .to_toml();
    let q = Quotad::serve(&config);
    let months = Calendar::new(Period::Month, "America/New_York").unwrap();
    let mut last = json!(null);
    for i in 0..3 {
        let before = jiff_now_us();
        let d = q.check1("plan", "customer-42");
        let end = months.containing(before).end_us;
        assert_eq!(d["allowed"], true, "{i}: {d}");
        assert_eq!(d["remaining"], 2 - i);
        let reset_ms = d["reset_after_ms"].as_i64().unwrap();
        let want_ms = (end - before) / 1000;
        assert!(
            (want_ms - 2_000..=want_ms + 1).contains(&reset_ms),
            "reset in {reset_ms} ms, the month ends in {want_ms} ms"
        );
        last = d;
    }
    let before = jiff_now_us();
    let (status, headers, body) = q.post(
        "/v1/check",
        &json!({"policy": "plan", "key": "customer-42"}),
    );
    let want_s = (months.containing(before).end_us - before) / 1_000_000;
    assert_eq!((status, &body["allowed"]), (200, &json!(false)), "{body}");
    let retry_ms = body["retry_after_ms"].as_i64().unwrap();
    assert!(
        (want_s * 1000 - 2_000..=want_s * 1000 + 1_000).contains(&retry_ms),
        "retry in {retry_ms} ms, the month ends in {want_s} s ({last})"
    );
    let retry_after: i64 = header(&headers, "retry-after").unwrap().parse().unwrap();
    assert!(
        (want_s - 2..=want_s + 1).contains(&retry_after),
        "Retry-After {retry_after}, the month ends in {want_s} s"
    );
    let keys = redis.keys();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&keys[0])
        .query(&mut redis.conn())
        .unwrap();
    let until_ms = (months.containing(jiff_now_us()).end_us - jiff_now_us()) / 1000;
    assert!(
        (until_ms - 2_000..=until_ms + 1_500).contains(&pttl),
        "PTTL {pttl} ms, the month ends in {until_ms} ms"
    );
    let policies = q.json("/v1/policies");
    let p = &policies["policies"][0];
    assert_eq!(
        (&p["period"], &p["time_zone"]),
        (&json!("month"), &json!("America/New_York")),
        "{p}"
    );
}
