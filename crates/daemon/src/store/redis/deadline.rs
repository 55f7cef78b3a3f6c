//! A Redis call's deadline that judges Redis, not quotad's own runtime.
//!
//! The timer and the reply are both seen by the runtime's driver, often in the same turn:
//! when quotad is busy (a spike of new connections right after a start, a burst of
//! parsing), the call's timer may fire while its reply already sits in the socket or in
//! the connection's reader, which has simply not been scheduled yet. A plain timeout then
//! reports a Redis failure that was quotad's lag, and the check takes its fail mode with a
//! healthy Redis. [`within`] gives the call [`LATE_POLLS`] more turns of the scheduler
//! after its timer fires (each lets the driver read the sockets and the reader hand the
//! reply over) before calling it late: microseconds when Redis is really silent.

use std::future::Future;
use std::time::Duration;

use futures_util::FutureExt;

/// Scheduler turns a call gets after its timer fires.
pub(crate) const LATE_POLLS: usize = 3;

/// How a call under a deadline ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Within<T> {
    /// Answered before the timer fired.
    InTime(T),
    /// Answered in the turns after the timer fired: the reply was there, the runtime was
    /// behind in reading it (counted: `quotad_store_late_replies_total`).
    Late(T),
    /// No answer.
    TimedOut,
}

/// Runs `call` with `timeout`, then [`LATE_POLLS`] turns of grace.
pub(crate) async fn within<F: Future>(timeout: Duration, call: F) -> Within<F::Output> {
    let mut call = std::pin::pin!(call);
    if let Ok(v) = tokio::time::timeout(timeout, call.as_mut()).await {
        return Within::InTime(v);
    }
    for _ in 0..LATE_POLLS {
        tokio::task::yield_now().await;
        if let Some(v) = call.as_mut().now_or_never() {
            return Within::Late(v);
        }
    }
    Within::TimedOut
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot;

    /// The reply is sent by a task whose own timer fires at the call's deadline: it is
    /// ready to run, not yet run, when the call's timer fires. A plain timeout calls that
    /// a failure; `within` lets the task run and takes the reply.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_reply_ready_when_the_timer_fires_is_taken_not_timed_out() {
        let t = Duration::from_millis(50);
        let (tx, rx) = oneshot::channel();
        tokio::spawn(async move {
            tokio::time::sleep(t).await;
            let _ = tx.send(7);
        });
        assert_eq!(within(t, rx).await, Within::Late(Ok(7)));

        // The same race under a plain timeout: what quotad did before.
        let (tx, rx) = oneshot::channel();
        tokio::spawn(async move {
            tokio::time::sleep(t).await;
            let _ = tx.send(7);
        });
        assert!(tokio::time::timeout(t, rx).await.is_err());
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_silent_redis_still_times_out() {
        let (_tx, rx) = oneshot::channel::<u8>();
        assert_eq!(
            within(Duration::from_millis(50), rx).await,
            Within::TimedOut
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_answer_in_time_is_in_time() {
        assert_eq!(
            within(Duration::from_millis(50), async { 1 }).await,
            Within::InTime(1)
        );
    }
}
