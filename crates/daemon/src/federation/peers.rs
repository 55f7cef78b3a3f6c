//! Sending exchanges to peers over HTTP, signed, with the simulator's retry rule: an
//! exchange still unanswered after 2×RTT (within [100 ms, round/3]) is sent again, at most
//! twice, without abandoning the earlier attempts (on a slow WAN the first answer may
//! simply be late). Every reply is checked against our nonce before the node sees it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::Shared;
use super::auth::{self, HEADER_SIGNATURE, wall_ms};
use super::runtime::Event;
use crate::config::Encoding;
use quotad_core::coordinator::RegionId;
use quotad_core::coordinator::message::{Exchange, ExchangeReply};
use quotad_core::coordinator::wire::{self, KeyIds, Spelled};

pub(crate) const EXCHANGE_PATH: &str = "/v1/peer/exchange";
const MAX_ATTEMPTS: usize = 3;

/// How long a peer that refused the binary form (a version before it) gets JSON before
/// the binary form is tried again: an upgraded peer is back on it within this.
const JSON_AFTER_REFUSAL: Duration = Duration::from_secs(300);

pub(crate) struct PeerClient {
    pub(crate) shared: Arc<Shared>,
    pub(crate) http: reqwest::Client,
    pub(crate) events: std::sync::mpsc::Sender<Event>,
    /// Per peer (in `settings.peers` order): how its exchanges are encoded.
    pub(crate) wires: Vec<Mutex<PeerWire>>,
}

/// The sending side of the binary form for one peer.
pub(crate) struct PeerWire {
    ids: KeyIds,
    /// The peer refused the binary form: JSON until then.
    json_until: Option<Instant>,
}

impl PeerWire {
    pub(crate) fn new(cap: usize) -> Self {
        PeerWire {
            ids: KeyIds::new(cap),
            json_until: None,
        }
    }
}

/// One exchange as it goes on the wire.
struct Body {
    bytes: Vec<u8>,
    /// Binary: what a reply confirms the peer now knows. `None` for JSON.
    spelled: Option<Spelled>,
}

/// How one attempt ended.
enum Outcome {
    Reply(ExchangeReply),
    /// Refused, or no answer: the next attempt goes as it is.
    Failed,
    /// The peer does not read the binary form (a version before it): JSON from now on.
    NoBinary,
    /// The peer does not know our key numbers: number them anew.
    UnknownKeys,
}

impl PeerClient {
    /// Sends every exchange the coordinator produces until the channel closes.
    pub(crate) async fn run(
        self: Arc<Self>,
        mut rx: mpsc::UnboundedReceiver<(RegionId, Exchange)>,
    ) {
        while let Some((to, msg)) = rx.recv().await {
            tokio::spawn(self.clone().deliver(to, msg));
        }
    }

    fn retry_after(&self, to: RegionId) -> Duration {
        let round = self.shared.settings.params.round_us;
        let lo = 100_000.min(round / 3);
        let rtt = self.shared.rtt_us(to).unwrap_or(lo / 2);
        Duration::from_micros((2 * rtt).clamp(lo, round / 3) as u64)
    }

    fn wire(&self, peer: usize) -> std::sync::MutexGuard<'_, PeerWire> {
        self.wires[peer].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The exchange for peer `peer` in the form that peer gets now.
    fn encode(&self, peer: usize, msg: &Exchange) -> Arc<Body> {
        let s = &self.shared.settings;
        let mut w = self.wire(peer);
        let json_pinned = s.encoding == Encoding::Json;
        let refused = w.json_until.is_some_and(|t| Instant::now() < t);
        let binary = !json_pinned && !refused;
        self.shared
            .metrics
            .global
            .exchange_binary
            .with_label_values(&[&s.peers[peer].region])
            .set(binary as i64);
        if !binary {
            let bytes = serde_json::to_vec(msg).unwrap_or_default();
            return Arc::new(Body {
                bytes,
                spelled: None,
            });
        }
        w.json_until = None;
        let (bytes, spelled) = w.ids.encode(msg);
        self.shared
            .metrics
            .global
            .exchange_dictionary_keys
            .with_label_values(&[&s.peers[peer].region, "ours"])
            .set(w.ids.len() as i64);
        Arc::new(Body {
            bytes,
            spelled: Some(spelled),
        })
    }

