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
//! Only one server's multiplexed connection is coalesced (standalone and Sentinel); on a
//! cluster each command is routed (and redirected) on its own (`connect::cluster_command`).

use std::sync::{Arc, Mutex, Weak};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};
use tokio::sync::{Notify, oneshot};

type Reply = oneshot::Sender<RedisResult<Value>>;

/// Yields a flusher waits at most for the queue to stop growing before it sends.
pub const MAX_YIELDS: usize = 4;

/// What the flusher counts.
#[derive(Clone)]
pub struct Counters {
    /// Pipelines sent (one socket write each, as the driver writes a message whole).
    pub pipelines: prometheus::IntCounter,
    /// Commands sent in them.
    pub commands: prometheus::IntCounter,
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
    conn: MultiplexedConnection,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The last handle is gone: the flusher wakes, finds no connection and ends.
        self.wake.notify_one();
    }
}

impl Coalescing {
    /// Wraps `conn`; spawns its flusher on the current runtime (it ends with the last
    /// clone).
    pub fn new(conn: MultiplexedConnection, counters: Counters) -> Self {
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

/// One pipeline: every command's reply to its caller.
async fn send(mut conn: MultiplexedConnection, batch: Vec<(Cmd, Reply)>) {
    if let [(cmd, _)] = batch.as_slice() {
        let r = conn.send_packed_command(cmd).await;
        if let Some((_, reply)) = batch.into_iter().next() {
            let _ = reply.send(r);
        }
        return;
    }
    let mut pipe = Pipeline::with_capacity(batch.len());
    let mut replies = Vec::with_capacity(batch.len());
    for (cmd, reply) in batch {
        pipe.add_command(cmd);
        replies.push(reply);
    }
    let answers = match conn.send_packed_commands(&pipe, 0, replies.len()).await {
        Ok(values) if values.len() == replies.len() => values.into_iter().map(Ok).collect(),
        Ok(values) => {
            let e = RedisError::from(std::io::Error::other(format!(
                "{} replies to a pipeline of {}",
                values.len(),
                replies.len()
            )));
            vec![Err(e); replies.len()]
        }
        Err(e) => vec![Err(e); replies.len()],
    };
    for (reply, answer) in replies.into_iter().zip(answers) {
        let _ = reply.send(answer);
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
        let mut conn = self.shared.conn.clone();
        Box::pin(async move { conn.send_packed_commands(cmd, offset, count).await })
    }

    fn get_db(&self) -> i64 {
        self.shared.conn.get_db()
    }
}
