//! Coalesced Redis I/O on the request path: the commands that concurrent requests issue
//! in the same scheduler turn leave as one pipeline, so one socket write (and, on Redis's
//! side, one read and one reply write) carries many decisions instead of one each.
//!
//! How: a call puts its command in the connection's queue and waits for its reply; the
//! first call into an empty queue wakes the connection's flusher, which yields to the
//! tasks ready now until the queue stops growing (at most [`MAX_YIELDS`] times), takes
//! the whole queue and sends it as one pipeline, then goes back to waiting while the
//! pipeline's replies come in and are handed out in order. A lone command waits a yield
//! or two and no timer: no added latency when the load is light.
//! `quotad_store_pipelines_total` and `quotad_store_pipelined_commands_total` count what
//! left: their ratio is the commands per write. Each reply is the command's own (a script error answers only
//! its caller); a lost connection answers every command of the pipeline with the error.
//!
//! On a cluster the turn's commands are submitted together, each on its own with its
//! redirects followed (`store::redis::cluster`): the cluster client hands them to the nodes'
//! connections at once, and each connection writes what reached it together. Never as
//! pipelines there: the crate retries a whole pipeline when one command in it meets a
//! redirect, and would run the others twice.

use std::sync::{Arc, Mutex, Weak};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};
use tokio::sync::{Notify, oneshot};

use crate::store::redis::cluster;

type Reply = oneshot::Sender<RedisResult<Value>>;

/// Yields a flusher waits at most for the queue to stop growing before it sends.
pub(crate) const MAX_YIELDS: usize = 4;

/// What the flusher counts.
#[derive(Clone)]
pub(crate) struct Counters {
    /// Pipelines sent (one socket write each, as the driver writes a message whole).
    pub(crate) pipelines: prometheus::IntCounter,
    /// Commands sent in them.
    pub(crate) commands: prometheus::IntCounter,
}

/// A multiplexed connection whose single commands are coalesced. Clones share the queue.
#[derive(Clone)]
pub struct Coalescing {
    shared: Arc<Shared>,
}

struct Shared {
    queue: Mutex<Vec<(Cmd, Reply)>>,
    /// Wakes the flusher: a command went into an empty queue, or the connection is gone.
    wake: Arc<Notify>,
    conn: Link,
}

/// Where a turn's commands go.
#[derive(Clone)]
enum Link {
    Server(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The last handle is gone: the flusher wakes, finds no connection and ends.
        self.wake.notify_one();
    }
}

impl Coalescing {
    /// Wraps one server's `conn`; spawns its flusher on the current runtime (it ends
    /// with the last clone).
    pub(crate) fn new(conn: MultiplexedConnection, counters: Counters) -> Self {
        Self::over(Link::Server(conn), counters)
    }

    /// Wraps a cluster's `conn`: each turn's commands grouped by hash slot.
    pub(crate) fn cluster(conn: ClusterConnection, counters: Counters) -> Self {
        Self::over(Link::Cluster(conn), counters)
    }

    fn over(conn: Link, counters: Counters) -> Self {
        let wake = Arc::new(Notify::new());
        let shared = Arc::new(Shared {
            queue: Mutex::new(Vec::new()),
            wake: wake.clone(),
            conn,
        });
        tokio::spawn(flusher(Arc::downgrade(&shared), wake, counters));
        Coalescing { shared }
    }

    async fn call(&self, cmd: &Cmd) -> RedisResult<Value> {
        let (tx, rx) = oneshot::channel();
        let first = {
            let mut q = self.shared.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.push((cmd.clone(), tx));
            q.len() == 1
        };
        if first {
            self.shared.wake.notify_one();
        }
        rx.await.unwrap_or_else(|_| {
            Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the connection's flusher stopped",
            )))
        })
    }
}

