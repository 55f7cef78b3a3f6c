//! Signed peer exchanges: an exchange moves budget, so a peer endpoint that took unsigned
//! or replayed requests would let anyone on the network lower (or raise) a region's share.
//!
//! A request carries the sender's region, a wall-clock timestamp, a random nonce and
//! `HMAC-SHA256(secret, "quotad-exchange-v1" ‖ from ‖ to ‖ timestamp ‖ nonce ‖ body)`,
//! with the secret both regions configured for each other, and a second MAC over the same
//! fields with the body's length instead of the body: the receiver checks that one from the
//! headers alone, so a stranger who names a peer cannot make quotad read (or reserve room
//! for) a body at all. The receiver checks, in order:
//! the sender is a configured peer, the signature (constant time), the timestamp is within
//! `max_skew` of its clock, and the nonce was not seen within that window. The reply is
//! signed over the request's nonce and the reply body, so it cannot be swapped or replayed
//! onto another request either. Everything here is pure except the clock the caller passes.

use std::collections::HashMap;
use std::sync::Mutex;

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

pub(crate) const HEADER_REGION: &str = "x-quotad-region";
pub(crate) const HEADER_TIMESTAMP: &str = "x-quotad-timestamp";
pub(crate) const HEADER_NONCE: &str = "x-quotad-nonce";
/// The header carrying a request's or reply's MAC.
pub const HEADER_SIGNATURE: &str = "x-quotad-signature";
pub(crate) const HEADER_HEADERS_SIGNATURE: &str = "x-quotad-headers-signature";

/// Why an exchange was refused: the `reason` label of `quotad_exchange_rejected_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Rejection {
    #[error("missing or malformed authentication headers")]
    Unauthenticated,
    #[error("the sender is not a configured peer")]
    UnknownPeer,
    #[error("signature does not match")]
    BadSignature,
    #[error("timestamp outside the allowed clock skew")]
    Stale,
    #[error("nonce already used")]
    Replay,
    #[error("body is not a valid exchange")]
    Malformed,
    #[error("this instance does not coordinate its region")]
    NotCoordinator,
    #[error("a content-length header is required")]
    LengthRequired,
    #[error("body larger than an exchange of the most keys a round allows")]
    TooLarge,
    #[error("too many exchanges from this peer in flight; retry")]
    Busy,
    /// Signed and well-formed, but a value is out of bounds (an incarnation from the
    /// future, a seq past 2^53, more keys than a round allows, an over-long key).
    #[error("a value is out of bounds")]
    Invalid,
    /// A binary exchange naming keys by numbers this instance has no spelling for (it
    /// restarted, or just took over its region): the sender starts its numbering over.
    #[error("key numbers this instance does not know; spell the keys out again")]
    UnknownKeys,
}

impl Rejection {
    pub(crate) const ALL: [Rejection; 12] = [
        Rejection::Unauthenticated,
        Rejection::UnknownPeer,
        Rejection::BadSignature,
        Rejection::Stale,
        Rejection::Replay,
        Rejection::Malformed,
        Rejection::NotCoordinator,
        Rejection::LengthRequired,
        Rejection::TooLarge,
        Rejection::Busy,
        Rejection::Invalid,
        Rejection::UnknownKeys,
    ];

    pub(crate) fn reason(self) -> &'static str {
        match self {
            Rejection::Unauthenticated => "unauthenticated",
            Rejection::UnknownPeer => "unknown_peer",
            Rejection::BadSignature => "bad_signature",
            Rejection::Stale => "stale",
            Rejection::Replay => "replay",
            Rejection::Malformed => "malformed",
            Rejection::NotCoordinator => "not_coordinator",
            Rejection::LengthRequired => "length_required",
            Rejection::TooLarge => "too_large",
            Rejection::Busy => "busy",
            Rejection::Invalid => "invalid",
            Rejection::UnknownKeys => "unknown_keys",
        }
    }
}

/// The authentication headers of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signed {
    /// The region that signed.
    pub from: String,
    pub(crate) timestamp_ms: i64,
    /// A nonce the reply signs too, so a reply cannot be replayed to another request.
    pub nonce: String,
    /// The MAC, hex-encoded.
    pub signature: String,
    /// The MAC over the headers and the body's length (see the module docs).
    pub(crate) headers_signature: String,
}

