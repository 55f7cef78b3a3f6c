//! `[server]`: the HTTP listener, its drain on shutdown, and what one request or connection
//! may hold.

use std::net::SocketAddr;
use std::time::Duration;

use toml::Spanned;

use super::{Validator, raw};
use crate::server::Endpoint;

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ServerSettings {
    /// An address and port, or a Unix socket (`unix:/path`) for a sidecar on the host.
    pub(crate) listen: Endpoint,
    /// The Envoy rate-limit service's gRPC listener (`api::grpc`), an address or a Unix
    /// socket; none when absent.
    pub(crate) grpc_listen: Option<Endpoint>,
    /// Connections the gRPC listener keeps open at once, apart from `max_connections`
    /// (Envoy holds a few long-lived ones per proxy; an HTTP flood must not starve them).
    pub(crate) grpc_max_connections: usize,
    pub(crate) drain_timeout: Duration,
    /// Time between readiness turning 503 and the listener closing.
    pub(crate) shutdown_delay: Duration,
    pub(crate) max_body_bytes: usize,
    pub(crate) max_batch: usize,
    pub(crate) max_key_bytes: usize,
    /// `None`: sized at start-up from the open-files limit
    /// ([`crate::server::default_max_connections`]).
    pub(crate) max_connections: Option<usize>,
    pub(crate) max_header_bytes: usize,
    /// From accept (or a request's first byte) to the end of its headers.
    pub(crate) header_timeout: Duration,
    /// From the end of the headers to the end of the body.
    pub(crate) body_timeout: Duration,
    /// A keep-alive connection with no request in progress.
    pub(crate) idle_timeout: Duration,
    /// `/readyz` also fails while the store is unusable (default: only while draining).
    pub(crate) ready_requires_store: bool,
    /// Bytes that request bodies being read may hold together (503 beyond).
    pub(crate) max_body_memory: usize,
}

impl ServerSettings {
    /// The defaults of `[server]`.
    pub(crate) fn defaults() -> Self {
        ServerSettings {
            listen: Endpoint::Tcp(default_listen()),
            grpc_listen: None,
            grpc_max_connections: DEFAULT_GRPC_MAX_CONNECTIONS as usize,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            shutdown_delay: default_shutdown_delay(DEFAULT_DRAIN_TIMEOUT),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES as usize,
            max_batch: DEFAULT_MAX_BATCH as usize,
            max_key_bytes: DEFAULT_MAX_KEY_BYTES as usize,
            max_connections: None,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES as usize,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            ready_requires_store: false,
            max_body_memory: DEFAULT_MAX_BODY_MEMORY as usize,
        }
    }
}

/// `shutdown_delay` when the file does not set it: 5 s (time for load balancers and
/// kube-proxy to drop the instance after readiness fails), at most half the drain timeout.
pub(crate) fn default_shutdown_delay(drain_timeout: Duration) -> Duration {
    DEFAULT_SHUTDOWN_DELAY.min(drain_timeout / 2)
}

fn default_listen() -> SocketAddr {
    DEFAULT_LISTEN.parse().expect("valid default address")
}

pub(crate) const DEFAULT_LISTEN: &str = "127.0.0.1:8686";
pub(crate) const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
pub(crate) const DEFAULT_MAX_BODY_BYTES: i64 = 64 * 1024;
pub(crate) const DEFAULT_MAX_BATCH: i64 = 64;
/// Envoy opens about one HTTP/2 connection per worker thread to its rate-limit cluster:
/// 1,024 serve a hundred 8-worker proxies with room to spare.
pub(super) const DEFAULT_GRPC_MAX_CONNECTIONS: i64 = 1024;
pub(crate) const DEFAULT_MAX_KEY_BYTES: i64 = 512;
pub(crate) const DEFAULT_SHUTDOWN_DELAY: Duration = Duration::from_secs(5);
/// Request headers (request line included): 431 beyond. nginx holds 8 KiB per line;
/// quotad's requests carry a few hundred bytes, and a connection dribbling headers holds a
/// read buffer of this size.
pub(crate) const DEFAULT_MAX_HEADER_BYTES: i64 = 8 * 1024;
/// Request bodies being read, together: 1,024 full 64 KiB bodies. Normal checks carry a few
/// hundred bytes; this is what slow or hostile senders can pin.
pub(crate) const DEFAULT_MAX_BODY_MEMORY: i64 = 64 << 20;
/// Long enough for any client on a slow link to send a few hundred bytes of headers; short
/// enough that a slowloris holds a connection for seconds, not forever.
pub(crate) const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
pub(crate) const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// Above the idle timeouts of common client pools and load balancers (AWS ALB 60 s), so
/// that it is they who close an idle connection, never quotad under a request in flight.
pub(crate) const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(75);

