//! A fault proxy for peer links: an HTTP/1.1 relay between two regions' daemons that can
//! delay (with jitter), drop, or cut each direction on its own. One proxy carries the
//! requests of region A to region B (the *request leg*, A→B) and B's answers back (the
//! *response leg*, B→A); legs are shared, so cutting the A→B leg cuts "A→B one way" on
//! every proxy between them (A's requests to B and A's answers to B's requests). A dropped
//! or cut message is never delivered: the connection is closed without an answer, and the
//! sender sees a failed exchange.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng;

/// One direction of a link.
#[derive(Debug, Clone, Default)]
pub struct Leg {
    pub delay: Duration,
    pub jitter: Duration,
    /// Probability that a message is lost.
    pub drop: f64,
    pub cut: bool,
}

pub type LegHandle = Arc<Mutex<Leg>>;

pub struct Proxy {
    pub port: u16,
    target: Arc<AtomicU16>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    /// Relays to 127.0.0.1:`target` (settable later: start proxies before the daemons
    /// whose configs name them).
    pub fn start(request: LegHandle, response: LegHandle) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let target = Arc::new(AtomicU16::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (t, s) = (target.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let (t, req, resp) = (t.clone(), request.clone(), response.clone());
                        std::thread::spawn(move || relay(conn, &t, &req, &resp));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Proxy { port, target, stop }
    }

    pub fn set_target(&self, port: u16) {
        self.target.store(port, Ordering::Relaxed);
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Waits out the leg's delay; false if the message is lost.
fn pass(leg: &LegHandle) -> bool {
    let l = leg.lock().unwrap().clone();
    let mut rng = rand::rng();
    let jitter = if l.jitter.is_zero() {
        Duration::ZERO
    } else {
        l.jitter.mul_f64(rng.random_range(0.0..1.0))
    };
    std::thread::sleep(l.delay + jitter);
    // Cut is read again after the delay: a message in flight when the cut starts is lost.
    !(leg.lock().unwrap().cut || rng.random_bool(l.drop.clamp(0.0, 1.0)))
}

/// Reads one HTTP message head and a Content-Length body.
fn read_message(conn: &mut TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = conn.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = conn.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(buf)
}

/// The request with `Connection: close` (one exchange per connection keeps the relay
/// simple; the daemons' clients reconnect).
fn with_close(msg: &[u8]) -> Vec<u8> {
    let head_end = msg
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(msg.len(), |i| i + 4);
    let head = String::from_utf8_lossy(&msg[..head_end]);
    let mut out = String::new();
    for line in head.split("\r\n").filter(|l| !l.is_empty()) {
        if !line.to_ascii_lowercase().starts_with("connection:") {
            out.push_str(line);
            out.push_str("\r\n");
        }
    }
    out.push_str("connection: close\r\n\r\n");
    let mut v = out.into_bytes();
    v.extend_from_slice(&msg[head_end..]);
    v
}

fn relay(mut conn: TcpStream, target: &AtomicU16, request: &LegHandle, response: &LegHandle) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let Some(req) = read_message(&mut conn) else {
        return;
    };
    if !pass(request) {
        let _ = conn.shutdown(Shutdown::Both);
        return;
    }
    let Ok(mut up) = TcpStream::connect(("127.0.0.1", target.load(Ordering::Relaxed))) else {
        let _ = conn.shutdown(Shutdown::Both);
        return;
    };
    let _ = up.set_read_timeout(Some(Duration::from_secs(10)));
    if up.write_all(&with_close(&req)).is_err() {
        return;
    }
    let mut resp = Vec::new();
    if up.read_to_end(&mut resp).is_err() || resp.is_empty() {
        let _ = conn.shutdown(Shutdown::Both);
        return;
    }
    if !pass(response) {
        let _ = conn.shutdown(Shutdown::Both);
        return;
    }
    let _ = conn.write_all(&with_close(&resp));
    let _ = conn.shutdown(Shutdown::Both);
}
