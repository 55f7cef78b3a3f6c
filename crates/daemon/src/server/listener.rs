//! Where quotad listens: a TCP address, or a Unix domain socket for a sidecar on the same
//! host (`listen = "unix:/run/quotad/quotad.sock"`). Every listener (the HTTP API, the
//! gRPC service) is bound here and hands out [`Stream`]s, so the server's bounds and
//! deadlines apply to a connection whatever carries it.
//!
//! A Unix socket's file is created at bind and removed when the listener is dropped. A
//! file already at the path is replaced only if it is a socket nobody answers on (left by
//! a process that died); a live one is an error ("in use"), as a bound TCP port is.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

/// The prefix of a Unix socket's path in `listen` and `grpc_listen`.
pub(crate) const UNIX_PREFIX: &str = "unix:";

/// Where a listener listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A TCP address.
    Tcp(SocketAddr),
    /// An absolute path.
    Unix(PathBuf),
}

impl Endpoint {
    /// `"127.0.0.1:8686"`, `"[::1]:8686"` or `"unix:/absolute/path"`; the error says
    /// what is expected.
    pub fn parse(s: &str) -> Result<Endpoint, EndpointError> {
        match s.strip_prefix(UNIX_PREFIX) {
            Some(path) if Path::new(path).is_absolute() => Ok(Endpoint::Unix(path.into())),
            Some(_) => Err(EndpointError::RelativeSocketPath),
            None => s
                .parse()
                .map(Endpoint::Tcp)
                .map_err(|_| EndpointError::NotAnEndpoint),
        }
    }
}

/// Why a listen address does not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("a Unix socket needs an absolute path, e.g. \"unix:/run/quotad/quotad.sock\"")]
    RelativeSocketPath,
    #[error(
        "must be an IP address and port (\"127.0.0.1:8686\") or a Unix socket (\"unix:/run/quotad/quotad.sock\")"
    )]
    NotAnEndpoint,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(a) => write!(f, "{a}"),
            Endpoint::Unix(p) => write!(f, "{UNIX_PREFIX}{}", p.display()),
        }
    }
}

/// A bound listener.
pub enum Listener {
    /// A TCP listener.
    Tcp(TcpListener),
    /// A Unix socket listener and the file it removes when dropped.
    Unix(UnixListener, SocketFile),
}

impl From<TcpListener> for Listener {
    fn from(l: TcpListener) -> Self {
        Listener::Tcp(l)
    }
}

impl Listener {
    /// Binds `endpoint` with a deep `backlog`: a TCP address with address reuse (a
    /// restart need not wait out TIME_WAIT); a Unix socket as the module doc says.
    pub(crate) fn bind(endpoint: &Endpoint, backlog: u32) -> io::Result<Listener> {
        match endpoint {
            Endpoint::Tcp(addr) => bind_tcp(*addr, backlog).map(Listener::Tcp),
            Endpoint::Unix(path) => {
                clear_stale(path)?;
                let socket = tokio::net::UnixSocket::new_stream()?;
                socket.bind(path)?;
                let listener = socket.listen(backlog)?;
                Ok(Listener::Unix(listener, SocketFile(path.clone())))
            }
        }
    }

    pub(crate) async fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept().await?;
                // Answers are small and leave at once: no Nagle delay.
                let _ = s.set_nodelay(true);
                Ok(Stream::Tcp(s))
            }
            Listener::Unix(l, _) => Ok(Stream::Unix(l.accept().await?.0)),
        }
    }

    /// Where it listens (a port 0 resolved).
    pub(crate) fn endpoint(&self) -> io::Result<Endpoint> {
        match self {
            Listener::Tcp(l) => l.local_addr().map(Endpoint::Tcp),
            Listener::Unix(_, f) => Ok(Endpoint::Unix(f.0.clone())),
        }
    }
}

/// A TCP listening socket on `addr` with address reuse and `backlog`.
fn bind_tcp(addr: SocketAddr, backlog: u32) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// Removes a socket file left at `path` by a process that is gone; refuses a live one and
/// anything that is not a socket.
fn clear_stale(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(()); // nothing there
    };
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        ));
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("{} is in use by a running process", path.display()),
        ));
    }
    std::fs::remove_file(path)
}

/// A Unix socket's file, removed when its listener is dropped.
pub struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// An accepted connection.
pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Waits for the first byte (a connection gets no protocol state until then): `Ok(n)`
    /// with `n > 0` once there is something to read, `Ok(0)` at end of stream. On a Unix
    /// stream (tokio has no peek there) readiness stands for the byte, end of stream
    /// included, which the protocol then reads as such.
    pub(crate) async fn first_byte(&self) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.peek(&mut [0u8; 1]).await,
            Stream::Unix(s) => s.readable().await.map(|()| 1),
        }
    }
}

macro_rules! both {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            Stream::Tcp($s) => $e,
            Stream::Unix($s) => $e,
        }
    };
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        both!(self, s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        both!(self, s => Pin::new(s).poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        both!(self, s => Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        both!(self, s => Pin::new(s).poll_shutdown(cx))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        both!(self, s => Pin::new(s).poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Tcp(s) => s.is_write_vectored(),
            Stream::Unix(s) => s.is_write_vectored(),
        }
    }
}

/// `AsyncWrite` for a connection wrapper `$t` that only watches reads: every write goes
/// straight to its `$field` (a [`Stream`]).
macro_rules! writes_through {
    ($t:ty, $field:ident) => {
        impl tokio::io::AsyncWrite for $t {
            fn poll_write(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.$field).poll_write(cx, buf)
            }

            fn poll_flush(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.$field).poll_flush(cx)
            }

            fn poll_shutdown(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.$field).poll_shutdown(cx)
            }

            fn poll_write_vectored(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.$field).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.$field.is_write_vectored()
            }
        }
    };
}
pub(crate) use writes_through;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_as_addresses_or_absolute_socket_paths() {
        assert_eq!(
            Endpoint::parse("127.0.0.1:8686"),
            Ok(Endpoint::Tcp("127.0.0.1:8686".parse().unwrap()))
        );
        assert_eq!(
            Endpoint::parse("unix:/run/q.sock"),
            Ok(Endpoint::Unix("/run/q.sock".into()))
        );
        assert_eq!(
            Endpoint::parse("unix:q.sock"),
            Err(EndpointError::RelativeSocketPath)
        );
        assert!(
            EndpointError::RelativeSocketPath
                .to_string()
                .contains("absolute")
        );
        assert_eq!(
            Endpoint::parse("localhost:80"),
            Err(EndpointError::NotAnEndpoint)
        );
        assert_eq!(Endpoint::Unix("/a".into()).to_string(), "unix:/a");
    }

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_a_live_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.sock");
        let at = Endpoint::Unix(path.clone());
        let live = Listener::bind(&at, 16).unwrap();
        let err = Listener::bind(&at, 16).err().expect("in use");
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{err}");
        // A socket file whose process died: std's listener leaves its file behind.
        drop(live);
        let orphan = std::os::unix::net::UnixListener::bind(&path).unwrap();
        drop(orphan);
        assert!(path.exists());
        let again = Listener::bind(&at, 16).expect("a stale socket is replaced");
        drop(again);
        assert!(!path.exists(), "removed with its listener");
        std::fs::write(&path, "not a socket").unwrap();
        assert!(Listener::bind(&at, 16).is_err());
    }
}
