//! Runtime limits of global policies between regions: a key's limit set in any region
//! reaches every region. Each region's coordinating instance pulls, every round, from
//! each peer the changes it has not seen (`POST /v1/peer/limits`, signed both ways like
//! an exchange) and merges them into its own Redis (`lua/runtime_limit.lua`, merge),
//! where every instance of the region applies them as it applies a local write. The last
//! write wins by (the writing region's Redis clock, a delete before a set, the region's
//! name), so every region ends on the same numbers whatever order changes arrive in. A
//! peer's changes are read by version (its set's own counter, which merges raise too), so
//! a change reaches a region through any peer that has it.
//!
//! The rule a change in flight keeps is the bucket's (`quotad_core::coordinator::bucket::
//! KeyLimit`, docs/global-budgets.md): the coordinator's shares stay in policy units, so
//! the regions together admit at most the largest numbers any of them has.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::auth::{self, wall_ms};
use super::{Admitted, Federation, Rejection};
use crate::limiter::Limiter;
use crate::policy::Policy;
use crate::reload::LiveConfig;
use crate::runtime_limits::{Entry, PeerChange, RuntimeLimits, RuntimeWritten, valid_origin};

pub(crate) const LIMITS_PATH: &str = "/v1/peer/limits";

/// Changes per policy in one reply: a region that starts (or a peer that lost its set)
/// catches up over rounds, a page each.
pub(crate) const PAGE: usize = 1000;

/// The most policies one request may ask about.
const MAX_POLICIES_ASKED: usize = 1000;

/// The most a reply may hold: a page of every policy's changes, at a generous size each.
const MAX_REPLY_BYTES: usize = 16 << 20;

/// What a region asks a peer: the changes after the version it has seen of each policy.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct LimitsRequest {
    pub(crate) from: String,
    pub(crate) after: BTreeMap<String, u64>,
}

/// What a peer answers: per policy asked for (that it has), its set's version and the
/// changes after the one asked, oldest first, at most [`PAGE`].
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct LimitsReply {
    pub(crate) from: String,
    pub(crate) policies: BTreeMap<String, PolicyChanges>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct PolicyChanges {
    pub(crate) version: u64,
    pub(crate) changes: Vec<PeerChange>,
}

/// The global policies of `live` whose keys may have their own limits.
fn spreading(live: &LiveConfig) -> Vec<Arc<Policy>> {
    live.get()
        .policies
        .iter()
        .filter(|p| p.global.is_some() && p.runtime.is_some())
        .cloned()
        .collect()
}

/// A change as a peer may send it: a value this version reads, written in a region, or
/// a time it went; a key within `max_key_bytes`, as a client's is.
fn well_formed(c: &PeerChange, max_key_bytes: usize) -> bool {
    let key_ok = !c.key.is_empty() && c.key.len() <= max_key_bytes;
    let value_ok = match &c.value {
        Some(v) => Entry::parse(v).is_some() && v.rsplit(':').next().is_some_and(valid_origin),
        None => c.gone_ms > 0,
    };
    key_ok && value_ok
}

impl Federation {
    /// The rest of `POST /v1/peer/limits` once admitted: the body verified and read as a
    /// request from the peer that signed it.
    pub(crate) fn limits_request(
        &self,
        admitted: &Admitted,
        body: &[u8],
    ) -> Result<LimitsRequest, Rejection> {
        self.verifier.verify(&admitted.signed, body, wall_ms())?;
        let peer = &self.shared.settings.peers[admitted.peer];
        let req: LimitsRequest = serde_json::from_slice(body).map_err(|_| Rejection::Malformed)?;
        if req.from != peer.region || req.after.len() > MAX_POLICIES_ASKED {
            return Err(Rejection::Malformed);
        }
        Ok(req)
    }

    /// The reply's body and its signature for the request `admitted`.
    pub(crate) fn sign_limits_reply(
        &self,
        admitted: &Admitted,
        reply: &LimitsReply,
    ) -> (Vec<u8>, String) {
        let peer = &self.shared.settings.peers[admitted.peer];
        let body = serde_json::to_vec(reply).unwrap_or_default();
        let signature = auth::sign_reply(&peer.secret.0, &admitted.signed.nonce, &body);
        (body, signature)
    }

    /// This region's name.
    pub(crate) fn region(&self) -> &str {
        let s = &self.shared.settings;
        &s.regions[s.me.index()]
    }
}

/// Answers a peer's request from this region's store: for each policy asked for that is
/// global and takes runtime limits here, a page of its changes.
pub(crate) async fn answer(
    federation: &Federation,
    limiter: &Limiter,
    live: &LiveConfig,
    req: &LimitsRequest,
) -> LimitsReply {
    let mut reply = LimitsReply {
        from: federation.region().to_owned(),
        policies: BTreeMap::new(),
    };
    for p in spreading(live) {
        let Some(&after) = req.after.get(&p.name) else {
            continue;
        };
        match limiter.runtime_changes(&p, after, PAGE).await {
            Ok((version, changes)) => {
                reply
                    .policies
                    .insert(p.name.clone(), PolicyChanges { version, changes });
            }
            Err(e) => {
                tracing::debug!(policy = %p.name, error = %e, "runtime limit changes not read for a peer");
            }
        }
    }
    reply
}

/// Pulls the peers' changes every round while this instance coordinates its region,
/// until `stop`.
pub(crate) async fn pull(
    federation: Arc<Federation>,
    limiter: Arc<Limiter>,
    live: Arc<LiveConfig>,
    stop: CancellationToken,
) {
    let runtime = live.runtime().clone();
    let s = &federation.shared.settings;
    let round = Duration::from_micros(s.params.round_us as u64);
    let Ok(http) = reqwest::Client::builder()
        .timeout(round * 3)
        .connect_timeout(round)
        .build()
    else {
        tracing::error!("runtime limits will not spread: no HTTP client");
        return;
    };
    // Per peer, per policy: the last version of the peer's set whose changes are merged.
    let mut seen: Vec<HashMap<String, u64>> = vec![HashMap::new(); s.peers.len()];
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(round) => {}
        }
        let policies = spreading(&live);
        if policies.is_empty() {
            continue;
        }
        if !federation.shared.is_leader() {
            // A coordinator that takes over starts from the beginning: merging what the
            // region has is a no-op.
            seen.iter_mut().for_each(HashMap::clear);
            continue;
        }
        for (peer, cursors) in seen.iter_mut().enumerate() {
            let outcome = pull_one(
                &federation,
                &http,
                peer,
                &policies,
                cursors,
                &limiter,
                &runtime,
            )
            .await;
            federation
                .shared
                .metrics
                .runtime_limit_pulls
                .with_label_values(&[&s.peers[peer].region, outcome])
                .inc();
        }
    }
}

