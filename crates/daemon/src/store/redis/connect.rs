//! Where the region's Redis is and how to reach it: the topology (one server, a cluster
//! behind its seed nodes, or a master found through Sentinel), TLS and ACL credentials.
//!
//! Every connection quotad opens to Redis is made here, so the request path, the
//! coordinator and the janitor reach the same servers the same way:
//!
//! - [`Target::connect`]: the request path's multiplexed connection. On a cluster it is
//!   the crate's cluster client, which keeps the slot map, follows MOVED and ASK, and
//!   reconnects to promoted replicas. Through Sentinel it asks the sentinels for the
//!   current master at every (re)connect, so a failover is followed by the next probe.
//! - [`Target::connect_sync`]: the coordinator's blocking connection.
//! - [`Target::masters`]: one client per master, for the janitor's SCANs (SCAN walks one
//!   node, so a cluster is swept master by master).
//! - [`Target::pubsub_clients`]: where the deny cache's invalidations are followed (on a
//!   cluster PUBLISH reaches every node, so any node will do).
//!
//! TLS is rustls with the `ring` provider (installed before the first client is built): no OpenSSL in the build.
//! The name verified is the host in each URL (or the name a cluster node announces).

use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClientBuilder;

use crate::layout::slot;
use crate::store::redis::cluster;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::io::tcp::TcpSettings;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, FromRedisValue, IntoConnectionInfo,
    Pipeline, RedisError, RedisFuture, RedisResult, TlsCertificates, TlsMode, Value,
};

/// How the region's Redis is deployed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// One server: `redis://`, `rediss://` or `unix://`.
    Standalone(String),
    /// A Redis Cluster, reached through any of these seed nodes.
    Cluster(Vec<String>),
    /// The master these sentinels name `master`.
    Sentinel {
        /// The sentinels' URLs.
        sentinels: Vec<String>,
        /// The master's name.
        master: String,
    },
}

/// PEM bytes read when the config was loaded, so a missing file is a config error.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// Trusted CA certificates; `None`: the system's roots.
    pub(crate) ca: Option<Vec<u8>>,
    /// Client certificate and key (mutual TLS).
    pub(crate) client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsFiles")
            .field("ca", &self.ca.is_some())
            .field("client", &self.client.is_some())
            .finish()
    }
}

impl TlsFiles {
    fn certificates(&self) -> TlsCertificates {
        TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.ca.clone(),
        }
    }
}

/// The region's Redis as the config describes it.
#[derive(Clone, PartialEq, Eq)]
pub struct Target {
    /// One server, a Cluster or a Sentinel set.
    pub topology: Topology,
    /// CA and client certificate for `rediss://` URLs (unused with `redis://`).
    pub tls: TlsFiles,
    /// ACL user and password; when set they replace any in the URLs.
    pub username: Option<String>,
    /// The ACL password (a secret: never logged).
    pub password: Option<String>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// The target every connection to the region's Redis is opened with, shared by the
/// request path and its subscriber, the janitor and the coordinator: credentials rotated
/// live (`reload`, [`crate::store::redis::RedisStore::rotate`]) reach every connection
/// opened after, while those open already keep serving. A std RwLock: held only to
/// clone the `Arc` out, never across an await.
#[derive(Clone)]
pub(crate) struct SharedTarget(Arc<std::sync::RwLock<Arc<Target>>>);

impl SharedTarget {
    pub(crate) fn new(target: Target) -> Self {
        SharedTarget(Arc::new(std::sync::RwLock::new(Arc::new(target))))
    }

    /// The target in force.
    pub(crate) fn get(&self) -> Arc<Target> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn set(&self, target: Target) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(target);
    }
}

impl std::fmt::Debug for SharedTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

/// Installs rustls's `ring` provider as the process default (the redis crate builds its
/// TLS configs from it), once; every client is built after it.
fn install_crypto() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err: a provider is installed already (by the embedding program): keep it.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

impl Target {
    /// A standalone server at `url`, no TLS files, no credentials beyond the URL's.
    #[cfg(feature = "testing")]
    pub fn standalone(url: &str) -> Self {
        Target {
            topology: Topology::Standalone(url.to_owned()),
            tls: TlsFiles::default(),
            username: None,
            password: None,
        }
    }

    /// For logs: the topology and its addresses, passwords removed.
    pub(crate) fn describe(&self) -> String {
        let list = |urls: &[String]| {
            urls.iter()
                .map(|u| redacted(u))
                .collect::<Vec<_>>()
                .join(",")
        };
        match &self.topology {
            Topology::Standalone(url) => redacted(url),
            Topology::Cluster(seeds) => format!("cluster {}", list(seeds)),
            Topology::Sentinel { sentinels, master } => {
                format!("sentinel {} master {master}", list(sentinels))
            }
        }
    }

