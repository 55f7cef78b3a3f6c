//! The RateLimit response headers of a check: one function, [`rate_limit_headers`], for
//! every endpoint that answers with decisions (`POST /v1/check`, and the forward-auth
//! endpoint).
//!
//! `RateLimit-Policy` and `RateLimit` follow draft-ietf-httpapi-ratelimit-headers-11
//! (structured-field Lists, RFC 9651): one member per *enforced* decision, in request
//! order, so a batch reports every policy it enforced:
//!
//! ```text
//! RateLimit-Policy: "a";q=100;w=60;pk=:...:, "b";q=5;pk=:...:
//! RateLimit: "a";r=99;t=60;pk=:...:, "b";r=0;t=1;pk=:...:
//! ```
//!
//! What each parameter means, for all five algorithms (docs/api.md#headers has the table):
//!
//! - `q` (§3.1.1, the quota allocated to the partition): the quota `r` counts against,
//!   the policy's capacity: `limit` for the window algorithms, `burst` for token_bucket
//!   and gcra (a bucket holds `burst`, so `r` runs from `burst` down to 0).
//! - `w` (§3.1.3, "a non-negative, non-zero, Integer value expressing an interval in
//!   seconds ... Sub-second precision is not supported"; OPTIONAL): the time `q` is
//!   allocated over, the window, or for token_bucket and gcra the time to refill the
//!   whole burst (`burst * window / limit`, so `q / w` is the sustained rate). Sent only
//!   when that is a whole number of seconds: `w=1` for a 100 ms window would advertise a
//!   policy ten times stricter than the one enforced, and the draft offers no way to say
//!   less than a second; the parameter is optional, so it is left out.
//! - `r` (§4.1.1, the available quota): the decision's `remaining`.
//! - `t` (§4.1.2, "the number of seconds within which the client can use no more than the
//!   available quota", delay-seconds, so rounded up): after an admission, the time until
//!   the key is back to full (`reset_after_ms`; for a fixed window the window's end, for
//!   the others units return gradually before then, which the draft allows: the client
//!   "MUST NOT assume that all its service limit will be fully restored" and may be served
//!   earlier). After a refusal by the policy (a denial, or a shadow policy that would have
//!   denied), `r` units are all the client can use until the refused request could pass,
//!   so `t` is that time (`retry_after_ms`), and `Retry-After` carries the same number: §6
//!   says Retry-After "SHOULD NOT reference a point in time earlier than the end of the
//!   effective window", and Appendix B.1.4 shows the two naming the same moment.
//! - `pk` (§3.1.4/§4.1.3, a Byte Sequence): [`partition_key`], a digest of the policy and
//!   the key, never the key itself (§6.1: no sensitive information), documented so a
//!   caller can compute it (§6.1: clients should be able to predict it). It tells apart two
//!   members of one batch that name the same policy for different keys.
//!
//! Global policies are token_bucket or gcra: the same row, `r` being what this region's
//! bucket holds (it may stay below `q`, the whole budget's burst, in a region holding a
//! share of it).
//!
//! `RateLimit-Limit`, `RateLimit-Remaining` and `RateLimit-Reset` (older drafts) stay, for
//! the most restrictive enforced decision (a denied one first, else the least remaining):
//! the policy's `limit`, `remaining`, and the seconds until the key is back to full.
//! `fail_open` and `fail_closed` decisions carry no quota: the store did not answer.

use axum::http::{HeaderMap, HeaderValue};
use sha2::{Digest, Sha256};

use crate::limiter::Decision;

/// The largest sf-integer (RFC 9651 §3.3.1); a longer value would make the field invalid.
const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

/// How many bytes of the SHA-256 digest a partition key keeps: 96 bits, 16 base64 chars.
const PK_BYTES: usize = 12;