/// One pull from peer `peer`: asks, verifies, merges. Returns the outcome's label.
async fn pull_one(
    federation: &Federation,
    http: &reqwest::Client,
    peer: usize,
    policies: &[Arc<Policy>],
    cursors: &mut HashMap<String, u64>,
    limiter: &Limiter,
    runtime: &RuntimeLimits,
) -> &'static str {
    let shared = &federation.shared;
    let s = &shared.settings;
    let p = &s.peers[peer];
    let req = LimitsRequest {
        from: federation.region().to_owned(),
        after: policies
            .iter()
            .map(|pol| {
                (
                    pol.name.clone(),
                    cursors.get(&pol.name).copied().unwrap_or(0),
                )
            })
            .collect(),
    };
    let body = serde_json::to_vec(&req).unwrap_or_default();
    let idx = shared.url_index(p.id) % p.urls.len();
    let url = format!("{}{LIMITS_PATH}", p.urls[idx]);
    let signed = auth::sign_request(&p.secret.0, &req.from, &p.region, wall_ms(), &body);
    let mut call = http.post(&url).header("content-type", "application/json");
    for (name, value) in signed.headers() {
        call = call.header(name, value);
    }
    let resp = match call.body(body).send().await {
        Ok(r) if r.status().is_success() => r,
        Ok(r) => {
            tracing::debug!(peer = %p.region, status = %r.status(), "runtime limit pull refused");
            shared.next_url(p.id, idx);
            return "refused";
        }
        Err(e) => {
            tracing::debug!(peer = %p.region, error = %e, "runtime limit pull failed");
            shared.next_url(p.id, idx);
            return "failed";
        }
    };
    let Some(sig) = super::peers::reply_signature(&resp) else {
        return "invalid";
    };
    let Some(bytes) = super::peers::read_at_most(resp, MAX_REPLY_BYTES).await else {
        return "invalid";
    };
    if !auth::verify_reply(&p.secret.0, &signed.nonce, &bytes, &sig) {
        tracing::warn!(peer = %p.region, "runtime limit reply with a bad signature dropped");
        return "invalid";
    }
    let Ok(reply) = serde_json::from_slice::<LimitsReply>(&bytes) else {
        return "invalid";
    };
    if reply.from != p.region {
        return "invalid";
    }
    for pol in policies {
        let Some(got) = reply.policies.get(&pol.name) else {
            continue;
        };
        let cursor = cursors.entry(pol.name.clone()).or_insert(0);
        if got.version < *cursor {
            // The peer's set went back (it lost it, and started again from its clock):
            // read it from the beginning.
            *cursor = 0;
            continue;
        }
        for c in got.changes.iter().take(PAGE) {
            if !well_formed(c, s.max_key_bytes) {
                tracing::warn!(peer = %p.region, policy = %pol.name, "a runtime limit change out of bounds skipped");
            } else {
                match limiter.merge_runtime_limit(runtime, pol, c).await {
                    Ok(RuntimeWritten::Done { .. }) => shared
                        .metrics
                        .runtime_limit_merged
                        .with_label_values(&[&p.region, "taken"])
                        .inc(),
                    Ok(_) => shared
                        .metrics
                        .runtime_limit_merged
                        .with_label_values(&[&p.region, "older"])
                        .inc(),
                    Err(e) => {
                        // The rest waits for the next round, from this change on.
                        tracing::debug!(policy = %pol.name, error = %e, "a peer's runtime limit change not merged");
                        return "failed";
                    }
                }
            }
            *cursor = (*cursor).max(c.version);
        }
    }
    "ok"
}
