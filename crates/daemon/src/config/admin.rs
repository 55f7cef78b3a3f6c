//! `[admin]`: who may change limits. The admin endpoints (`POST /v1/reset`) take a bearer
//! token, one of `[[admin.token]]`, each with a name the audit log and the metrics use.
//! Without a token configured they refuse every request, unless `allow_without_token` is
//! set, which is accepted only when the HTTP listener is a loopback address or a Unix
//! socket (a sidecar whose only callers share its pod or host).
//!
//! A token is held as its SHA-256 only, and a presented one is compared with every
//! configured digest in constant time.

use std::fmt;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::coordinator::PeerSettings;
use super::secret::Sources;
use super::{NAME_RULE, Validator, raw};
use crate::server::Endpoint;

/// The shortest token accepted: a random string, not a word an operator typed.
pub(crate) const MIN_TOKEN_BYTES: usize = 16;

/// One admin token: its name, and the SHA-256 of its value.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct AdminToken {
    pub(crate) name: String,
    digest: [u8; 32],
}

/// The digest is a secret's: never printed.
impl fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminToken")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// `[admin]` as validated.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct AdminSettings {
    pub(crate) tokens: Vec<AdminToken>,
    /// `admin.allow_without_token`: the admin endpoints answer without a token (only with a
    /// loopback or Unix-socket listener).
    pub(crate) without_token: bool,
}

/// Who made an admin request, for the audit log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Caller<'a> {
    /// A configured token, by name.
    Token(&'a str),
    /// No token: `admin.allow_without_token` is on.
    Unauthenticated,
}

impl fmt::Display for Caller<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Caller::Token(name) => f.write_str(name),
            Caller::Unauthenticated => f.write_str("-"),
        }
    }
}

impl AdminSettings {
    /// Who `presented` (the bearer token of a request, if it sent one) is: `None` when it
    /// may not change limits. Every configured token is compared, in constant time.
    pub(crate) fn caller(&self, presented: Option<&[u8]>) -> Option<Caller<'_>> {
        let Some(presented) = presented else {
            return self.without_token.then_some(Caller::Unauthenticated);
        };
        let digest: [u8; 32] = Sha256::digest(presented).into();
        let mut found = None;
        for t in &self.tokens {
            if bool::from(t.digest.ct_eq(&digest)) {
                found = Some(Caller::Token(t.name.as_str()));
            }
        }
        found.or_else(|| self.without_token.then_some(Caller::Unauthenticated))
    }
}

impl Validator<'_> {
    /// `[admin]`; `listen` is the HTTP listener the endpoints are served on, `peers` the
    /// regions whose secrets a token must not be.
    pub(super) fn admin(
        &mut self,
        raw: &raw::Admin,
        listen: &Endpoint,
        peers: &[PeerSettings],
    ) -> AdminSettings {
        let mut tokens: Vec<AdminToken> = Vec::new();
        for (i, t) in raw.token.iter().enumerate() {
            let field = format!("admin.token[{i}]");
            let name = t.name.get_ref();
            if !crate::policy::valid_name(name) {
                self.error(&t.name, &format!("{field}.name"), NAME_RULE);
            } else if tokens.iter().any(|o| &o.name == name) {
                self.error(
                    &t.name,
                    &format!("{field}.name"),
                    "a token of this name is defined already",
                );
            }
            let sources = Sources {
                inline: t.token.as_ref(),
                file: t.token_file.as_ref(),
                env: t.token_env.as_ref(),
            };
            if !sources.any() {
                let why = "set one of token, token_file or token_env";
                self.error(&t.name, &format!("{field}.token"), why);
                continue;
            }
            let Some(secret) = self.secret(&format!("{field}.token"), &sources) else {
                continue;
            };
            if secret.bytes.len() < MIN_TOKEN_BYTES {
                let why = format!("a token must be at least {MIN_TOKEN_BYTES} bytes");
                self.error(secret.at, &secret.field, why);
                continue;
            }
            // A credential of its own: a peer region holds its exchange secret.
            if peers.iter().any(|p| p.secret.0 == secret.bytes) {
                let why = "must differ from every peer's secret: the regions that exchange with this one hold those";
                self.error(secret.at, &secret.field, why);
                continue;
            }
            tokens.push(AdminToken {
                name: name.clone(),
                digest: Sha256::digest(&secret.bytes).into(),
            });
        }
        let without_token = match &raw.allow_without_token {
            Some(open) if *open.get_ref() => {
                let field = "admin.allow_without_token";
                if !raw.token.is_empty() {
                    self.error(
                        open,
                        field,
                        "set either admin.token or allow_without_token, not both",
                    );
                } else if !local_only(listen) {
                    let why = format!(
                        "only with a loopback or Unix-socket server.listen (it is {listen}): \
                         anyone who reaches the port could reset any key"
                    );
                    self.error(open, field, why);
                }
                true
            }
            _ => false,
        };
        AdminSettings {
            tokens,
            without_token,
        }
    }
}

/// Whether only this host (or pod) can reach `listen`.
fn local_only(listen: &Endpoint) -> bool {
    match listen {
        Endpoint::Tcp(addr) => addr.ip().is_loopback(),
        Endpoint::Unix(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(tokens: &[(&str, &str)], without_token: bool) -> AdminSettings {
        AdminSettings {
            tokens: tokens
                .iter()
                .map(|(name, t)| AdminToken {
                    name: (*name).to_owned(),
                    digest: Sha256::digest(t.as_bytes()).into(),
                })
                .collect(),
            without_token,
        }
    }

    #[test]
    fn a_caller_is_the_token_it_presents_and_nobody_without_one() {
        let s = settings(
            &[("billing", "0123456789abcdef"), ("ops", "fedcba9876543210")],
            false,
        );
        assert_eq!(
            s.caller(Some(b"fedcba9876543210")),
            Some(Caller::Token("ops"))
        );
        assert_eq!(
            s.caller(Some(b"0123456789abcdef")),
            Some(Caller::Token("billing"))
        );
        assert_eq!(s.caller(Some(b"0123456789abcdeF")), None);
        assert_eq!(s.caller(Some(b"")), None);
        assert_eq!(s.caller(None), None);
        assert_eq!(AdminSettings::default().caller(Some(b"anything")), None);
    }

    #[test]
    fn without_a_token_only_when_the_operator_says_so() {
        let open = settings(&[], true);
        assert_eq!(open.caller(None), Some(Caller::Unauthenticated));
        assert_eq!(
            open.caller(Some(b"whatever")),
            Some(Caller::Unauthenticated)
        );
    }

    #[test]
    fn a_token_is_never_printed() {
        let s = settings(&[("billing", "0123456789abcdef")], false);
        let shown = format!("{s:?}");
        assert!(
            shown.contains("billing") && !shown.contains("digest"),
            "{shown}"
        );
    }
}
