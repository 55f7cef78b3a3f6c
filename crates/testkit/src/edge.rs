//! The proxies a team puts in front of its services, with quotad as their forward-auth:
//! Debian's nginx (`auth_request`) and Caddy (`forward_auth`), each started on free loopback
//! ports with its own files in a temporary directory, in front of a tiny upstream that
//! answers `200 upstream`, and killed on drop.

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{free_port, wait_for};

/// What the upstream answers, so a test can tell it reached it.
pub const UPSTREAM_BODY: &str = "upstream";

/// A proxy process on `port`.
pub struct Edge {
    pub port: u16,
    child: Child,
    pub dir: tempfile::TempDir,
}

impl Drop for Edge {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn started(child: Child, port: u16, dir: tempfile::TempDir, what: &str) -> Edge {
    let edge = Edge { port, child, dir };
    wait_for(
        &format!("{what} to listen"),
        Duration::from_secs(15),
        || TcpStream::connect(("127.0.0.1", port)).ok(),
    );
    edge
}

impl Edge {
    /// nginx in front of its own upstream: every request first goes to
    /// `http://127.0.0.1:{quotad}/v1/authz/{policy}` (`auth_request`); a 403 from quotad
    /// becomes a 429 with quotad's `Retry-After` and `RateLimit` at the client (nginx's
    /// `auth_request` passes on only 2xx, 401 and 403).
    pub fn nginx(quotad: u16, policy: &str) -> Edge {
        let dir = tempfile::tempdir().expect("tempdir");
        let (port, up) = (free_port(), free_port());
        let d = dir.path().display();
        let conf = format!(
            r#"worker_processes 1;
daemon off;
master_process off;
error_log {d}/error.log warn;
pid {d}/nginx.pid;
events {{ worker_connections 64; }}
http {{
  access_log off;
  client_body_temp_path {d}/body;
  proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fastcgi;
  uwsgi_temp_path {d}/uwsgi;
  scgi_temp_path {d}/scgi;
  server {{
    listen 127.0.0.1:{up};
    location / {{ return 200 "{UPSTREAM_BODY}"; }}
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      auth_request /_quotad;
      auth_request_set $quotad_retry $upstream_http_retry_after;
      auth_request_set $quotad_ratelimit $upstream_http_ratelimit;
      error_page 403 = @limited;
      proxy_pass http://127.0.0.1:{up};
    }}
    location = /_quotad {{
      internal;
      proxy_pass http://127.0.0.1:{quotad}/v1/authz/{policy};
      proxy_pass_request_body off;
      proxy_set_header Content-Length "";
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
    }}
    location @limited {{
      add_header Retry-After $quotad_retry always;
      add_header RateLimit $quotad_ratelimit always;
      return 429;
    }}
  }}
}}
"#
        );
        std::fs::write(dir.path().join("nginx.conf"), conf).expect("write nginx.conf");
        let child = Command::new("nginx")
            .arg("-p")
            .arg(dir.path())
            .arg("-c")
            .arg(dir.path().join("nginx.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx (Debian package nginx) is needed");
        started(child, port, dir, "nginx")
    }

    /// Caddy in front of its own upstream, with `forward_auth` to
    /// `http://127.0.0.1:{quotad}/v1/authz/{policy}`: a non-2xx answer from quotad goes
    /// to the client as it is (status, `Retry-After`, `RateLimit`).
    pub fn caddy(quotad: u16, policy: &str) -> Edge {
        let dir = tempfile::tempdir().expect("tempdir");
        let (port, up) = (free_port(), free_port());
        let conf = format!(
            r#"{{
  admin off
  auto_https off
}}
http://127.0.0.1:{up} {{
  respond "{UPSTREAM_BODY}" 200
}}
http://127.0.0.1:{port} {{
  forward_auth 127.0.0.1:{quotad} {{
    uri /v1/authz/{policy}
  }}
  reverse_proxy 127.0.0.1:{up}
}}
"#
        );
        let file = dir.path().join("Caddyfile");
        std::fs::write(&file, conf).expect("write Caddyfile");
        let child = Command::new("caddy")
            .args(["run", "--adapter", "caddyfile", "--config"])
            .arg(&file)
            .env("XDG_CONFIG_HOME", dir.path())
            .env("XDG_DATA_HOME", dir.path())
            .env("HOME", dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("caddy (Debian package caddy) is needed");
        started(child, port, dir, "caddy")
    }
}