/// Sets the RateLimit headers of `decisions` on `h` (replacing any already there):
/// `RateLimit-Policy` and `RateLimit` with one member per enforced decision, the older
/// `RateLimit-Limit/Remaining/Reset` of the most restrictive one, and `Retry-After` when
/// any decision is a denial (including `fail_closed`). See the module documentation for
/// what each value means.
pub(crate) fn rate_limit_headers(h: &mut HeaderMap, decisions: &[Decision]) {
    let enforced: Vec<&Decision> = decisions
        .iter()
        .filter(|d| d.outcome.is_enforced())
        .collect();
    if !enforced.is_empty() {
        let policy: Vec<String> = enforced.iter().map(|d| policy_item(d)).collect();
        let limit: Vec<String> = enforced.iter().map(|d| service_item(d)).collect();
        set(h, "ratelimit-policy", policy.join(", "));
        set(h, "ratelimit", limit.join(", "));
    }
    if let Some(d) = enforced.iter().min_by_key(|d| (d.allowed, d.remaining)) {
        set(h, "ratelimit-limit", d.limit.to_string());
        set(h, "ratelimit-remaining", d.remaining.to_string());
        set(
            h,
            "ratelimit-reset",
            secs_ceil(d.reset_after_ms).to_string(),
        );
    }
    if let Some(s) = retry_after_secs(decisions) {
        set(h, "retry-after", s.to_string());
    }
}

/// `Retry-After` in seconds: when any decision is a denial, the longest of their waits
/// (rounded up, at least 1). It equals the `t` of the denied member that waits longest,
/// so it is never earlier than the end of a denying policy's effective window.
pub(crate) fn retry_after_secs(decisions: &[Decision]) -> Option<u64> {
    decisions
        .iter()
        .filter(|d| !d.allowed)
        .map(|d| secs_ceil(d.retry_after_ms).max(1))
        .max()
}

/// The `t` of a decision: seconds, rounded up, within which `r` is all the client can
/// use. A refusal by the policy (a denial, or a shadow one: `retry_after_ms > 0`): until
/// the refused request could pass; otherwise: until the key is back to full.
pub(crate) fn effective_window_secs(d: &Decision) -> u64 {
    if d.retry_after_ms > 0 {
        secs_ceil(d.retry_after_ms).max(1)
    } else {
        secs_ceil(d.reset_after_ms)
    }
}

/// The `pk` of a policy's key: the first 12 bytes of SHA-256(policy ‖ 0x00 ‖ key), as an
/// sf-binary (`:base64:`). Policy names hold no NUL byte, so the pair is unambiguous; the
/// key never appears, only its digest (which does not hide a key that can be guessed from
/// a few candidates: it is an identifier, not a secret).
pub fn partition_key(policy: &str, key: &str) -> String {
    let mut hash = Sha256::new();
    hash.update(policy.as_bytes());
    hash.update([0u8]);
    hash.update(key.as_bytes());
    let digest = hash.finalize();
    format!(":{}:", base64(&digest[..PK_BYTES]))
}

/// A RateLimit-Policy member: `"name";q=..;w=..;pk=:..:` (`w` only when whole seconds).
fn policy_item(d: &Decision) -> String {
    let mut s = format!("{};q={}", sf_string(&d.policy), sf_int(d.quota));
    if let Some(w) = d.quota_window_secs.filter(|w| *w > 0) {
        s.push_str(&format!(";w={}", sf_int(w)));
    }
    s.push_str(";pk=");
    s.push_str(&partition_key(&d.policy, &d.key));
    s
}

/// A RateLimit member: `"name";r=..;t=..;pk=:..:`.
fn service_item(d: &Decision) -> String {
    format!(
        "{};r={};t={};pk={}",
        sf_string(&d.policy),
        sf_int(d.remaining),
        sf_int(effective_window_secs(d)),
        partition_key(&d.policy, &d.key)
    )
}

