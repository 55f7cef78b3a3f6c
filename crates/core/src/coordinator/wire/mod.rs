//! The binary form of the exchange messages: what two regions' coordinators send each
//! other every round, at a size that lets ten regions share 100,000 hot keys.
//!
//! The messages are [`message`](super::message)'s; this is only how they travel. A body
//! whose first byte is [`MAGIC`] is binary, one that starts with `{` is the JSON envelope
//! (every version speaks JSON; a region that does not know this form refuses it as
//! malformed, and its peer goes back to JSON for it: see docs/global-budgets.md).
//!
//! What makes it small, per key and round:
//! - **Numbers for keys.** An exchange names a key by its number in the sender's
//!   dictionary for that peer ([`KeyIds`]); the key is spelled out only until a reply
//!   shows the peer has it (`wire/keys.rs` has the rules, also for a receiver that lost it).
//! - **Replies name nothing.** A reply's keys are its request's, in order: it says which
//!   of them it answers by position.
//! - **Varints and flags.** Amounts are whole thousandths (asks and grants are floored to
//!   them) and travel as integers; seqs as the difference to the previous one in the same
//!   message (a lender grants in sequence); what is absent costs a bit of one flags byte.
//!
//! Demand travels as the f32 the JSON form carries, so a message decodes to exactly the
//! value that was encoded (its tests check the round trip), and the simulator, which
//! sends every message through this codec, runs the same protocol the daemons run.

mod bytes;
mod keys;
#[cfg(test)]
mod tests;

use bytes::{Reader, as_milli, from_milli, put_f32, put_f64, put_i64, put_str, put_u64};
pub use keys::{KeyIds, KeyTable, Spelled};

use super::message::{
    Exchange, ExchangeReply, Grant, KeyReply, KeyReport, PolicyReply, PolicyReport,
};
use super::{LocalUs, RegionId};

/// First byte of a binary body (JSON starts with `{`).
pub const MAGIC: u8 = 0xB7;
/// The format's version, second byte; a receiver refuses one it does not know.
pub const VERSION: u8 = 1;
/// The media type of a binary body (JSON bodies are `application/json`).
pub const CONTENT_TYPE: &str = "application/x-quotad-exchange";

const KIND_EXCHANGE: u8 = 1;
const KIND_REPLY: u8 = 2;

// Flags of a key in an exchange.
const F_WANT: u8 = 1;
const F_WANT_F64: u8 = 1 << 1;
const F_RELEASE: u8 = 1 << 2;
const F_HELD: u8 = 1 << 3;
const F_HELD_F64: u8 = 1 << 4;
const F_FREED: u8 = 1 << 5;
const EXCHANGE_FLAGS: u8 = (1 << 6) - 1;

// Flags of a key in a reply.
const G_GRANT: u8 = 1;
const G_AMOUNT_F64: u8 = 1 << 1;
const REPLY_FLAGS: u8 = (1 << 2) - 1;

/// Why a binary body could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireError {
    /// The body ended inside a field.
    Truncated,
    /// A number's encoding is longer than any u64's.
    BadVarint,
    /// A key that is not UTF-8.
    NotUtf8,
    /// Bytes after the message.
    TrailingBytes,
    /// Not a binary body (or not an exchange where one was expected).
    NotBinary,
    /// A format version this build does not read.
    UnknownVersion(u8),
    /// Flag bits this build does not know.
    BadFlags,
    /// A value past what its field may hold (a region id, a dictionary number).
    OutOfRange,
    /// A key number this receiver has no spelling for: the sender must start over.
    UnknownKey,
    /// A key number past the receiver's cap.
    DictionaryFull,
    /// A message of a dictionary epoch older than one already seen.
    StaleDictionary,
    /// A reply that does not fit the request it answers.
    NotTheRequest,
}

impl WireError {
    /// The receiver lacks (part of) the sender's dictionary: the sender should start a new
    /// epoch rather than resend the same message.
    pub fn is_dictionary(self) -> bool {
        matches!(
            self,
            WireError::UnknownKey | WireError::DictionaryFull | WireError::StaleDictionary
        )
    }
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            WireError::Truncated => "ends early",
            WireError::BadVarint => "a varint longer than 64 bits",
            WireError::NotUtf8 => "a key that is not UTF-8",
            WireError::TrailingBytes => "bytes after the message",
            WireError::NotBinary => "not a binary exchange",
            WireError::UnknownVersion(_) => "a format version this region does not know",
            WireError::BadFlags => "unknown flag bits",
            WireError::OutOfRange => "a value out of range",
            WireError::UnknownKey => "a key number this region has no spelling for",
            WireError::DictionaryFull => "a key number past the dictionary's cap",
            WireError::StaleDictionary => "a dictionary older than one already in use",
            WireError::NotTheRequest => "a reply that does not fit its request",
        };
        f.write_str(s)
    }
}

