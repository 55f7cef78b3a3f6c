//! Sending exchanges to peers over HTTP, signed, with the simulator's retry rule: an
//! exchange still unanswered after 2×RTT (within [100 ms, round/3]) is sent again, at most
//! twice, without abandoning the earlier attempts (on a slow WAN the first answer may
//! simply be late). Every reply is checked against our nonce before the node sees it.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::Shared;
use super::auth::{self, HEADER_SIGNATURE};
use super::runtime::Event;
use quotad_core::coordinator::RegionId;
use quotad_core::coordinator::message::{Exchange, ExchangeReply};

pub const EXCHANGE_PATH: &str = "/v1/peer/exchange";
const MAX_ATTEMPTS: usize = 3;

pub struct PeerClient {
    pub shared: Arc<Shared>,
    pub http: reqwest::Client,
    pub events: std::sync::mpsc::Sender<Event>,
}

impl PeerClient {
    /// Sends every exchange the coordinator produces until the channel closes.
    pub async fn run(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<(RegionId, Exchange)>) {
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

    async fn deliver(self: Arc<Self>, to: RegionId, msg: Exchange) {
        let Ok(body) = serde_json::to_vec(&msg) else {
            return;
        };
        let body = Arc::new(body);
        let wait = self.retry_after(to);
        let mut attempts = JoinSet::new();
        let mut started = 0;
        loop {
            if started < MAX_ATTEMPTS {
                attempts.spawn(self.clone().attempt(to, body.clone()));
                started += 1;
            }
            let next = tokio::time::sleep(wait);
            tokio::select! {
                done = attempts.join_next() => match done {
                    Some(Ok(Some(reply))) => {
                        let _ = self.events.send(Event::Reply(reply));
                        return;
                    }
                    // That attempt failed: try again now rather than after the wait.
                    Some(_) => {
                        if started >= MAX_ATTEMPTS && attempts.is_empty() {
                            return;
                        }
                    }
                    None => return,
                },
                _ = next => {
                    if started >= MAX_ATTEMPTS {
                        // Let the last attempts finish (bounded by the client timeout).
                        while let Some(done) = attempts.join_next().await {
                            if let Ok(Some(reply)) = done {
                                let _ = self.events.send(Event::Reply(reply));
                                return;
                            }
                        }
                        return;
                    }
                }
            }
        }
    }

    /// One signed POST to the peer's current URL; on a refusal or a network error the
    /// next URL of that peer becomes current (a region with several instances).
    async fn attempt(self: Arc<Self>, to: RegionId, body: Arc<Vec<u8>>) -> Option<ExchangeReply> {
        let s = &self.shared.settings;
        let peer = s.peers.iter().find(|p| p.id == to)?;
        let me = &s.regions[s.me.index()];
        let idx = self.shared.url_index(to) % peer.urls.len();
        let url = format!("{}{EXCHANGE_PATH}", peer.urls[idx]);
        let signed = auth::sign_request(&peer.secret.0, me, &peer.region, wall_ms(), &body);
        self.shared.count_bytes(&peer.region, "sent", body.len());
        let mut req = self
            .http
            .post(&url)
            .header("content-type", "application/json");
        for (name, value) in signed.headers() {
            req = req.header(name, value);
        }
        let resp = req.body(body.to_vec()).send().await;
        let resp = match resp {
            Ok(r) if r.status().is_success() => r,
            Ok(r) => {
                tracing::debug!(peer = %peer.region, status = %r.status(), "exchange refused");
                self.shared.next_url(to, idx);
                return None;
            }
            Err(e) => {
                tracing::debug!(peer = %peer.region, error = %e, "exchange failed");
                self.shared.next_url(to, idx);
                return None;
            }
        };
        let sig = resp
            .headers()
            .get(HEADER_SIGNATURE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)?;
        // Read at most what a round can carry before the signature is checked: the link
        // is plain HTTP, and anyone on the path could otherwise feed us without end.
        let max = s.max_exchange_bytes;
        let mut resp = resp;
        let mut reply = Vec::new();
        while let Some(chunk) = resp.chunk().await.ok()? {
            if reply.len() + chunk.len() > max {
                tracing::warn!(peer = %peer.region, "exchange reply over {max} bytes dropped");
                return None;
            }
            reply.extend_from_slice(&chunk);
        }
        self.shared
            .count_bytes(&peer.region, "received", reply.len());
        if !auth::verify_reply(&peer.secret.0, &signed.nonce, &reply, &sig) {
            tracing::warn!(peer = %peer.region, "exchange reply with a bad signature dropped");
            self.shared
                .metrics
                .global
                .exchange_rejected
                .with_label_values(&["bad_signature"])
                .inc();
            return None;
        }
        let reply: ExchangeReply = serde_json::from_slice(&reply).ok()?;
        if let Err(why) = super::validate_reply(&reply, wall_ms(), s) {
            tracing::warn!(peer = %peer.region, why, "exchange reply refused: a value is out of bounds");
            self.shared
                .metrics
                .global
                .exchange_rejected
                .with_label_values(&["invalid"])
                .inc();
            return None;
        }
        (reply.from == to).then_some(reply)
    }
}

/// Wall-clock milliseconds, for signatures only (decisions use Redis's clock).
pub fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
