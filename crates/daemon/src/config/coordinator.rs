//! `[coordinator]` and `[[peer]]`: the other regions of a global budget, how to reach them,
//! the secrets exchanges are signed with, and the protocol's timings.

use std::fmt;
use std::time::Duration;

use quotad_core::coordinator::{Params, RegionId};

use super::policy::Timing;
use super::secret::{Resolved, Sources};
use super::{NAME_RULE, Validator, raw};
use crate::policy;

/// A shared secret; never printed.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Secret(pub Vec<u8>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// A peer region: where its quotad instances answer exchanges, and the secret both sides
/// sign them with.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PeerSettings {
    pub(crate) region: String,
    pub(crate) id: RegionId,
    /// Tried in order until one answers as its region's coordinator (a region may run
    /// several instances; only the lock holder coordinates).
    pub(crate) urls: Vec<String>,
    pub(crate) secret: Secret,
}

/// Global budgets: this region among the others, and the protocol's timings.
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalSettings {
    /// Every region, sorted by name: a region's index here is its id in messages.
    pub regions: Vec<String>,
    pub(crate) me: RegionId,
    pub(crate) peers: Vec<PeerSettings>,
    pub(crate) params: Params,
    /// The coordinator lock's period: a dead holder is replaced within it.
    pub(crate) lock: Duration,
    /// Signed exchanges whose timestamp is further than this from our clock are refused
    /// (and nonces are remembered this long: the replay window).
    pub(crate) max_skew: Duration,
    /// Largest exchange body accepted (and reply read): what `max_exchange_keys` keys of
    /// `server.max_key_bytes` take at worst (every byte escaped), with room for the
    /// envelope. Only a peer that holds the secret gets a body read at all.
    pub(crate) max_exchange_bytes: usize,
    /// `server.max_key_bytes`: a peer's key longer than this is refused like a client's.
    pub(crate) max_key_bytes: usize,
    /// The form exchanges travel in (`coordinator.exchange_encoding`).
    pub(crate) encoding: Encoding,
}

/// How this region sends exchanges, and which forms it accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Encoding {
    /// The binary form, falling back to JSON for a peer that refuses it (an older
    /// version); JSON is accepted too.
    Binary,
    /// Only the JSON envelope, sent and accepted, as versions before the binary form:
    /// for reading exchanges on the wire, or to rehearse a rolling upgrade.
    Json,
}

/// Bytes an exchange may spend per key besides the key itself (fields, quoting, escapes
/// of a few characters), and on its envelope.
pub(crate) const EXCHANGE_BYTES_PER_KEY: usize = 128;
pub(crate) const EXCHANGE_ENVELOPE_BYTES: usize = 64 * 1024;
pub(crate) const DEFAULT_LOCK: Duration = Duration::from_secs(3);
pub(crate) const DEFAULT_MAX_SKEW: Duration = Duration::from_secs(30);
pub(crate) const MIN_SECRET_BYTES: usize = 16;

/// Every region (ours and the peers'), sorted by name: a region's index is its id.
pub(super) fn regions(region: &str, peers: &[PeerSettings]) -> Vec<String> {
    let mut regions: Vec<String> = peers.iter().map(|p| p.region.clone()).collect();
    regions.push(region.to_owned());
    regions.sort();
    regions
}

/// `region`'s id: its index among `regions`.
fn region_id(regions: &[String], region: &str) -> RegionId {
    RegionId(regions.iter().position(|r| r == region).unwrap_or(0) as u16)
}

fn peer_field(i: usize, name: &str) -> String {
    format!("peer[{i}].{name}")
}