impl std::error::Error for WireError {}

/// Keys a dictionary may hold, at each end of a link: twice what one exchange may carry
/// (the keys of a round, and as many that came and went before the numbering starts over).
pub fn dictionary_cap(max_exchange_keys: usize) -> usize {
    2 * max_exchange_keys
}

/// Whether `body` is in the binary form (else it is JSON, or neither).
pub fn is_binary(body: &[u8]) -> bool {
    body.first() == Some(&MAGIC)
}

/// Which message a binary body holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An [`super::message::Exchange`].
    Exchange,
    /// An [`super::message::ExchangeReply`].
    Reply,
}

/// The kind of a binary body of this version; `None` for anything else.
pub fn kind(body: &[u8]) -> Option<Kind> {
    match body {
        [MAGIC, VERSION, KIND_EXCHANGE, ..] => Some(Kind::Exchange),
        [MAGIC, VERSION, KIND_REPLY, ..] => Some(Kind::Reply),
        _ => None,
    }
}

/// The `t_req` a binary reply echoes (which exchange it answers), if its header reads.
pub fn reply_t_req(body: &[u8]) -> Option<i64> {
    Head::read(&mut Reader::new(body), KIND_REPLY)
        .ok()
        .map(|h| h.t_req)
}

/// What both messages open with, after the format's three bytes.
struct Head {
    from: RegionId,
    incarnation: u64,
    to_incarnation: u64,
    t_req: LocalUs,
}

impl Head {
    fn put(&self, out: &mut Vec<u8>, kind: u8) {
        out.extend_from_slice(&[MAGIC, VERSION, kind]);
        put_u64(out, u64::from(self.from.0));
        put_u64(out, self.incarnation);
        put_u64(out, self.to_incarnation);
        put_i64(out, self.t_req);
    }

    fn read(r: &mut Reader, kind: u8) -> Result<Head, WireError> {
        read_header(r, kind)?;
        Ok(Head {
            from: region(r)?,
            incarnation: r.u64()?,
            to_incarnation: r.u64()?,
            t_req: r.i64()?,
        })
    }
}

fn read_header(r: &mut Reader, kind: u8) -> Result<(), WireError> {
    if r.u8()? != MAGIC {
        return Err(WireError::NotBinary);
    }
    let v = r.u8()?;
    if v != VERSION {
        return Err(WireError::UnknownVersion(v));
    }
    if r.u8()? != kind {
        return Err(WireError::NotBinary);
    }
    Ok(())
}

fn region(r: &mut Reader) -> Result<RegionId, WireError> {
    u16::try_from(r.u64()?)
        .map(RegionId)
        .map_err(|_| WireError::OutOfRange)
}

/// An amount: a whole number of thousandths as that number, else the f64 (`f64_flag` set).
fn put_amount(out: &mut Vec<u8>, v: f64) {
    match as_milli(v) {
        Some(m) => put_u64(out, m),
        None => put_f64(out, v),
    }
}

fn amount_flag(v: f64, f64_flag: u8) -> u8 {
    if as_milli(v).is_some() { 0 } else { f64_flag }
}

fn read_amount(r: &mut Reader, as_f64: bool) -> Result<f64, WireError> {
    if as_f64 {
        r.f64()
    } else {
        Ok(from_milli(r.u64()?))
    }
}

/// A seq as the difference to the previous one of the message (`prev` is updated).
fn put_seq(out: &mut Vec<u8>, seq: u64, prev: &mut u64) {
    put_i64(out, seq.wrapping_sub(*prev) as i64);
    *prev = seq;
}

fn read_seq(r: &mut Reader, prev: &mut u64) -> Result<u64, WireError> {
    let seq = prev.wrapping_add(r.i64()? as u64);
    *prev = seq;
    Ok(seq)
}