impl Signed {
    /// The signed form of a request, from its headers (`header` looks one up by name);
    /// `Unauthenticated` when any is missing or malformed.
    pub(crate) fn from_headers<'a>(
        header: impl Fn(&str) -> Option<&'a str>,
    ) -> Result<Signed, Rejection> {
        match (
            header(HEADER_REGION),
            header(HEADER_TIMESTAMP).and_then(|t| t.parse::<i64>().ok()),
            header(HEADER_NONCE),
            header(HEADER_SIGNATURE),
            header(HEADER_HEADERS_SIGNATURE),
        ) {
            (Some(from), Some(ts), Some(nonce), Some(sig), Some(hsig)) if nonce.len() <= 64 => {
                Ok(Signed {
                    from: from.to_owned(),
                    timestamp_ms: ts,
                    nonce: nonce.to_owned(),
                    signature: sig.to_owned(),
                    headers_signature: hsig.to_owned(),
                })
            }
            _ => Err(Rejection::Unauthenticated),
        }
    }

    /// The request headers that carry this signature.
    pub fn headers(&self) -> [(&'static str, String); 5] {
        [
            (HEADER_REGION, self.from.clone()),
            (HEADER_TIMESTAMP, self.timestamp_ms.to_string()),
            (HEADER_NONCE, self.nonce.clone()),
            (HEADER_SIGNATURE, self.signature.clone()),
            (HEADER_HEADERS_SIGNATURE, self.headers_signature.clone()),
        ]
    }
}

fn headers_mac(secret: &[u8], from: &str, to: &str, ts: i64, nonce: &str, len: u64) -> HmacSha256 {
    let mut m = mac(secret);
    m.update(b"quotad-headers-v1\n");
    for part in [
        from.as_bytes(),
        to.as_bytes(),
        ts.to_string().as_bytes(),
        nonce.as_bytes(),
        len.to_string().as_bytes(),
    ] {
        m.update(part);
        m.update(b"\n");
    }
    m
}

fn mac(secret: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length; this cannot fail.
    HmacSha256::new_from_slice(secret).expect("HMAC accepts any key length")
}

fn request_mac(
    secret: &[u8],
    from: &str,
    to: &str,
    ts: i64,
    nonce: &str,
    body: &[u8],
) -> HmacSha256 {
    let mut m = mac(secret);
    m.update(b"quotad-exchange-v1\n");
    for part in [
        from.as_bytes(),
        to.as_bytes(),
        ts.to_string().as_bytes(),
        nonce.as_bytes(),
    ] {
        m.update(part);
        m.update(b"\n");
    }
    m.update(body);
    m
}

fn reply_mac(secret: &[u8], nonce: &str, body: &[u8]) -> HmacSha256 {
    let mut m = mac(secret);
    m.update(b"quotad-reply-v1\n");
    m.update(nonce.as_bytes());
    m.update(b"\n");
    m.update(body);
    m
}

/// Signs a request from region `from` to region `to`.
pub fn sign_request(secret: &[u8], from: &str, to: &str, now_ms: i64, body: &[u8]) -> Signed {
    let nonce = hex::encode(rand::random::<[u8; 16]>());
    let signature = hex::encode(
        request_mac(secret, from, to, now_ms, &nonce, body)
            .finalize()
            .into_bytes(),
    );
    let headers_signature = hex::encode(
        headers_mac(secret, from, to, now_ms, &nonce, body.len() as u64)
            .finalize()
            .into_bytes(),
    );
    Signed {
        from: from.to_owned(),
        timestamp_ms: now_ms,
        nonce,
        signature,
        headers_signature,
    }
}

pub(crate) fn sign_reply(secret: &[u8], nonce: &str, body: &[u8]) -> String {
    hex::encode(reply_mac(secret, nonce, body).finalize().into_bytes())
}

/// Whether `signature` is the peer's MAC of its reply `body` to the request of `nonce`.
pub fn verify_reply(secret: &[u8], nonce: &str, body: &[u8], signature: &str) -> bool {
    match hex::decode(signature) {
        Ok(sig) => reply_mac(secret, nonce, body).verify_slice(&sig).is_ok(),
        Err(_) => false,
    }
}