    /// Whether the URLs ask for TLS.
    pub(crate) fn uses_tls(&self) -> bool {
        let tls = |u: &String| u.starts_with("rediss://");
        match &self.topology {
            Topology::Standalone(url) => tls(url),
            Topology::Cluster(urls) => urls.iter().any(tls),
            Topology::Sentinel { sentinels, .. } => sentinels.iter().any(tls),
        }
    }

    /// The connection info of `url` with the configured credentials and TCP_NODELAY (the
    /// multiplexed connection writes many small commands; Nagle would hold them back).
    fn info(&self, url: &str) -> RedisResult<ConnectionInfo> {
        install_crypto();
        let info = url
            .into_connection_info()?
            .set_tcp_settings(TcpSettings::default().set_nodelay(true));
        let mut redis = info.redis_settings().clone();
        if let Some(u) = &self.username {
            redis = redis.set_username(u);
        }
        if let Some(p) = &self.password {
            redis = redis.set_password(p);
        }
        Ok(info.set_redis_settings(redis))
    }

    /// A client for one server at `url`, with the TLS files when the URL is `rediss://`.
    pub(crate) fn client(&self, url: &str) -> RedisResult<redis::Client> {
        let info = self.info(url)?;
        if matches!(info.addr(), ConnectionAddr::TcpTls { .. }) {
            redis::Client::build_with_tls(info, self.tls.certificates())
        } else {
            redis::Client::open(info)
        }
    }

    /// Checks what can be checked without a network: URLs parse, TLS files load, the
    /// client can be built.
    pub(crate) fn check(&self) -> RedisResult<()> {
        match &self.topology {
            Topology::Standalone(url) => self.client(url).map(drop),
            Topology::Cluster(_) => self
                .cluster_builder(Duration::from_secs(1))?
                .build()
                .map(drop),
            Topology::Sentinel { .. } => self.sentinel().map(drop),
        }
    }

    fn cluster_builder(&self, timeout: Duration) -> RedisResult<ClusterClientBuilder> {
        let Topology::Cluster(seeds) = &self.topology else {
            return Err(not_a("cluster"));
        };
        let infos = seeds
            .iter()
            .map(|s| self.info(s))
            .collect::<RedisResult<Vec<_>>>()?;
        let mut b = ClusterClientBuilder::new(infos)
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .tcp_settings(TcpSettings::default().set_nodelay(true))
            // Redirects are followed by [`AsyncConn`] itself (see `cluster_command`): the
            // crate answers an ASK with ASKING and the command as two requests, which
            // concurrent requests on the node's shared connection get between, so a
            // script bounced between the two nodes of a slot migration until it failed.
            // A lost connection goes to the store's breaker, as on one server.
            .retries(0);
        if self.uses_tls() {
            b = b.tls(TlsMode::Secure).certs(self.tls.certificates());
        }
        Ok(b)
    }

    fn sentinel(&self) -> RedisResult<SentinelClient> {
        let Topology::Sentinel { sentinels, master } = &self.topology else {
            return Err(not_a("sentinel"));
        };
        let addrs = sentinels
            .iter()
            .map(|s| s.as_str().into_connection_info().map(|i| i.addr().clone()))
            .collect::<RedisResult<Vec<_>>>()?;
        install_crypto();
        let mut b = SentinelClientBuilder::new(addrs, master, SentinelServerType::Master)?
            .set_client_to_redis_tcp_settings(TcpSettings::default().set_nodelay(true));
        if let Some(u) = &self.username {
            b = b.set_client_to_redis_username(u);
        }
        if let Some(p) = &self.password {
            b = b.set_client_to_redis_password(p);
        }
        if self.uses_tls() {
            let certs = self.tls.certificates();
            b = b
                .set_client_to_redis_tls_mode(TlsMode::Secure)
                .set_client_to_redis_certificates(certs.clone())
                .set_client_to_sentinel_tls_mode(TlsMode::Secure)
                .set_client_to_sentinel_certificates(certs);
        }
        b.build()
    }