    /// Sends one exchange and hands every verified reply to the coordinator: the first,
    /// and those to attempts already under way (a retry's reply carries the lender's
    /// newer grants). An exchange still unanswered after the retry wait is sent again
    /// without abandoning the earlier attempts, at most [`MAX_ATTEMPTS`] in all; one the
    /// peer refused for its form goes again at once in the form it takes.
    async fn deliver(self: Arc<Self>, to: RegionId, msg: Exchange) {
        let s = &self.shared.settings;
        let Some(peer) = s.peers.iter().position(|p| p.id == to) else {
            return;
        };
        self.shared.count_keys(&s.peers[peer].region, &msg);
        let msg = Arc::new(msg);
        let mut body = self.encode(peer, &msg);
        let wait = self.retry_after(to);
        let mut attempts = JoinSet::new();
        let mut started = 0;
        let mut answered = false;
        loop {
            if !answered && started < MAX_ATTEMPTS {
                attempts.spawn(self.clone().attempt(peer, msg.clone(), body.clone()));
                started += 1;
            }
            let retry = tokio::time::sleep(wait);
            tokio::select! {
                done = attempts.join_next() => match done {
                    None => return,
                    Some(Ok(Outcome::Reply(reply))) => {
                        let _ = self.events.send(Event::Reply(reply));
                        answered = true;
                    }
                    Some(Ok(Outcome::NoBinary)) => {
                        if body.spelled.is_some() {
                            self.wire(peer).json_until = Some(Instant::now() + JSON_AFTER_REFUSAL);
                            tracing::info!(peer = %s.peers[peer].region, "peer refused the binary exchange form: sending it JSON");
                            body = self.encode(peer, &msg);
                        }
                    }
                    Some(Ok(Outcome::UnknownKeys)) => {
                        if let Some(spelled) = &body.spelled {
                            self.renumber(peer, spelled.epoch());
                            body = self.encode(peer, &msg);
                        }
                    }
                    Some(_) => {}
                },
                _ = retry, if !answered && started < MAX_ATTEMPTS => {}
            }
        }
    }

    /// The peer did not know the numbers of `epoch`: if that is still ours, start over.
    fn renumber(&self, peer: usize, epoch: u64) {
        if self.wire(peer).ids.refused(epoch) {
            self.shared
                .metrics
                .global
                .exchange_renumbered
                .with_label_values(&[&self.shared.settings.peers[peer].region])
                .inc();
        }
    }

    /// One signed POST to the peer's current URL. A refusal for the body's form (409: our
    /// key numbers; 400 `malformed` to a binary body: a version before the binary form)
    /// says so; on any other refusal or a network error the next URL of that peer becomes
    /// current (a region with several instances).
    async fn attempt(
        self: Arc<Self>,
        peer_idx: usize,
        msg: Arc<Exchange>,
        body: Arc<Body>,
    ) -> Outcome {
        let s = &self.shared.settings;
        let peer = &s.peers[peer_idx];
        let to = peer.id;
        let me = &s.regions[s.me.index()];
        let idx = self.shared.url_index(to) % peer.urls.len();
        let url = format!("{}{EXCHANGE_PATH}", peer.urls[idx]);
        let signed = auth::sign_request(&peer.secret.0, me, &peer.region, wall_ms(), &body.bytes);
        self.shared
            .count_bytes(&peer.region, "sent", body.bytes.len());
        let binary = body.spelled.is_some();
        let content_type = if binary {
            wire::CONTENT_TYPE
        } else {
            "application/json"
        };
        let mut req = self.http.post(&url).header("content-type", content_type);
        for (name, value) in signed.headers() {
            req = req.header(name, value);
        }
        let resp = match req.body(body.bytes.clone()).send().await {
            Ok(r) if r.status().is_success() => r,
            Ok(r) => return self.refused(r, binary, peer_idx, idx).await,
            Err(e) => {
                tracing::debug!(peer = %peer.region, error = %e, "exchange failed");
                self.shared.next_url(to, idx);
                return Outcome::Failed;
            }
        };
        let Some(sig) = reply_signature(&resp) else {
            return Outcome::Failed;
        };
        let Some(bytes) = self.read_reply(resp, &peer.region).await else {
            return Outcome::Failed;
        };
        let Some(reply) = self.accepted(peer_idx, &msg, &signed.nonce, &bytes, &sig) else {
            return Outcome::Failed;
        };
        // The peer decoded the exchange: it has every key the exchange spelled out.
        if let Some(spelled) = &body.spelled {
            self.wire(peer_idx).ids.confirm(spelled);
        }
        Outcome::Reply(reply)
    }