/// The receiving side: the peers' secrets and the nonces seen within the window. Shared by
/// the request handlers: the signature is checked without a lock (a body of up to a
/// megabyte is hashed), only the nonce bookkeeping takes it.
pub(crate) struct Verifier {
    me: String,
    secrets: HashMap<String, Vec<u8>>,
    max_skew_ms: i64,
    /// Nonce → the time (ours, ms) after which it may be forgotten.
    seen: Mutex<HashMap<String, i64>>,
    /// Bound on remembered nonces; beyond it, requests are refused as replays until the
    /// window moves on (a flood of validly signed requests needs the secret anyway).
    capacity: usize,
}

/// Hex of an HMAC-SHA256.
const SIGNATURE_HEX: usize = 64;

impl Verifier {
    pub(crate) fn new(me: &str, secrets: HashMap<String, Vec<u8>>, max_skew_ms: i64) -> Self {
        Verifier {
            me: me.to_owned(),
            secrets,
            max_skew_ms,
            seen: Mutex::new(HashMap::new()),
            capacity: 100_000,
        }
    }

    /// What the headers alone can settle, before a byte of the body is read: the sender
    /// is a configured peer, its MAC over the headers and the declared body length `len`
    /// holds (it needs the secret), the timestamp is fresh, and the nonce is new. A request
    /// that fails here costs no body read.
    pub(crate) fn precheck(&self, signed: &Signed, len: u64, now_ms: i64) -> Result<(), Rejection> {
        let secret = self
            .secrets
            .get(&signed.from)
            .ok_or(Rejection::UnknownPeer)?;
        if signed.signature.len() != SIGNATURE_HEX
            || !signed.signature.bytes().all(|b| b.is_ascii_hexdigit())
            || signed.headers_signature.len() != SIGNATURE_HEX
        {
            return Err(Rejection::BadSignature);
        }
        let sig = hex::decode(&signed.headers_signature).map_err(|_| Rejection::BadSignature)?;
        headers_mac(
            secret,
            &signed.from,
            &self.me,
            signed.timestamp_ms,
            &signed.nonce,
            len,
        )
        .verify_slice(&sig)
        .map_err(|_| Rejection::BadSignature)?;
        if signed.timestamp_ms.abs_diff(now_ms) > self.max_skew_ms.unsigned_abs() {
            return Err(Rejection::Stale);
        }
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.get(&signed.nonce).is_some_and(|until| *until > now_ms) {
            return Err(Rejection::Replay);
        }
        Ok(())
    }

    /// Checks a request; on success remembers its nonce.
    pub(crate) fn verify(
        &self,
        signed: &Signed,
        body: &[u8],
        now_ms: i64,
    ) -> Result<(), Rejection> {
        let secret = self
            .secrets
            .get(&signed.from)
            .ok_or(Rejection::UnknownPeer)?;
        if signed.signature.len() != SIGNATURE_HEX {
            return Err(Rejection::BadSignature);
        }
        let sig = hex::decode(&signed.signature).map_err(|_| Rejection::BadSignature)?;
        request_mac(
            secret,
            &signed.from,
            &self.me,
            signed.timestamp_ms,
            &signed.nonce,
            body,
        )
        .verify_slice(&sig)
        .map_err(|_| Rejection::BadSignature)?;
        if signed.timestamp_ms.abs_diff(now_ms) > self.max_skew_ms.unsigned_abs() {
            return Err(Rejection::Stale);
        }
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.retain(|_, until| *until > now_ms);
        if seen.contains_key(&signed.nonce) || seen.len() >= self.capacity {
            return Err(Rejection::Replay);
        }
        // A nonce older than the window is refused as stale, so remembering it for twice
        // the window (its timestamp may be ahead of our clock by up to the skew) suffices.
        seen.insert(signed.nonce.clone(), now_ms + 2 * self.max_skew_ms);
        Ok(())
    }
}

