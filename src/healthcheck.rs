//! `quotad healthcheck`: asks the daemon a config describes for `GET /healthz` and exits 0
//! on `200`, 1 otherwise. It is the container image's `HEALTHCHECK` (the image holds the
//! binary and nothing else: no shell, no curl).
//!
//! One request over a loopback socket with a deadline is written here with `std`: an HTTP
//! client crate would add more to the shipped binary than this whole file, and the
//! listener never speaks TLS.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use quotad_daemon::Endpoint;

/// Connect, send and read each within this; a daemon slower than that is not healthy.
const TIMEOUT: Duration = Duration::from_secs(2);

/// The first bytes of a healthy answer.
const HEALTHY: &[u8] = b"HTTP/1.1 200 ";

#[derive(Debug, thiserror::Error)]
pub enum Unhealthy {
    #[error("cannot reach {0}: {1}")]
    Unreachable(String, std::io::Error),
    #[error("{0} answered {1:?}")]
    Answer(String, String),
}

/// Where to knock for a listener bound to `listen`: an unspecified address (0.0.0.0, ::)
/// is reached on the same family's loopback.
fn target(listen: &Endpoint) -> Endpoint {
    match listen {
        Endpoint::Tcp(a) if a.ip().is_unspecified() => {
            let ip = match a.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            };
            Endpoint::Tcp(SocketAddr::new(ip, a.port()))
        }
        other => other.clone(),
    }
}

/// One `GET /healthz` to the daemon listening on `listen`.
pub fn probe(listen: &Endpoint) -> Result<(), Unhealthy> {
    let to = target(listen);
    let name = to.to_string();
    let unreachable = |e| Unhealthy::Unreachable(name.clone(), e);
    let head = match &to {
        Endpoint::Tcp(addr) => {
            let s = TcpStream::connect_timeout(addr, TIMEOUT).map_err(unreachable)?;
            s.set_read_timeout(Some(TIMEOUT)).map_err(unreachable)?;
            s.set_write_timeout(Some(TIMEOUT)).map_err(unreachable)?;
            exchange(s)
        }
        Endpoint::Unix(path) => {
            let s = UnixStream::connect(path).map_err(unreachable)?;
            s.set_read_timeout(Some(TIMEOUT)).map_err(unreachable)?;
            s.set_write_timeout(Some(TIMEOUT)).map_err(unreachable)?;
            exchange(s)
        }
    }
    .map_err(unreachable)?;
    if head.starts_with(HEALTHY) {
        Ok(())
    } else {
        let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
        Err(Unhealthy::Answer(
            name,
            String::from_utf8_lossy(line).into_owned(),
        ))
    }
}

/// Sends the request and returns the answer's first bytes (its status line).
fn exchange(mut s: impl Read + Write) -> std::io::Result<Vec<u8>> {
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
    let mut head = vec![0u8; 64];
    let mut filled = 0;
    while filled < head.len() {
        match s.read(&mut head[filled..])? {
            0 => break,
            n => filled += n,
        }
        if head[..filled].contains(&b'\n') {
            break;
        }
    }
    head.truncate(filled);
    Ok(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unspecified_address_is_reached_on_loopback() {
        let any = Endpoint::parse("0.0.0.0:8686").unwrap();
        assert_eq!(target(&any).to_string(), "127.0.0.1:8686");
        let any6 = Endpoint::parse("[::]:8686").unwrap();
        assert_eq!(target(&any6).to_string(), "[::1]:8686");
        let unix = Endpoint::parse("unix:/run/q.sock").unwrap();
        assert_eq!(target(&unix).to_string(), "unix:/run/q.sock");
    }

    #[test]
    fn a_closed_port_is_unhealthy() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let e = probe(&Endpoint::Tcp(addr)).unwrap_err();
        assert!(matches!(e, Unhealthy::Unreachable(..)), "{e}");
    }
}
