//! Where a secret comes from. Every secret field `X` (`store.password`,
//! `coordinator.secret`, `peer.secret`) has two siblings, and at most one of the three may
//! be set:
//!
//! - `X = "..."`: in the config file itself;
//! - `X_file = "/run/secrets/..."`: the whole content of a file (a mounted Kubernetes
//!   Secret, a systemd credential), one trailing newline dropped; relative to the config
//!   file; read at start and at every reload, so the config can live in a ConfigMap and
//!   the secret apart from it;
//! - `X_env = "NAME"`: an environment variable, read at start (a process's environment
//!   does not change, so a reload reads the same value).
//!
//! Named fields rather than one general `${...}` expansion: a value in the file can never
//! be read as a reference by accident, the error names the exact key that failed, and
//! `quotad validate` checks the three the same way. Error messages name the file or the
//! variable, never the value.

use std::io::Read;
use std::path::Path;

use toml::Spanned;

use super::Validator;

/// The largest secret file read: a password or an HMAC key, not a file that happens to be
/// mounted at the wrong path.
pub(super) const MAX_SECRET_FILE_BYTES: u64 = 64 * 1024;

/// The three places a secret field `X` may be given.
pub(super) struct Sources<'a> {
    pub(super) inline: Option<&'a Spanned<String>>,
    pub(super) file: Option<&'a Spanned<String>>,
    pub(super) env: Option<&'a Spanned<String>>,
}

impl<'a> Sources<'a> {
    /// Whether any of the three is set.
    pub(super) fn any(&self) -> bool {
        self.inline.is_some() || self.file.is_some() || self.env.is_some()
    }

    /// Each of the three that is set, with its key's name.
    pub(super) fn keys(&self, field: &str) -> Vec<(&'a Spanned<String>, String)> {
        [
            (self.inline, field.to_owned()),
            (self.file, format!("{field}_file")),
            (self.env, format!("{field}_env")),
        ]
        .into_iter()
        .filter_map(|(v, name)| v.map(|v| (v, name)))
        .collect()
    }
}

/// A secret read from where the config said, with the key that said so (for errors the
/// caller finds later, such as a secret too short).
pub(super) struct Resolved<'a> {
    pub(super) bytes: Vec<u8>,
    pub(super) at: &'a Spanned<String>,
    pub(super) field: String,
}

impl Validator<'_> {
    /// The secret `field` (e.g. `store.password`) from whichever of `field`, `field_file`
    /// and `field_env` is set; `None` when none is, or with an error recorded. A file read
    /// is remembered in `secret_files` (the reload watcher looks at them too).
    pub(super) fn secret<'a>(
        &mut self,
        field: &str,
        sources: &Sources<'a>,
    ) -> Option<Resolved<'a>> {
        let keys = sources.keys(field);
        if keys.len() > 1 {
            let names: Vec<&str> = keys.iter().map(|(_, n)| n.as_str()).collect();
            let (at, name) = &keys[1];
            self.error(at, name, format!("set only one of {}", names.join(", ")));
            return None;
        }
        let (at, name) = keys.into_iter().next()?;
        let bytes = if sources.inline.is_some() {
            Some(at.get_ref().as_bytes().to_vec())
        } else if sources.file.is_some() {
            let path = Path::new(self.file)
                .parent()
                .unwrap_or(Path::new("."))
                .join(at.get_ref());
            let read = read_secret_file(&path);
            self.secret_files.push(path.clone());
            match read {
                Ok(b) => Some(b),
                Err(why) => {
                    self.error(at, &name, format!("{}: {why}", path.display()));
                    None
                }
            }
        } else {
            match std::env::var_os(at.get_ref()) {
                _ if at.get_ref().is_empty() || at.get_ref().contains(['=', '\0']) => {
                    self.error(at, &name, "must be the name of an environment variable");
                    None
                }
                Some(v) => Some(v.into_encoded_bytes()),
                None => {
                    self.error(
                        at,
                        &name,
                        format!("the environment variable {} is not set", at.get_ref()),
                    );
                    None
                }
            }
        }?;
        if bytes.is_empty() {
            self.error(at, &name, "the secret is empty");
            return None;
        }
        Some(Resolved {
            bytes,
            at,
            field: name,
        })
    }

    /// [`Validator::secret`] for a value Redis takes as a string.
    pub(super) fn secret_text(&mut self, field: &str, sources: &Sources<'_>) -> Option<String> {
        let r = self.secret(field, sources)?;
        match String::from_utf8(r.bytes) {
            Ok(s) => Some(s),
            Err(_) => {
                self.error(r.at, &r.field, "the secret is not UTF-8 text");
                None
            }
        }
    }
}