impl Validator<'_> {
    /// The `[[peer]]` entries: unique regions other than ours, http URLs, a secret each.
    pub(super) fn peers(
        &mut self,
        region: &str,
        raw: &[raw::Peer],
        coordinator: &raw::Coordinator,
    ) -> Vec<PeerSettings> {
        let mut out: Vec<PeerSettings> = Vec::new();
        let shared = self.shared_secret(coordinator);
        for (i, p) in raw.iter().enumerate() {
            if !self.peer_region(i, p, region, &out) {
                continue;
            }
            let urls = self.peer_urls(i, p);
            let secret = self.peer_secret(i, p, &shared);
            out.push(PeerSettings {
                region: p.region.get_ref().clone(),
                id: RegionId(0),
                urls,
                secret,
            });
        }
        out
    }

    /// Whether a peer's region is a valid name, not ours and not an earlier peer's. A peer
    /// without such a region is skipped: it could not be told apart from the others.
    fn peer_region(
        &mut self,
        i: usize,
        p: &raw::Peer,
        region: &str,
        earlier: &[PeerSettings],
    ) -> bool {
        let name = p.region.get_ref();
        let problem = if !policy::valid_name(name) {
            NAME_RULE.to_owned()
        } else if name == region {
            format!("\"{name}\" is this daemon's own region")
        } else if earlier.iter().any(|o| o.region == *name) {
            format!("duplicate peer region \"{name}\"")
        } else {
            return true;
        };
        self.error(&p.region, &peer_field(i, "region"), problem);
        false
    }

    /// A peer's `url` or `urls` (one of the two), each plain http: exchanges are signed, so
    /// TLS is left to a proxy. Trailing slashes are dropped.
    fn peer_urls(&mut self, i: usize, p: &raw::Peer) -> Vec<String> {
        let f = |name: &str| peer_field(i, name);
        let mut urls = Vec::new();
        match (&p.url, &p.urls) {
            (Some(u), None) => urls.push((u.span().start, u.get_ref().clone())),
            (None, Some(list)) if !list.get_ref().is_empty() => urls.extend(
                list.get_ref()
                    .iter()
                    .map(|u| (list.span().start, u.clone())),
            ),
            (Some(u), Some(_)) => {
                self.error(u, &f("url"), "give url or urls, not both");
            }
            _ => self.error(
                &p.region,
                &f("url"),
                "a peer needs url = \"http://HOST:PORT\" (or urls = [...])",
            ),
        }
        for (at, u) in &urls {
            let ok = u
                .strip_prefix("http://")
                .is_some_and(|rest| !rest.is_empty() && !rest.contains(char::is_whitespace));
            if !ok {
                self.error_at(*at, &f("url"), format!("{u:?}: must be http://HOST:PORT (peers authenticate every exchange with HMAC; put TLS in front if the network is untrusted)"));
            }
        }
        urls.into_iter()
            .map(|(_, u)| u.trim_end_matches('/').to_owned())
            .collect()
    }

    /// `[coordinator] secret` (or `secret_file`, `secret_env`): the secret of every peer
    /// without its own. `Err(())` when it was set but could not be read (the error is
    /// recorded).
    fn shared_secret(&mut self, c: &raw::Coordinator) -> Result<Option<Secret>, ()> {
        let sources = Sources {
            inline: c.secret.as_ref(),
            file: c.secret_file.as_ref(),
            env: c.secret_env.as_ref(),
        };
        let set = sources.any();
        match self.secret("coordinator.secret", &sources) {
            Some(r) => Ok(Some(self.long_enough(r))),
            None if set => Err(()),
            None => Ok(None),
        }
    }

    /// The secret a peer's exchanges are signed with: its own, or `shared`; an error
    /// names whichever key gave it.
    fn peer_secret(
        &mut self,
        i: usize,
        p: &raw::Peer,
        shared: &Result<Option<Secret>, ()>,
    ) -> Secret {
        let sources = Sources {
            inline: p.secret.as_ref(),
            file: p.secret_file.as_ref(),
            env: p.secret_env.as_ref(),
        };
        let own_set = sources.any();
        if let Some(r) = self.secret(&peer_field(i, "secret"), &sources) {
            return self.long_enough(r);
        }
        match shared {
            Ok(Some(s)) if !own_set => s.clone(),
            Ok(None) if !own_set => {
                self.error(&p.region, &peer_field(i, "secret"), "a peer needs a shared secret (here or in [coordinator] secret): exchanges move budget and are signed");
                Secret(Vec::new())
            }
            // An error was recorded where the secret was set.
            _ => Secret(Vec::new()),
        }
    }

    /// `r` as a signing secret, with an error if it is shorter than [`MIN_SECRET_BYTES`].
    fn long_enough(&mut self, r: Resolved<'_>) -> Secret {
        if r.bytes.len() < MIN_SECRET_BYTES {
            self.error(
                r.at,
                &r.field,
                format!("must be at least {MIN_SECRET_BYTES} bytes"),
            );
        }
        Secret(r.bytes)
    }

    /// The global settings, once some policy is global: `[coordinator]`, then the regions
    /// numbered by name, and the exchange size that `server.max_key_bytes` implies.
    pub(super) fn global(
        &mut self,
        c: &raw::Coordinator,
        timing: Timing,
        region: &str,
        regions: Vec<String>,
        peers: Vec<PeerSettings>,
        max_key_bytes: usize,
    ) -> GlobalSettings {
        let mut settings = self.coordinator(c, timing.lease, timing.round);
        settings.me = region_id(&regions, region);
        // JSON escapes a control character in a key as six bytes (\u00XX).
        settings.max_exchange_bytes = settings.params.max_exchange_keys
            * (6 * max_key_bytes + EXCHANGE_BYTES_PER_KEY)
            + EXCHANGE_ENVELOPE_BYTES;
        settings.max_key_bytes = max_key_bytes;
        settings.peers = peers
            .into_iter()
            .map(|mut p| {
                p.id = region_id(&regions, &p.region);
                p
            })
            .collect();
        settings.regions = regions;
        settings
    }

    /// `[coordinator]`: protocol timings shared by every region (the safety argument
    /// compares them), the lock period, the replay window.
    fn coordinator(
        &mut self,
        c: &raw::Coordinator,
        lease: Duration,
        round: Duration,
    ) -> GlobalSettings {
        let defaults = Params::default();
        let margin = self.duration(
            c.margin.as_ref(),
            "coordinator.margin",
            Duration::from_micros(defaults.margin_us as u64),
            Duration::from_millis(1),
            Duration::from_secs(10),
        );
        let epsilon = self.epsilon(c, defaults.epsilon);
        let lock = self.duration(
            c.lock.as_ref(),
            "coordinator.lock",
            DEFAULT_LOCK,
            Duration::from_millis(300),
            Duration::from_secs(300),
        );
        let max_skew = self.duration(
            c.max_skew.as_ref(),
            "coordinator.max_skew",
            DEFAULT_MAX_SKEW,
            Duration::from_secs(1),
            Duration::from_secs(3600),
        );
        let max_exchange_keys = self.integer(
            c.max_exchange_keys.as_ref(),
            "coordinator.max_exchange_keys",
            defaults.max_exchange_keys as i64,
            100,
            1_000_000,
        ) as usize;
        // Demand read between rounds: a quarter of a round unless set ("0s": only in rounds).
        let sense = self.duration(
            c.sense.as_ref(),
            "coordinator.sense",
            round / 4,
            Duration::ZERO,
            round / 2,
        );
        let encoding = self.encoding(c);
        let params = Params {
            round_us: round.as_micros() as i64,
            lease_us: lease.as_micros() as i64,
            epsilon,
            margin_us: margin.as_micros() as i64,
            max_exchange_keys,
            sense_us: sense.as_micros() as i64,
            ..defaults
        };
        GlobalSettings {
            regions: Vec::new(),
            me: RegionId(0),
            peers: Vec::new(),
            params,
            lock,
            max_skew,
            max_exchange_bytes: 0,
            max_key_bytes: 0,
            encoding,
        }
    }

    /// `coordinator.epsilon`: the bound on any clock's rate error, in [0, 0.1).
    fn epsilon(&mut self, c: &raw::Coordinator, default: f64) -> f64 {
        match &c.epsilon {
            None => default,
            Some(e) if (0.0..0.1).contains(e.get_ref()) => *e.get_ref(),
            Some(e) => {
                self.error(
                    e,
                    "coordinator.epsilon",
                    "must be in [0, 0.1): the bound on any clock's rate error",
                );
                default
            }
        }
    }

    /// `coordinator.exchange_encoding`: "binary" (the default) or "json".
    fn encoding(&mut self, c: &raw::Coordinator) -> Encoding {
        let Some(e) = &c.exchange_encoding else {
            return Encoding::Binary;
        };
        match e.get_ref().as_str() {
            "binary" => Encoding::Binary,
            "json" => Encoding::Json,
            _ => {
                self.error(
                    e,
                    "coordinator.exchange_encoding",
                    "must be \"binary\" or \"json\"",
                );
                Encoding::Binary
            }
        }
    }
}
