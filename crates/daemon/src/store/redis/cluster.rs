//! A command on Redis Cluster: its hash slot, and the redirects it may meet on the way
//! (MOVED, ASK, TRYAGAIN), followed here rather than by the crate (see
//! `connect::Target::cluster_builder` for why). Used by the request path's connection
//! (`connect::AsyncConn`) and by its coalescer (`store::redis::coalesce`).

use std::time::Duration;

use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, RedisError, RedisResult, Value};

/// Redirects a command may follow before its error is the caller's.
const REDIRECTS: u32 = 5;

/// One command on a cluster, following MOVED (to the node named, while the crate rebuilds
/// its slot map), ASK (ASKING and the command in one pipeline, so nothing can come between
/// them on the node's shared connection) and TRYAGAIN (a multi-key script mid-migration,
/// after a short pause). Each command is bounded by the store's per-call timeout.
pub(crate) async fn command(
    c: &mut redis::cluster_async::ClusterConnection,
    cmd: &Cmd,
) -> RedisResult<Value> {
    let mut redirect: Option<(bool, SingleNodeRoutingInfo)> = None;
    let mut attempt = 0;
    loop {
        let result = match redirect.take() {
            None => redis::aio::ConnectionLike::req_packed_command(c, cmd).await,
            Some((false, node)) => {
                c.route_command(cmd.clone(), RoutingInfo::SingleNode(node))
                    .await
            }
            Some((true, node)) => {
                let mut pipe = redis::pipe();
                pipe.cmd("ASKING").add_command(cmd.clone());
                c.route_pipeline(pipe, 1, 1, node)
                    .await
                    .and_then(|mut v| v.pop().ok_or_else(|| not_a("reply to ASKING")))
                    .and_then(Value::extract_error)
            }
        };
        attempt += 1;
        let Err(e) = result else { return result };
        if attempt > REDIRECTS {
            return Err(e);
        }
        match e.kind() {
            redis::ErrorKind::Server(
                kind @ (redis::ServerErrorKind::Ask | redis::ServerErrorKind::Moved),
            ) => {
                let Some(node) = e.redirect_node().and_then(|(addr, _)| by_address(addr)) else {
                    return Err(e);
                };
                redirect = Some((kind == redis::ServerErrorKind::Ask, node));
            }
            redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain) => {
                tokio::time::sleep(Duration::from_millis(5 * u64::from(attempt))).await;
            }
            _ => return Err(e),
        }
    }
}

/// `host:port` (the address in a MOVED or ASK) as a route.
fn by_address(addr: &str) -> Option<SingleNodeRoutingInfo> {
    let (host, port) = addr.rsplit_once(':')?;
    Some(SingleNodeRoutingInfo::ByAddress {
        host: host.to_owned(),
        port: port.parse().ok()?,
    })
}

fn not_a(what: &str) -> RedisError {
    RedisError::from((
        redis::ErrorKind::InvalidClientConfig,
        "unexpected reply",
        what.to_owned(),
    ))
}