impl KeyIds {
    /// The exchange in binary, and what a reply to it will confirm (pass it to
    /// [`KeyIds::confirm`] once a verified reply to this message arrives).
    pub fn encode(&mut self, ex: &Exchange) -> (Vec<u8>, Spelled) {
        self.prepare(
            ex.policies
                .iter()
                .flat_map(|p| p.keys.iter().map(|k| k.key.as_str())),
        );
        let mut spelled = self.spelled();
        let mut out =
            Vec::with_capacity(32 + 16 * ex.policies.iter().map(|p| p.keys.len()).sum::<usize>());
        let head = Head {
            from: ex.from,
            incarnation: ex.incarnation,
            to_incarnation: ex.to_incarnation,
            t_req: ex.t_req,
        };
        head.put(&mut out, KIND_EXCHANGE);
        put_u64(&mut out, self.epoch());
        put_u64(&mut out, ex.policies.len() as u64);
        let mut prev_seq = 0;
        for p in &ex.policies {
            put_str(&mut out, &p.name);
            put_u64(&mut out, p.applied);
            put_u64(&mut out, p.keys.len() as u64);
            for k in &p.keys {
                let (id, spell) = self.number(&k.key, &mut spelled);
                put_u64(&mut out, (u64::from(id) << 1) | u64::from(spell));
                if spell {
                    put_str(&mut out, &k.key);
                }
                let mut flags = 0;
                if let Some(w) = k.want {
                    flags |= F_WANT | amount_flag(w, F_WANT_F64);
                }
                if k.release.is_some() {
                    flags |= F_RELEASE;
                }
                if let Some(h) = k.held {
                    flags |= F_HELD | amount_flag(h, F_HELD_F64);
                }
                if k.freed {
                    flags |= F_FREED;
                }
                out.push(flags);
                put_f32(&mut out, k.demand);
                if let Some(w) = k.want {
                    put_amount(&mut out, w);
                }
                if let Some(s) = k.release {
                    put_seq(&mut out, s, &mut prev_seq);
                }
                if let Some(h) = k.held {
                    put_amount(&mut out, h);
                }
            }
        }
        (out, spelled)
    }
}

/// The sender's dictionary epoch of a binary exchange, if its header reads: what a
/// receiver's refusal refers to (see [`KeyIds::refused`]).
pub fn exchange_epoch(body: &[u8]) -> Option<u64> {
    let mut r = Reader::new(body);
    Head::read(&mut r, KIND_EXCHANGE).ok()?;
    r.u64().ok()
}

impl KeyTable {
    /// A binary exchange from the peer this table belongs to. The table learns the keys
    /// the message spells out even if a later part of it fails to decode.
    pub fn decode(&mut self, body: &[u8]) -> Result<Exchange, WireError> {
        let mut r = Reader::new(body);
        let head = Head::read(&mut r, KIND_EXCHANGE)?;
        let epoch = r.u64()?;
        self.begin(head.incarnation, epoch)?;
        let n = r.count(3)?;
        let mut policies = Vec::with_capacity(n);
        let mut prev_seq = 0;
        for _ in 0..n {
            let name = r.string()?;
            let applied = r.u64()?;
            let count = r.count(6)?;
            let mut keys = Vec::with_capacity(count);
            for _ in 0..count {
                keys.push(self.key_report(&mut r, &mut prev_seq)?);
            }
            policies.push(PolicyReport {
                name,
                applied,
                keys,
            });
        }
        r.done()?;
        Ok(Exchange {
            from: head.from,
            incarnation: head.incarnation,
            to_incarnation: head.to_incarnation,
            t_req: head.t_req,
            policies,
        })
    }

    fn key_report(&mut self, r: &mut Reader, prev_seq: &mut u64) -> Result<KeyReport, WireError> {
        let head = r.u64()?;
        let id = u32::try_from(head >> 1).map_err(|_| WireError::OutOfRange)?;
        let key = if head & 1 == 1 {
            let key = r.string()?;
            self.define(id, &key)?;
            key
        } else {
            self.get(id)?.to_owned()
        };
        let flags = r.u8()?;
        if flags & !EXCHANGE_FLAGS != 0 {
            return Err(WireError::BadFlags);
        }
        let demand = r.f32()?;
        let want = if flags & F_WANT != 0 {
            Some(read_amount(r, flags & F_WANT_F64 != 0)?)
        } else {
            None
        };
        let release = if flags & F_RELEASE != 0 {
            Some(read_seq(r, prev_seq)?)
        } else {
            None
        };
        let held = if flags & F_HELD != 0 {
            Some(read_amount(r, flags & F_HELD_F64 != 0)?)
        } else {
            None
        };
        Ok(KeyReport {
            key,
            demand,
            want,
            release,
            held,
            freed: flags & F_FREED != 0,
        })
    }
}