    /// Peer `peer_idx`'s reply to `msg`, if it is signed for the request's `nonce`,
    /// decodes, holds values within bounds and comes from that peer; a bad signature or
    /// an out-of-bounds value is counted.
    fn accepted(
        &self,
        peer_idx: usize,
        msg: &Exchange,
        nonce: &str,
        bytes: &[u8],
        sig: &str,
    ) -> Option<ExchangeReply> {
        let s = &self.shared.settings;
        let peer = &s.peers[peer_idx];
        let rejected = |why: &str| {
            self.shared
                .metrics
                .global
                .exchange_rejected
                .with_label_values(&[why])
                .inc()
        };
        if !auth::verify_reply(&peer.secret.0, nonce, bytes, sig) {
            tracing::warn!(peer = %peer.region, "exchange reply with a bad signature dropped");
            rejected("bad_signature");
            return None;
        }
        let reply = if wire::is_binary(bytes) {
            wire::decode_reply(msg, bytes).ok()
        } else {
            serde_json::from_slice::<ExchangeReply>(bytes).ok()
        }?;
        if let Err(why) = super::validate_reply(&reply, wall_ms(), s) {
            tracing::warn!(peer = %peer.region, why, "exchange reply refused: a value is out of bounds");
            rejected("invalid");
            return None;
        }
        (reply.from == peer.id).then_some(reply)
    }

    /// Reads at most what a round can carry before the signature is checked: the link is
    /// plain HTTP, and anyone on the path could otherwise feed us without end.
    async fn read_reply(&self, resp: reqwest::Response, peer: &str) -> Option<Vec<u8>> {
        let max = self.shared.settings.max_exchange_bytes;
        let Some(reply) = read_at_most(resp, max).await else {
            tracing::warn!(
                peer,
                "exchange reply over {max} bytes (or cut short) dropped"
            );
            return None;
        };
        self.shared.count_bytes(peer, "received", reply.len());
        Some(reply)
    }

    /// A peer's refusal: of the binary form, of our key numbers, or of anything else (the
    /// next URL then).
    async fn refused(
        &self,
        resp: reqwest::Response,
        binary: bool,
        peer_idx: usize,
        idx: usize,
    ) -> Outcome {
        let peer = &self.shared.settings.peers[peer_idx];
        let status = resp.status();
        tracing::debug!(peer = %peer.region, %status, "exchange refused");
        if binary && status == reqwest::StatusCode::CONFLICT {
            return Outcome::UnknownKeys;
        }
        if binary && status == reqwest::StatusCode::BAD_REQUEST {
            // Only `malformed` means the form: `invalid` is a value out of bounds.
            let code = read_at_most(resp, 4096)
                .await
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .and_then(|v| v["error"]["code"].as_str().map(str::to_owned));
            if code.as_deref() == Some("malformed") {
                return Outcome::NoBinary;
            }
            return Outcome::Failed;
        }
        self.shared.next_url(peer.id, idx);
        Outcome::Failed
    }
}

/// A peer's reply's signature header.
pub(super) fn reply_signature(resp: &reqwest::Response) -> Option<String> {
    resp.headers()
        .get(HEADER_SIGNATURE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// A response's body, if it is at most `max` bytes and arrives whole.
pub(super) async fn read_at_most(mut resp: reqwest::Response, max: usize) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.ok()? {
        if body.len() + chunk.len() > max {
            return None;
        }
        body.extend_from_slice(&chunk);
    }
    Some(body)
}