    /// The request path's connection (see the module docs).
    pub async fn connect(
        &self,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> RedisResult<AsyncConn> {
        Ok(self
            .connect_tracked(connect_timeout, response_timeout)
            .await?
            .0)
    }

    /// [`Target::connect`], with the address of the master the sentinels named (`None`
    /// for other topologies), to compare with [`Target::sentinel_master`] later.
    pub(crate) async fn connect_tracked(
        &self,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> RedisResult<(AsyncConn, Option<String>)> {
        let cfg = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(response_timeout));
        let cfg = &cfg;
        match &self.topology {
            Topology::Standalone(url) => Ok((
                AsyncConn::Single(
                    self.client(url)?
                        .get_multiplexed_async_connection_with_config(cfg)
                        .await?,
                ),
                None,
            )),
            Topology::Cluster(_) => {
                let client = self.cluster_builder(connect_timeout)?.build()?;
                Ok((
                    AsyncConn::Cluster(client.get_async_connection().await?),
                    None,
                ))
            }
            Topology::Sentinel { .. } => {
                let client = self.sentinel()?.async_get_client().await?;
                let master = client.get_connection_info().addr().to_string();
                let conn = client
                    .get_multiplexed_async_connection_with_config(cfg)
                    .await?;
                Ok((AsyncConn::Single(conn), Some(master)))
            }
        }
    }

    /// Through Sentinel, the address of the master the sentinels name now (the crate
    /// checks that it says it is a master); `None` for other topologies.
    pub(crate) async fn sentinel_master(&self) -> RedisResult<Option<String>> {
        match &self.topology {
            Topology::Sentinel { .. } => {
                let client = self.sentinel()?.async_get_client().await?;
                Ok(Some(client.get_connection_info().addr().to_string()))
            }
            _ => Ok(None),
        }
    }

    /// The coordinator's blocking connection; `timeout` bounds connecting and every read
    /// and write.
    pub fn connect_sync(&self, timeout: Duration) -> RedisResult<SyncConn> {
        let single = |conn: redis::Connection| -> RedisResult<SyncConn> {
            conn.set_read_timeout(Some(timeout))?;
            conn.set_write_timeout(Some(timeout))?;
            Ok(SyncConn::Single(conn))
        };
        match &self.topology {
            Topology::Standalone(url) => {
                single(self.client(url)?.get_connection_with_timeout(timeout)?)
            }
            Topology::Cluster(_) => Ok(SyncConn::Cluster(Box::new(
                self.cluster_builder(timeout)?.build()?.get_connection()?,
            ))),
            Topology::Sentinel { .. } => {
                let client = self.sentinel()?.get_client()?;
                single(client.get_connection_with_timeout(timeout)?)
            }
        }
    }

    /// One client per master (see the module docs). A cluster's masters are read from
    /// `CLUSTER SLOTS` on the first seed that answers.
    pub(crate) async fn masters(&self, timeout: Duration) -> RedisResult<Vec<redis::Client>> {
        match &self.topology {
            Topology::Standalone(url) => Ok(vec![self.client(url)?]),
            Topology::Sentinel { .. } => Ok(vec![self.sentinel()?.async_get_client().await?]),
            Topology::Cluster(seeds) => {
                let mut last = None;
                for seed in seeds {
                    match self.cluster_masters(seed, timeout).await {
                        Ok(m) => return Ok(m),
                        Err(e) => last = Some(e),
                    }
                }
                Err(last.unwrap_or_else(|| not_a("cluster")))
            }
        }
    }

    async fn cluster_masters(
        &self,
        seed: &str,
        timeout: Duration,
    ) -> RedisResult<Vec<redis::Client>> {
        let cfg = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let mut conn: MultiplexedConnection = self
            .client(seed)?
            .get_multiplexed_async_connection_with_config(&cfg)
            .await?;
        let slots: Vec<Vec<Value>> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut conn)
            .await?;
        let scheme = if self.uses_tls() { "rediss" } else { "redis" };
        let mut urls: Vec<String> = Vec::new();
        for range in slots {
            // [start, end, [host, port, id, ...], replicas...]
            let Some(Value::Array(master)) = range.get(2) else {
                continue;
            };
            let host: Option<String> = master
                .first()
                .and_then(|v| String::from_redis_value(v.clone()).ok());
            let port: Option<u16> = master
                .get(1)
                .and_then(|v| u16::from_redis_value(v.clone()).ok());
            if let (Some(host), Some(port)) = (host, port) {
                let url = format!("{scheme}://{host}:{port}");
                if !urls.contains(&url) {
                    urls.push(url);
                }
            }
        }
        urls.iter().map(|u| self.client(u)).collect()
    }

    /// Where to subscribe to the invalidation channel, in order of preference.
    pub(crate) async fn pubsub_clients(&self) -> RedisResult<Vec<redis::Client>> {
        match &self.topology {
            Topology::Standalone(url) => Ok(vec![self.client(url)?]),
            Topology::Cluster(seeds) => seeds.iter().map(|s| self.client(s)).collect(),
            Topology::Sentinel { .. } => Ok(vec![self.sentinel()?.async_get_client().await?]),
        }
    }
}

