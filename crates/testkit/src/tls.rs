//! A redis-server that speaks only TLS, with a CA and a server certificate generated for
//! the test by the `openssl` command (no OpenSSL in any build: the files are data), plus a
//! second, unrelated CA for tests of an untrusted server. Killed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{free_port, wait_for};

pub struct TlsRedis {
    pub port: u16,
    /// The CA that signed the server's certificate.
    pub ca: PathBuf,
    /// A CA that signed nothing the server presents.
    pub untrusted_ca: PathBuf,
    /// With [`TlsRedis::start_mutual`]: a client certificate and key signed by `ca`, which
    /// the server then requires of every client.
    pub client: Option<(PathBuf, PathBuf)>,
    child: Child,
    dir: tempfile::TempDir,
}

/// Runs `openssl` with `args` in `dir`, panicking with its output if it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl (Debian package openssl) is needed for TLS tests");
    assert!(
        out.status.success(),
        "openssl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A self-signed CA `<name>.crt` / `<name>.key`.
fn ca(dir: &Path, name: &str) {
    let (key, crt) = (format!("{name}.key"), format!("{name}.crt"));
    openssl(dir, &["genrsa", "-out", &key, "2048"]);
    let subject = format!("/CN=quotad test {name}");
    openssl(
        dir,
        &[
            "req", "-x509", "-new", "-key", &key, "-days", "2", "-subj", &subject, "-out", &crt,
        ],
    );
}

/// `client.crt` / `client.key`, signed by `ca`, for TLS client authentication.
fn client_cert(dir: &Path, ca: &str) {
    std::fs::write(dir.join("client.cnf"), "extendedKeyUsage=clientAuth\n")
        .expect("write client.cnf");
    openssl(dir, &["genrsa", "-out", "client.key", "2048"]);
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-key",
            "client.key",
            "-subj",
            "/CN=quotad",
            "-out",
            "client.csr",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "client.csr",
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "client.cnf",
            "-out",
            "client.crt",
        ],
    );
}

/// `server.crt` / `server.key` for 127.0.0.1 and localhost, signed by `ca`.
fn server_cert(dir: &Path, ca: &str) {
    std::fs::write(
        dir.join("san.cnf"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .expect("write san.cnf");
    openssl(dir, &["genrsa", "-out", "server.key", "2048"]);
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-key",
            "server.key",
            "-subj",
            "/CN=localhost",
            "-out",
            "server.csr",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.cnf",
            "-out",
            "server.crt",
        ],
    );
}

impl TlsRedis {
    pub fn start() -> TlsRedis {
        Self::start_with(false)
    }

    /// A server that requires a client certificate signed by `ca` (mutual TLS); the
    /// certificate and key are in `client`.
    pub fn start_mutual() -> TlsRedis {
        Self::start_with(true)
    }

    fn start_with(mutual: bool) -> TlsRedis {
        let dir = tempfile::tempdir().expect("tempdir");
        ca(dir.path(), "ca");
        ca(dir.path(), "untrusted");
        server_cert(dir.path(), "ca");
        if mutual {
            client_cert(dir.path(), "ca");
        }
        let port = free_port();
        let p = |f: &str| dir.path().join(f);
        let child = Command::new(crate::redis_server_path())
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--tls-cert-file")
            .arg(p("server.crt"))
            .arg("--tls-key-file")
            .arg(p("server.key"))
            .arg("--tls-ca-cert-file")
            .arg(p("ca.crt"))
            .args(["--tls-auth-clients", if mutual { "yes" } else { "no" }])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server with TLS");
        let server = TlsRedis {
            port,
            ca: p("ca.crt"),
            untrusted_ca: p("untrusted.crt"),
            client: mutual.then(|| (p("client.crt"), p("client.key"))),
            child,
            dir,
        };
        wait_for(
            "the TLS redis-server to answer",
            Duration::from_secs(10),
            || server.ping(&server.ca).then_some(()),
        );
        server
    }

    /// `rediss://` URL of the server.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.port)
    }

    /// Whether a PING over TLS, trusting only `ca`, gets PONG (redis-cli, so this proves
    /// the server, not quotad's client). Presents the client certificate when there is one.
    pub fn ping(&self, ca: &Path) -> bool {
        let mut cmd = Command::new("redis-cli");
        cmd.args(["--tls", "--cacert"]).arg(ca);
        if let Some((cert, key)) = &self.client {
            cmd.arg("--cert").arg(cert).arg("--key").arg(key);
        }
        cmd.args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "PING"])
            .stderr(Stdio::null())
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
    }

    /// The directory holding the certificates.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