/// The reply in binary, against the request it answers: each policy by its position in
/// the request, each key by its position in the request's policy. `None` if the reply
/// does not follow its request's order (the caller then sends JSON).
pub fn encode_reply(request: &Exchange, reply: &ExchangeReply) -> Option<Vec<u8>> {
    let keys: usize = reply.policies.iter().map(|p| p.keys.len()).sum();
    let mut out = Vec::with_capacity(32 + 12 * keys);
    let head = Head {
        from: reply.from,
        incarnation: reply.incarnation,
        to_incarnation: reply.to_incarnation,
        t_req: reply.t_req,
    };
    head.put(&mut out, KIND_REPLY);
    put_i64(&mut out, reply.lease_us);
    put_u64(&mut out, reply.policies.len() as u64);
    let mut next_block = 0;
    let mut prev_seq = 0;
    for p in &reply.policies {
        let at = next_block
            + request.policies[next_block..]
                .iter()
                .position(|b| b.name == p.name)?;
        put_u64(&mut out, (at - next_block) as u64);
        next_block = at + 1;
        let asked = &request.policies[at].keys;
        put_u64(&mut out, p.applied);
        put_u64(&mut out, p.keys.len() as u64);
        let mut next_key = 0;
        for k in &p.keys {
            let i = next_key + asked[next_key..].iter().position(|a| a.key == k.key)?;
            put_u64(&mut out, (i - next_key) as u64);
            next_key = i + 1;
            let flags = match k.grant {
                Some(g) => G_GRANT | amount_flag(g.amount, G_AMOUNT_F64),
                None => 0,
            };
            out.push(flags);
            put_f32(&mut out, k.demand);
            if let Some(g) = k.grant {
                put_seq(&mut out, g.seq, &mut prev_seq);
                put_amount(&mut out, g.amount);
            }
        }
    }
    Some(out)
}

/// A binary reply to `request` (the exchange this region sent).
pub fn decode_reply(request: &Exchange, body: &[u8]) -> Result<ExchangeReply, WireError> {
    let mut r = Reader::new(body);
    let head = Head::read(&mut r, KIND_REPLY)?;
    let lease_us = r.i64()?;
    let n = r.count(3)?;
    let mut policies = Vec::with_capacity(n);
    let mut next_block = 0;
    let mut prev_seq = 0;
    for _ in 0..n {
        let at = skip(&mut r, next_block, request.policies.len())?;
        next_block = at + 1;
        let block = &request.policies[at];
        let applied = r.u64()?;
        let count = r.count(6)?;
        let mut keys = Vec::with_capacity(count);
        let mut next_key = 0;
        for _ in 0..count {
            let i = skip(&mut r, next_key, block.keys.len())?;
            next_key = i + 1;
            let flags = r.u8()?;
            if flags & !REPLY_FLAGS != 0 {
                return Err(WireError::BadFlags);
            }
            let demand = r.f32()?;
            let grant = if flags & G_GRANT != 0 {
                let seq = read_seq(&mut r, &mut prev_seq)?;
                let amount = read_amount(&mut r, flags & G_AMOUNT_F64 != 0)?;
                Some(Grant { seq, amount })
            } else {
                None
            };
            keys.push(KeyReply {
                key: block.keys[i].key.clone(),
                demand,
                grant,
            });
        }
        policies.push(PolicyReply {
            name: block.name.clone(),
            applied,
            keys,
        });
    }
    r.done()?;
    Ok(ExchangeReply {
        from: head.from,
        incarnation: head.incarnation,
        to_incarnation: head.to_incarnation,
        t_req: head.t_req,
        lease_us,
        policies,
    })
}

/// The position `from + skipped`, which must be below `len`.
fn skip(r: &mut Reader, from: usize, len: usize) -> Result<usize, WireError> {
    let s = r.u64()?;
    let at = (from as u64)
        .checked_add(s)
        .ok_or(WireError::NotTheRequest)?;
    if at >= len as u64 {
        return Err(WireError::NotTheRequest);
    }
    Ok(at as usize)
}