/// A secret file's content without one trailing newline (`echo pw > file` writes one;
/// `kubectl create secret --from-literal` does not).
fn read_secret_file(path: &Path) -> Result<Vec<u8>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read: {e}"))?;
    let mut bytes = Vec::new();
    file.take(MAX_SECRET_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > MAX_SECRET_FILE_BYTES {
        return Err(format!(
            "larger than {MAX_SECRET_FILE_BYTES} bytes: not a secret"
        ));
    }
    if bytes.ends_with(b"\n") {
        bytes.pop();
        if bytes.ends_with(b"\r") {
            bytes.pop();
        }
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Settings, StoreBackend};

    /// `text` saved as quotad.toml in a new directory, beside a file `pw` holding `pw`.
    fn load(text: &str, pw: &[u8]) -> (tempfile::TempDir, Settings) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pw"), pw).unwrap();
        std::fs::write(dir.path().join("quotad.toml"), text).unwrap();
        let s = Settings::load(&dir.path().join("quotad.toml")).unwrap();
        (dir, s)
    }

    const POLICY: &str =
        "[[policy]]\nname = \"g\"\nalgorithm = \"token_bucket\"\nlimit = 10\nwindow = \"1s\"\n";

    fn password(s: &Settings) -> Option<String> {
        match &s.store {
            StoreBackend::Redis(r) => r.target.password.clone(),
            _ => None,
        }
    }

    #[test]
    fn a_password_file_beside_the_config_is_read_and_watched() {
        let text = format!(
            "[store]\nredis = \"redis://127.0.0.1:6379\"\npassword_file = \"pw\"\n{POLICY}"
        );
        let (dir, s) = load(&text, b"from-the-file\n");
        assert_eq!(password(&s).as_deref(), Some("from-the-file"));
        assert_eq!(s.secret_files, [dir.path().join("pw")]);
    }

    #[test]
    fn a_password_from_the_environment_is_its_value() {
        let text = format!(
            "[store]\nredis = \"redis://127.0.0.1:6379\"\npassword_env = \"PATH\"\n{POLICY}"
        );
        let (_dir, s) = load(&text, b"");
        assert_eq!(password(&s), std::env::var("PATH").ok());
        assert!(s.secret_files.is_empty());
    }

    #[test]
    fn peers_take_their_secret_from_a_file_or_the_coordinators() {
        let text = format!(
            "region = \"eu\"\n[coordinator]\nsecret_env = \"PATH\"\n\
             [[peer]]\nregion = \"us\"\nurl = \"http://127.0.0.1:9000\"\nsecret_file = \"pw\"\n\
             [[peer]]\nregion = \"ap\"\nurl = \"http://127.0.0.1:9001\"\n\
             {POLICY}[policy.global]\nescrow = {{ eu = 1, us = 1, ap = 1 }}\n"
        );
        let (_dir, s) = load(&text, b"a-peer-secret-of-32-bytes-length\n");
        let g = s.global.expect("global");
        let secret = |region: &str| {
            g.peers
                .iter()
                .find(|p| p.region == region)
                .map(|p| p.secret.0.clone())
                .unwrap()
        };
        assert_eq!(secret("us"), b"a-peer-secret-of-32-bytes-length");
        assert_eq!(secret("ap"), std::env::var("PATH").unwrap().into_bytes());
    }

    #[test]
    fn one_trailing_newline_is_not_part_of_the_secret() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s");
        for (content, want) in [
            (&b"pw\n"[..], &b"pw"[..]),
            (b"pw\r\n", b"pw"),
            (b"pw", b"pw"),
            (b"pw\n\n", b"pw\n"),
            (b" pw ", b" pw "),
        ] {
            std::fs::write(&p, content).unwrap();
            assert_eq!(read_secret_file(&p).unwrap(), want, "{content:?}");
        }
    }

    #[test]
    fn a_file_larger_than_a_secret_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big");
        std::fs::write(&p, vec![b'x'; MAX_SECRET_FILE_BYTES as usize + 1]).unwrap();
        assert!(read_secret_file(&p).unwrap_err().contains("larger than"));
    }
}