/// Sends each turn's commands as one pipeline until the connection is dropped.
async fn flusher(shared: Weak<Shared>, wake: Arc<Notify>, counters: Counters) {
    let queued = |s: &Shared| s.queue.lock().unwrap_or_else(|p| p.into_inner()).len();
    loop {
        wake.notified().await;
        // Let the tasks that are ready now queue their commands too: yield until the
        // queue stops growing.
        let mut seen = 0;
        for _ in 0..MAX_YIELDS {
            tokio::task::yield_now().await;
            let Some(s) = shared.upgrade() else { return };
            let n = queued(&s);
            if n == seen {
                break;
            }
            seen = n;
        }
        let Some(s) = shared.upgrade() else { return };
        let batch = std::mem::take(&mut *s.queue.lock().unwrap_or_else(|p| p.into_inner()));
        if batch.is_empty() {
            continue;
        }
        counters.pipelines.inc();
        counters.commands.inc_by(batch.len() as u64);
        let conn = s.conn.clone();
        drop(s);
        // The replies come back while the next turn's commands are collected.
        tokio::spawn(send(conn, batch));
    }
}

/// One turn's commands: every command's reply to its caller.
async fn send(conn: Link, batch: Vec<(Cmd, Reply)>) {
    match conn {
        Link::Server(conn) => send_to_server(conn, batch).await,
        Link::Cluster(conn) => send_to_cluster(conn, batch).await,
    }
}

/// One pipeline on one server's connection.
async fn send_to_server(mut conn: MultiplexedConnection, batch: Vec<(Cmd, Reply)>) {
    if let [(cmd, _)] = batch.as_slice() {
        let r = conn.send_packed_command(cmd).await;
        if let Some((_, reply)) = batch.into_iter().next() {
            let _ = reply.send(r);
        }
        return;
    }
    let (pipe, replies) = pipeline(batch);
    let answers = answers(
        conn.send_packed_commands(&pipe, 0, replies.len()).await,
        replies.len(),
    );
    for (reply, answer) in replies.into_iter().zip(answers) {
        let _ = reply.send(answer);
    }
}

/// Every command of the turn submitted at once, each on its own: the cluster client hands
/// them to the nodes' connections together, and each connection writes what reached it.
/// Not as pipelines: the crate retries a whole pipeline when one of its commands meets a
/// redirect, so the others, already run, would run twice (a check charged twice, a
/// refund given twice) while a slot migrates.
async fn send_to_cluster(conn: ClusterConnection, batch: Vec<(Cmd, Reply)>) {
    futures_util::future::join_all(
        batch
            .into_iter()
            .map(|(cmd, reply)| one(conn.clone(), cmd, reply)),
    )
    .await;
}

/// One command on the cluster, redirects followed.
async fn one(mut conn: ClusterConnection, cmd: Cmd, reply: Reply) {
    let _ = reply.send(cluster::command(&mut conn, &cmd).await);
}

fn pipeline(batch: Vec<(Cmd, Reply)>) -> (Pipeline, Vec<Reply>) {
    let mut pipe = Pipeline::with_capacity(batch.len());
    let mut replies = Vec::with_capacity(batch.len());
    for (cmd, reply) in batch {
        pipe.add_command(cmd);
        replies.push(reply);
    }
    (pipe, replies)
}

/// A pipeline's result as `n` answers: each command's own reply, or the error for all.
fn answers(sent: RedisResult<Vec<Value>>, n: usize) -> Vec<RedisResult<Value>> {
    match sent {
        Ok(values) if values.len() == n => values.into_iter().map(Ok).collect(),
        Ok(values) => {
            let e = RedisError::from(std::io::Error::other(format!(
                "{} replies to a pipeline of {n}",
                values.len()
            )));
            vec![Err(e); n]
        }
        Err(e) => vec![Err(e); n],
    }
}

impl ConnectionLike for Coalescing {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.call(cmd))
    }

    /// A caller's own pipeline goes as it is.
    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self.shared.conn.clone() {
            Link::Server(mut c) => {
                Box::pin(async move { c.send_packed_commands(cmd, offset, count).await })
            }
            Link::Cluster(mut c) => {
                Box::pin(async move { c.req_packed_commands(cmd, offset, count).await })
            }
        }
    }

    fn get_db(&self) -> i64 {
        match &self.shared.conn {
            Link::Server(c) => c.get_db(),
            Link::Cluster(c) => c.get_db(),
        }
    }
}