fn not_a(what: &str) -> RedisError {
    RedisError::from((
        redis::ErrorKind::InvalidClientConfig,
        "topology mismatch",
        format!("not a {what} target"),
    ))
}

/// The URL without its password, for logs.
pub(crate) fn redacted(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_credentials() {
        assert_eq!(
            redacted("redis://:secret@host:6379/0"),
            "redis://***@host:6379/0"
        );
        assert_eq!(redacted("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
    }

    #[test]
    fn slots_follow_the_hash_tag_rule() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(slot("123456789"), 0x31C3);
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
        assert_eq!(slot("foo{}{bar}"), slot("foo{}{bar}"));
        assert_ne!(
            slot("foo{}{bar}"),
            slot("bar"),
            "an empty tag hashes the whole key"
        );
        assert_eq!(slot("foo{{bar}}zap"), slot("{bar"));
    }
}

/// The request path's connection: one multiplexed connection to a server, or the cluster
/// client (which multiplexes one connection per node).
#[derive(Clone)]
pub enum AsyncConn {
    Single(MultiplexedConnection),
    /// One server's connection whose commands leave in one write per scheduler turn
    /// (`store::redis::coalesce`): the request path's.
    Coalesced(crate::store::redis::coalesce::Coalescing),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl AsyncConn {
    /// This connection with its single commands coalesced (on a cluster: submitted
    /// together, each on its own).
    pub(crate) fn coalesced(self, counters: crate::store::redis::coalesce::Counters) -> AsyncConn {
        match self {
            AsyncConn::Single(c) => {
                AsyncConn::Coalesced(crate::store::redis::coalesce::Coalescing::new(c, counters))
            }
            AsyncConn::Cluster(c) => AsyncConn::Coalesced(
                crate::store::redis::coalesce::Coalescing::cluster(c, counters),
            ),
            other => other,
        }
    }
}

impl redis::aio::ConnectionLike for AsyncConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            AsyncConn::Single(c) => c.req_packed_command(cmd),
            AsyncConn::Coalesced(c) => c.req_packed_command(cmd),
            AsyncConn::Cluster(c) => Box::pin(cluster::command(c, cmd)),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            AsyncConn::Single(c) => c.req_packed_commands(cmd, offset, count),
            AsyncConn::Coalesced(c) => c.req_packed_commands(cmd, offset, count),
            AsyncConn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            AsyncConn::Single(c) => c.get_db(),
            AsyncConn::Coalesced(c) => c.get_db(),
            AsyncConn::Cluster(c) => c.get_db(),
        }
    }
}

/// The coordinator's blocking connection. Its pipelines must keep to one hash slot (the
/// coordinator's always do: a global policy's keys share one): on a cluster a pipeline
/// goes whole to the node of its first command.
pub enum SyncConn {
    /// A standalone server's (or a Sentinel master's) connection.
    Single(redis::Connection),
    /// A Cluster connection.
    Cluster(Box<redis::cluster::ClusterConnection>),
}

impl SyncConn {
    /// Sends `cmd` to the master of `key`'s slot (commands without keys, such as `INFO`
    /// or `WAIT`, would otherwise go to a random node or to all of them).
    pub(crate) fn query_at<T: FromRedisValue>(&mut self, cmd: &Cmd, key: &str) -> RedisResult<T> {
        match self {
            SyncConn::Single(c) => cmd.query(c),
            SyncConn::Cluster(c) => {
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                    Route::new(slot(key), SlotAddr::Master),
                ));
                T::from_redis_value(c.route_command(cmd, route)?).map_err(Into::into)
            }
        }
    }
}

impl redis::ConnectionLike for SyncConn {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        match self {
            SyncConn::Single(c) => c.req_packed_command(cmd),
            SyncConn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        match self {
            SyncConn::Single(c) => c.req_packed_commands(cmd, offset, count),
            SyncConn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            SyncConn::Single(c) => c.get_db(),
            SyncConn::Cluster(c) => c.get_db(),
        }
    }

    fn check_connection(&mut self) -> bool {
        match self {
            SyncConn::Single(c) => c.check_connection(),
            SyncConn::Cluster(c) => c.check_connection(),
        }
    }

    fn is_open(&self) -> bool {
        match self {
            SyncConn::Single(c) => c.is_open(),
            SyncConn::Cluster(c) => c.is_open(),
        }
    }
}