impl Validator<'_> {
    /// `[server]`, checked in the order of its fields (errors on one line keep that order);
    /// the shutdown delay is compared with the drain timeout last, once both are known.
    pub(super) fn server(&mut self, s: raw::Server) -> ServerSettings {
        let listen = self.listen(s.listen.as_ref());
        let grpc_listen = self.grpc_listen(s.grpc_listen.as_ref(), &listen);
        let (drain_timeout, shutdown_delay) = self.shutdown_timings(&s);
        let mut settings = ServerSettings {
            listen,
            grpc_listen,
            drain_timeout,
            shutdown_delay,
            ..ServerSettings::defaults()
        };
        self.request_limits(&s, &mut settings);
        self.client_timeouts(&s, &mut settings);
        settings.ready_requires_store = s.ready_requires_store.unwrap_or(false);
        settings.max_body_memory = self.integer(
            s.max_body_memory.as_ref(),
            "server.max_body_memory",
            DEFAULT_MAX_BODY_MEMORY,
            64 * 1024,
            1 << 34,
        ) as usize;
        self.shutdown_before_drain(s.shutdown_delay.as_ref(), &settings);
        settings
    }

    /// `listen`: parsed here so that a typo is a config error, not a failed bind at start-up.
    fn listen(&mut self, listen: Option<&Spanned<String>>) -> Endpoint {
        let Some(l) = listen else {
            return Endpoint::Tcp(default_listen());
        };
        Endpoint::parse(l.get_ref()).unwrap_or_else(|why| {
            self.error(l, "server.listen", why);
            Endpoint::Tcp(default_listen())
        })
    }

    /// `grpc_listen`: an endpoint like `listen`, and not the same one.
    fn grpc_listen(
        &mut self,
        value: Option<&Spanned<String>>,
        http: &Endpoint,
    ) -> Option<Endpoint> {
        let v = value?;
        match Endpoint::parse(v.get_ref()) {
            Ok(a) if &a == http => {
                let why = format!(
                    "is server.listen ({http}) too; the gRPC listener needs its own port or socket"
                );
                self.error(v, "server.grpc_listen", why);
                None
            }
            Ok(a) => Some(a),
            Err(why) => {
                self.error(v, "server.grpc_listen", why);
                None
            }
        }
    }

    /// `drain_timeout` and `shutdown_delay`: the delay's default depends on the drain.
    fn shutdown_timings(&mut self, s: &raw::Server) -> (Duration, Duration) {
        let drain_timeout = self.duration(
            s.drain_timeout.as_ref(),
            "server.drain_timeout",
            DEFAULT_DRAIN_TIMEOUT,
            Duration::from_millis(1),
            Duration::from_secs(600),
        );
        let shutdown_delay = self.duration(
            s.shutdown_delay.as_ref(),
            "server.shutdown_delay",
            default_shutdown_delay(drain_timeout),
            Duration::ZERO,
            Duration::from_secs(600),
        );
        (drain_timeout, shutdown_delay)
    }

    /// The sizes one request or connection may take: body, batch, key, headers, and how many
    /// connections are open at once.
    fn request_limits(&mut self, s: &raw::Server, settings: &mut ServerSettings) {
        settings.max_body_bytes = self.integer(
            s.max_body_bytes.as_ref(),
            "server.max_body_bytes",
            DEFAULT_MAX_BODY_BYTES,
            256,
            16 << 20,
        ) as usize;
        settings.max_batch = self.integer(
            s.max_batch.as_ref(),
            "server.max_batch",
            DEFAULT_MAX_BATCH,
            1,
            1024,
        ) as usize;
        settings.max_key_bytes = self.integer(
            s.max_key_bytes.as_ref(),
            "server.max_key_bytes",
            DEFAULT_MAX_KEY_BYTES,
            1,
            8192,
        ) as usize;
        settings.max_connections = s.max_connections.as_ref().map(|m| {
            self.integer(Some(m), "server.max_connections", 10_000, 1, 1_000_000) as usize
        });
        settings.grpc_max_connections = self.integer(
            s.grpc_max_connections.as_ref(),
            "server.grpc_max_connections",
            DEFAULT_GRPC_MAX_CONNECTIONS,
            1,
            1_000_000,
        ) as usize;
        settings.max_header_bytes = self.integer(
            s.max_header_bytes.as_ref(),
            "server.max_header_bytes",
            DEFAULT_MAX_HEADER_BYTES,
            1024,
            1 << 20,
        ) as usize;
    }

    /// The deadlines that bound how long a slow or idle client holds a connection.
    fn client_timeouts(&mut self, s: &raw::Server, settings: &mut ServerSettings) {
        settings.header_timeout = self.client_timeout(
            s.header_timeout.as_ref(),
            "server.header_timeout",
            DEFAULT_HEADER_TIMEOUT,
        );
        settings.body_timeout = self.client_timeout(
            s.body_timeout.as_ref(),
            "server.body_timeout",
            DEFAULT_BODY_TIMEOUT,
        );
        settings.idle_timeout = self.client_timeout(
            s.idle_timeout.as_ref(),
            "server.idle_timeout",
            DEFAULT_IDLE_TIMEOUT,
        );
    }

    /// One of the client timeouts, which share their bounds.
    fn client_timeout(
        &mut self,
        value: Option<&Spanned<String>>,
        field: &str,
        default: Duration,
    ) -> Duration {
        self.duration(
            value,
            field,
            default,
            Duration::from_millis(10),
            Duration::from_secs(3600),
        )
    }

    /// The drain deadline counts from the signal: a delay as long leaves no time to drain.
    /// Only a delay the file sets can be wrong (the default is half the drain at most).
    fn shutdown_before_drain(&mut self, delay: Option<&Spanned<String>>, s: &ServerSettings) {
        let Some(d) = delay else { return };
        if s.shutdown_delay >= s.drain_timeout {
            self.error(
                d,
                "server.shutdown_delay",
                format!(
                    "must be shorter than server.drain_timeout ({}), which counts from the signal",
                    humantime::format_duration(s.drain_timeout)
                ),
            );
        }
    }
}