/// Wall-clock milliseconds, for signatures only (decisions use Redis's clock).
pub fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verifier() -> Verifier {
        let secrets = HashMap::from([("us".to_owned(), b"0123456789abcdef".to_vec())]);
        Verifier::new("eu", secrets, 30_000)
    }

    #[test]
    fn a_signed_request_passes_once() {
        let v = verifier();
        let s = sign_request(b"0123456789abcdef", "us", "eu", 1_000_000, b"{}");
        assert_eq!(v.verify(&s, b"{}", 1_000_500), Ok(()));
        assert_eq!(v.verify(&s, b"{}", 1_000_600), Err(Rejection::Replay));
    }

    #[test]
    fn tampering_a_wrong_secret_a_stranger_and_old_timestamps_are_refused() {
        let v = verifier();
        let s = sign_request(b"0123456789abcdef", "us", "eu", 1_000_000, b"{\"a\":1}");
        assert_eq!(
            v.verify(&s, b"{\"a\":2}", 1_000_000),
            Err(Rejection::BadSignature)
        );
        let wrong = sign_request(b"fedcba9876543210", "us", "eu", 1_000_000, b"{}");
        assert_eq!(
            v.verify(&wrong, b"{}", 1_000_000),
            Err(Rejection::BadSignature)
        );
        let to_other = sign_request(b"0123456789abcdef", "us", "ap", 1_000_000, b"{}");
        assert_eq!(
            v.verify(&to_other, b"{}", 1_000_000),
            Err(Rejection::BadSignature)
        );
        let stranger = sign_request(b"0123456789abcdef", "xx", "eu", 1_000_000, b"{}");
        assert_eq!(
            v.verify(&stranger, b"{}", 1_000_000),
            Err(Rejection::UnknownPeer)
        );
        let mut moved = s.clone();
        moved.timestamp_ms += 1;
        assert_eq!(
            v.verify(&moved, b"{\"a\":1}", 1_000_000),
            Err(Rejection::BadSignature)
        );
        assert_eq!(v.verify(&s, b"{\"a\":1}", 1_040_000), Err(Rejection::Stale));
        assert_eq!(v.verify(&s, b"{\"a\":1}", 1_020_000), Ok(()));
    }

    #[test]
    fn the_headers_alone_settle_strangers_forms_staleness_and_replays() {
        let v = verifier();
        let s = sign_request(b"0123456789abcdef", "us", "eu", 1_000_000, b"{}");
        let check = |s: &Signed, len: u64, now: i64| v.precheck(s, len, now);
        assert_eq!(check(&s, 2, 1_000_100), Ok(()));
        let mut stranger = s.clone();
        stranger.from = "xx".into();
        assert_eq!(check(&stranger, 2, 1_000_100), Err(Rejection::UnknownPeer));
        let mut short = s.clone();
        short.signature.pop();
        assert_eq!(check(&short, 2, 1_000_100), Err(Rejection::BadSignature));
        let mut not_hex = s.clone();
        not_hex.signature.replace_range(0..1, "z");
        assert_eq!(check(&not_hex, 2, 1_000_100), Err(Rejection::BadSignature));
        // Without the secret the headers MAC cannot be made: not even a length claim passes.
        assert_eq!(check(&s, 1 << 20, 1_000_100), Err(Rejection::BadSignature));
        let forged = sign_request(b"not-the-secret!!", "us", "eu", 1_000_000, b"{}");
        assert_eq!(check(&forged, 2, 1_000_100), Err(Rejection::BadSignature));
        assert_eq!(check(&s, 2, 1_040_000), Err(Rejection::Stale));
        assert_eq!(v.verify(&s, b"{}", 1_000_100), Ok(()));
        assert_eq!(check(&s, 2, 1_000_200), Err(Rejection::Replay));
    }

    #[test]
    fn replies_are_bound_to_the_request_nonce() {
        let sig = sign_reply(b"0123456789abcdef", "n1", b"{}");
        assert!(verify_reply(b"0123456789abcdef", "n1", b"{}", &sig));
        assert!(!verify_reply(b"0123456789abcdef", "n2", b"{}", &sig));
        assert!(!verify_reply(b"0123456789abcdef", "n1", b"{ }", &sig));
        assert!(!verify_reply(b"0123456789abcdef", "n1", b"{}", "zz"));
    }
}
