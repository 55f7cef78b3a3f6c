//! `[policy.forward_auth]`: how a proxy's forward-auth subrequest (nginx `auth_request`,
//! Caddy `forward_auth`, Traefik `forwardAuth`) names the key of a policy, and what quotad
//! answers it. The HTTP side is `api::forward_auth`.

use std::collections::HashMap;

use toml::Spanned;

use super::{Validator, raw};

/// Where one part of the key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeySource {
    /// A header of the original request (the proxy forwards it), by lower-case name.
    Header(String),
    /// The client's address: the `X-Forwarded-For` entry appended by the outermost of
    /// the `trusted_hops` proxies (entries further left are the client's to forge); only
    /// when no proxy wrote `X-Forwarded-For`, `X-Real-IP` (`api::forward_auth::client_ip`).
    ClientIp,
}

/// What a request without its key gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum MissingKey {
    /// The denied status, as if the limit were reached.
    Deny,
    /// Allowed, not counted against any key.
    Allow,
    /// Counted against this key (all keyless requests share it).
    Key(String),
}

impl MissingKey {
    /// The `answer` label of `quotad_forward_auth_missing_key_total`: the config's word
    /// for it, without the fixed key (a label value from a bounded set, never a key).
    pub(crate) fn answer(&self) -> &'static str {
        match self {
            MissingKey::Deny => "deny",
            MissingKey::Allow => "allow",
            MissingKey::Key(_) => "key",
        }
    }
}

/// One policy's forward-auth settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ForwardAuth {
    /// The parts of the key, joined in this order by `api::key::join` (`|`, escaped).
    pub(crate) key: Vec<KeySource>,
    /// Proxies in front of quotad that append to `X-Forwarded-For` and are trusted.
    pub(crate) trusted_hops: usize,
    /// The status of a denial (429 by default; nginx's `auth_request` accepts only 2xx,
    /// 401 and 403 from the subrequest).
    pub(crate) denied_status: u16,
    pub(crate) on_missing_key: MissingKey,
    /// What each request costs (default 1; 0 is a peek: admitted unless the key has
    /// nothing left, as for a budget whose real cost the service charges after the work).
    pub(crate) cost: u64,
}

/// Forward-auth settings by policy name.
pub(crate) type ForwardAuths = HashMap<String, ForwardAuth>;

pub(super) const DEFAULT_TRUSTED_HOPS: i64 = 1;
pub(super) const DEFAULT_DENIED_STATUS: i64 = 429;

impl Validator<'_> {
    /// `[policy.forward_auth]` of policy `i` (named `name`).
    pub(super) fn forward_auth(
        &mut self,
        i: usize,
        f: &raw::ForwardAuth,
        capacity: Option<u64>,
    ) -> Option<ForwardAuth> {
        let field = |k: &str| format!("policy[{i}].forward_auth.{k}");
        let errors_before = self.errors.len();
        if f.key.get_ref().is_empty() {
            self.error(
                &f.key,
                &field("key"),
                "needs at least one source: \"header:<name>\" or \"client_ip\"",
            );
        }
        let key: Vec<KeySource> = f
            .key
            .get_ref()
            .iter()
            .filter_map(|s| self.key_source(s, &field("key")))
            .collect();
        let trusted_hops = self.integer(
            f.trusted_hops.as_ref(),
            &field("trusted_hops"),
            DEFAULT_TRUSTED_HOPS,
            1,
            16,
        ) as usize;
        let denied_status = self.integer(
            f.denied_status.as_ref(),
            &field("denied_status"),
            DEFAULT_DENIED_STATUS,
            400,
            499,
        ) as u16;
        let on_missing_key = match &f.on_missing_key {
            None => MissingKey::Deny,
            Some(m) => match m.get_ref().as_str() {
                "deny" => MissingKey::Deny,
                "allow" => MissingKey::Allow,
                other => match other.strip_prefix("key:") {
                    Some(k) if !k.is_empty() => MissingKey::Key(k.to_owned()),
                    _ => {
                        let why = "must be \"deny\", \"allow\" or \"key:<a fixed key>\"";
                        self.error(m, &field("on_missing_key"), why);
                        MissingKey::Deny
                    }
                },
            },
        };
        let cost = self.integer(
            f.cost.as_ref(),
            &field("cost"),
            1,
            0,
            capacity.unwrap_or(1) as i64,
        ) as u64;
        (self.errors.len() == errors_before).then_some(ForwardAuth {
            key,
            trusted_hops,
            denied_status,
            on_missing_key,
            cost,
        })
    }

    fn key_source(&mut self, s: &Spanned<String>, field: &str) -> Option<KeySource> {
        let v = s.get_ref();
        if v == "client_ip" {
            return Some(KeySource::ClientIp);
        }
        match v.strip_prefix("header:") {
            Some(h) if http_token(h) => Some(KeySource::Header(h.to_ascii_lowercase())),
            _ => {
                let why =
                    format!("\"{v}\": expected \"header:<name>\" (a header name) or \"client_ip\"");
                self.error(s, field, why);
                None
            }
        }
    }
}

/// An HTTP header name (RFC 9110 token characters).
fn http_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}