fn secs_ceil(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

fn sf_int(n: u64) -> u64 {
    n.min(SF_INTEGER_MAX)
}

/// An sf-string (RFC 9651 §3.3.3): quoted, `"` and `\` escaped, only printable ASCII.
/// Policy names are `[A-Za-z0-9_.-]`, so this only quotes them.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars().filter(|c| (' '..='~').contains(c)) {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// Standard base64 with padding, as sf-binary serializes (RFC 9651 §3.3.5).
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn set(h: &mut HeaderMap, name: &'static str, value: String) {
    // Values are quoted names, numbers and base64: always valid header values.
    if let Ok(v) = HeaderValue::from_str(&value) {
        h.insert(name, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Outcome;

    fn get(h: &HeaderMap, name: &str) -> Option<String> {
        h.get(name).map(|v| v.to_str().unwrap().to_owned())
    }

    fn headers(ds: &[Decision]) -> HeaderMap {
        let mut h = HeaderMap::new();
        rate_limit_headers(&mut h, ds);
        h
    }

    /// A token bucket of burst 5 refilling 2 per second (the issue's example).
    fn bucket(outcome: Outcome, remaining: u64, reset_ms: u64, retry_ms: u64) -> Decision {
        Decision::for_test("tb", "k", outcome, 5, None, remaining, reset_ms, retry_ms)
    }

    #[test]
    fn q_is_the_capacity_the_remaining_counts_against() {
        let h = headers(&[bucket(Outcome::Allowed, 4, 500, 0)]);
        let pk = partition_key("tb", "k");
        // 2.5 s to refill the burst: not whole seconds, so no w.
        assert_eq!(
            get(&h, "ratelimit-policy").unwrap(),
            format!("\"tb\";q=5;pk={pk}")
        );
        assert_eq!(
            get(&h, "ratelimit").unwrap(),
            format!("\"tb\";r=4;t=1;pk={pk}")
        );
        assert_eq!(get(&h, "ratelimit-remaining").unwrap(), "4");
        assert_eq!(get(&h, "retry-after"), None);
    }

    #[test]
    fn after_a_denial_t_and_retry_after_name_the_same_moment() {
        // Empty bucket: full again in 2.5 s, one token in 0.5 s.
        let h = headers(&[bucket(Outcome::Denied, 0, 2_500, 500)]);
        let pk = partition_key("tb", "k");
        assert_eq!(
            get(&h, "ratelimit").unwrap(),
            format!("\"tb\";r=0;t=1;pk={pk}")
        );
        assert_eq!(get(&h, "retry-after").unwrap(), "1");
        // The older header keeps its meaning: the time until the key is back to full.
        assert_eq!(get(&h, "ratelimit-reset").unwrap(), "3");
        // A longer wait: both say 4 (3.2 s rounded up).
        let h = headers(&[bucket(Outcome::Denied, 1, 4_000, 3_200)]);
        assert!(get(&h, "ratelimit").unwrap().contains(";r=1;t=4;"));
        assert_eq!(get(&h, "retry-after").unwrap(), "4");
    }

    #[test]
    fn a_shadow_refusal_reports_its_wait_but_sends_no_retry_after() {
        let h = headers(&[bucket(Outcome::Shadow, 0, 2_500, 500)]);
        assert!(get(&h, "ratelimit").unwrap().starts_with("\"tb\";r=0;t=1;"));
        assert_eq!(get(&h, "retry-after"), None);
    }

    #[test]
    fn w_is_whole_seconds_or_absent() {
        let sub = Decision::for_test("fast", "k", Outcome::Allowed, 10, None, 9, 100, 0);
        let h = headers(&[sub]);
        let policy = get(&h, "ratelimit-policy").unwrap();
        assert!(policy.starts_with("\"fast\";q=10;pk=:"), "{policy}");
        // t rounds up: 100 ms is 1 s, never 0.
        assert!(
            get(&h, "ratelimit")
                .unwrap()
                .starts_with("\"fast\";r=9;t=1;")
        );
        let minute = Decision::for_test("m", "k", Outcome::Allowed, 100, Some(60), 99, 59_001, 0);
        let h = headers(&[minute]);
        assert!(
            get(&h, "ratelimit-policy")
                .unwrap()
                .starts_with("\"m\";q=100;w=60;pk=")
        );
        assert!(
            get(&h, "ratelimit")
                .unwrap()
                .starts_with("\"m\";r=99;t=60;")
        );
    }

    #[test]
    fn a_batch_lists_every_enforced_policy_in_order() {
        let ds = [
            Decision::for_test("a", "x", Outcome::Allowed, 10, Some(1), 7, 400, 0),
            Decision::for_test("open", "x", Outcome::FailOpen, 3, Some(1), 0, 0, 0),
            Decision::for_test("b", "y", Outcome::Denied, 5, Some(60), 0, 30_000, 2_100),
            Decision::for_test("c", "z", Outcome::Denied, 5, Some(60), 0, 30_000, 900),
            Decision::for_test("closed", "x", Outcome::FailClosed, 3, Some(1), 0, 0, 1_000),
        ];
        let h = headers(&ds);
        let (pa, pb, pc) = (
            partition_key("a", "x"),
            partition_key("b", "y"),
            partition_key("c", "z"),
        );
        assert_eq!(
            get(&h, "ratelimit-policy").unwrap(),
            format!("\"a\";q=10;w=1;pk={pa}, \"b\";q=5;w=60;pk={pb}, \"c\";q=5;w=60;pk={pc}")
        );
        assert_eq!(
            get(&h, "ratelimit").unwrap(),
            format!("\"a\";r=7;t=1;pk={pa}, \"b\";r=0;t=3;pk={pb}, \"c\";r=0;t=1;pk={pc}")
        );
        // Retry-After: the longest denied wait, the t of "b"; no denied t exceeds it.
        assert_eq!(get(&h, "retry-after").unwrap(), "3");
        // The older headers: the most restrictive (denied, least remaining: "b" first).
        assert_eq!(get(&h, "ratelimit-limit").unwrap(), "5");
        assert_eq!(get(&h, "ratelimit-remaining").unwrap(), "0");
        assert_eq!(get(&h, "ratelimit-reset").unwrap(), "30");
    }

    #[test]
    fn unenforced_decisions_carry_no_quota() {
        let closed = Decision::for_test("p", "k", Outcome::FailClosed, 3, Some(1), 0, 0, 1_000);
        let h = headers(&[closed]);
        assert_eq!(get(&h, "ratelimit"), None);
        assert_eq!(get(&h, "ratelimit-policy"), None);
        assert_eq!(get(&h, "ratelimit-limit"), None);
        assert_eq!(get(&h, "retry-after").unwrap(), "1");
        let open = Decision::for_test("p", "k", Outcome::FailOpen, 3, Some(1), 0, 0, 0);
        assert!(headers(&[open]).is_empty());
    }

    #[test]
    fn the_partition_key_is_a_documented_digest_not_the_key() {
        // printf 'api\0customer-42' | sha256sum: the first 12 bytes, base64.
        assert_eq!(partition_key("api", "customer-42"), ":JPambHSL0CSLtBFl:");
        assert_ne!(partition_key("a", "bc"), partition_key("ab", "c"));
        assert_ne!(partition_key("a", "k"), partition_key("b", "k"));
    }

    #[test]
    fn base64_pads_as_sf_binary_does() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foob"), "Zm9vYg==");
    }

    #[test]
    fn numbers_stay_sf_integers_and_names_sf_strings() {
        let huge = Decision::for_test("g", "k", Outcome::Denied, 5, None, 0, u64::MAX, u64::MAX);
        let h = headers(&[huge]);
        assert!(
            get(&h, "ratelimit")
                .unwrap()
                .contains(";t=999999999999999;")
        );
        assert_eq!(sf_string("a\"b\\c\n"), "\"a\\\"b\\\\c\"");
    }
}
