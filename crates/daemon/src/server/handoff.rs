//! Connections handed to a protocol library that runs its own connection loop (tonic, for
//! the gRPC service), with the server's bounds around them: a slot per connection (beyond
//! the bound, connects wait in the kernel's backlog), a deadline for the first bytes the
//! protocol needs, and the same per-listener metrics as the HTTP listener
//! (`quotad_connections_open{listener}`, `quotad_connections_closed_total{listener,reason}`,
//! `quotad_accept_errors_total{listener}`).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{Closed, Listener, ListenerMetrics, Stream};

/// What a handed-off connection is held to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Handoff {
    /// Connections open at once: a slot is taken before `accept`.
    pub(crate) max_connections: usize,
    /// Bytes a connection must send (HTTP/2: its preface) within `first_bytes_timeout` of
    /// the accept, or be closed (counted as `header_timeout`): a silent or dribbling socket
    /// holds its slot for seconds, as on the HTTP listener.
    pub(crate) first_bytes: usize,
    pub(crate) first_bytes_timeout: Duration,
}

/// Accepted connections as a stream for the protocol library, at most
/// `handoff.max_connections` open at once.
pub(crate) fn incoming(
    listener: Listener,
    handoff: Handoff,
    metrics: ListenerMetrics,
) -> impl futures_util::Stream<Item = io::Result<Handed>> {
    let permits = Arc::new(Semaphore::new(handoff.max_connections.max(1)));
    let state = (listener, permits, metrics);
    futures_util::stream::unfold(state, move |(listener, permits, metrics)| async move {
        let permit = permits.clone().acquire_owned().await.ok()?;
        let accepted = match listener.accept().await {
            Ok(stream) => {
                metrics.open.inc();
                let deadline = tokio::time::sleep(handoff.first_bytes_timeout);
                Ok(Handed {
                    stream,
                    _permit: permit,
                    first: Some((handoff.first_bytes, Box::pin(deadline))),
                    metrics: metrics.clone(),
                })
            }
            Err(e) => {
                metrics.accept_errors.inc();
                // Out of file descriptors, most likely: give closing connections a moment
                // rather than spin on accept.
                tokio::time::sleep(Duration::from_millis(50)).await;
                Err(e)
            }
        };
        Some((accepted, (listener, permits, metrics)))
    })
}

/// A connection holding its slot until it closes.
pub(crate) struct Handed {
    stream: Stream,
    _permit: OwnedSemaphorePermit,
    /// Until its first bytes are in: how many are still due, and the deadline.
    first: Option<(usize, Pin<Box<tokio::time::Sleep>>)>,
    metrics: ListenerMetrics,
}

impl Drop for Handed {
    fn drop(&mut self) {
        self.metrics.open.dec();
    }
}

impl AsyncRead for Handed {
    /// Reads; until the first bytes are in, a read that would wait past their deadline
    /// fails instead, which closes the connection (counted).
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        let Some((due, deadline)) = this.first.as_mut() else {
            return polled;
        };
        match polled {
            Poll::Ready(Ok(())) => {
                *due = due.saturating_sub(buf.filled().len() - before);
                if *due == 0 {
                    this.first = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending if deadline.as_mut().poll(cx).is_ready() => {
                this.first = None;
                this.metrics.closed(Closed::HeaderTimeout);
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the first bytes did not arrive within server.header_timeout",
                )))
            }
            other => other,
        }
    }
}

super::listener::writes_through!(Handed, stream);
