//! The exchange messages. Each round a region sends every peer one [`Exchange`] (its demand
//! for the keys that matter to that peer, the loans it wants from it, and how far the peer
//! may release older reservations); the peer answers with one [`ExchangeReply`] (its own
//! demand and the grants). These are the messages; [`super::wire`] is the binary form they
//! travel in between daemons (≤ 40 bytes per hot key per peer per round). The JSON form
//! (field names of one or two letters) is what every version speaks, and what a region
//! pinned to JSON sends.

use serde::{Deserialize, Serialize};

use super::{LocalUs, RegionId};

/// One region's round to one peer: its demand per key, the loans it wants, the releases it
/// allows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Exchange {
    /// The sending region.
    #[serde(rename = "f")]
    pub from: RegionId,
    /// The sender's incarnation: bumped on every restart.
    #[serde(rename = "i")]
    pub incarnation: u64,
    /// The receiver's incarnation as the sender last heard it; releases refer to it, so a
    /// restarted lender ignores watermarks meant for its previous life (0 = unknown).
    #[serde(rename = "ti")]
    pub to_incarnation: u64,
    /// The sender's clock, read *before* sending: the grant's validity starts here.
    #[serde(rename = "t")]
    pub t_req: LocalUs,
    /// Per global policy the sender runs.
    #[serde(rename = "p")]
    pub policies: Vec<PolicyReport>,
}

/// One policy's part of an [`Exchange`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyReport {
    /// The policy's name.
    #[serde(rename = "n")]
    pub name: String,
    /// The newest policy version the sender has applied decrease-first.
    #[serde(rename = "a")]
    pub applied: u64,
    /// The keys that matter to the receiver.
    #[serde(rename = "k")]
    pub keys: Vec<KeyReport>,
}

/// One key's part of a [`PolicyReport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyReport {
    /// The key, as clients send it.
    #[serde(rename = "k")]
    pub key: String,
    /// Smoothed offered load in the sender's region, units per second.
    #[serde(rename = "d")]
    pub demand: f32,
    /// The loan the sender asks the receiver for (absent: none wanted, none held).
    #[serde(rename = "w", default, skip_serializing_if = "Option::is_none")]
    pub want: Option<f64>,
    /// The receiver may drop its reservations for this key and sender with seq < release.
    #[serde(rename = "r", default, skip_serializing_if = "Option::is_none")]
    pub release: Option<u64>,
    /// The sender has durably lowered the lease `release` names to this amount (it gave
    /// part of it back): the receiver may lower that reservation to it.
    #[serde(rename = "h", default, skip_serializing_if = "Option::is_none")]
    pub held: Option<f64>,
    /// The sender, as a lender that granted the receiver less than it asked for this key,
    /// has freed capacity since: the receiver asks again at once (see
    /// `Node::early_exchanges`) instead of at its next round.
    #[serde(rename = "fr", default, skip_serializing_if = "std::ops::Not::not")]
    pub freed: bool,
}

/// The answer to an [`Exchange`]: the peer's own demand and its grants.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExchangeReply {
    /// The replying region.
    #[serde(rename = "f")]
    pub from: RegionId,
    /// The replier's incarnation: bumped on every restart.
    #[serde(rename = "i")]
    pub incarnation: u64,
    /// Echo of the requester's incarnation: a reply to a previous life is ignored.
    #[serde(rename = "ti")]
    pub to_incarnation: u64,
    /// Echo of the request's `t_req`.
    #[serde(rename = "t")]
    pub t_req: LocalUs,
    /// Lease duration D of every grant in this reply.
    #[serde(rename = "D")]
    pub lease_us: i64,
    /// Per policy of the exchange.
    #[serde(rename = "p")]
    pub policies: Vec<PolicyReply>,
}

/// One policy's part of an [`ExchangeReply`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyReply {
    /// The policy's name.
    #[serde(rename = "n")]
    pub name: String,
    /// The newest policy version the replier has applied decrease-first.
    #[serde(rename = "a")]
    pub applied: u64,
    /// The keys of the exchange, answered.
    #[serde(rename = "k")]
    pub keys: Vec<KeyReply>,
}

/// One key's part of a [`PolicyReply`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyReply {
    /// The key.
    #[serde(rename = "k")]
    pub key: String,
    /// Smoothed offered load in the replier's region, units per second.
    #[serde(rename = "d")]
    pub demand: f32,
    /// The loan granted (absent: none).
    #[serde(rename = "g", default, skip_serializing_if = "Option::is_none")]
    pub grant: Option<Grant>,
}

/// A loan, already reserved (durably) at the lender.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Grant {
    /// The lender's sequence number of the loan, per borrower and key.
    #[serde(rename = "s")]
    pub seq: u64,
    /// Units per second lent.
    #[serde(rename = "a")]
    pub amount: f64,
}

/// A message between two regions' coordinators.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// A region's round to a peer.
    Exchange(Exchange),
    /// The peer's answer.
    Reply(ExchangeReply),
}

impl Message {
    /// The JSON form (the daemons send a bare [`Exchange`] or [`ExchangeReply`], or the
    /// binary form of [`super::wire`]).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("messages are plain data")
    }

    /// Reads the JSON form.
    pub fn decode(bytes: &[u8]) -> Result<Message, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}
