//! A Redis Cluster on loopback: three masters and three replicas, each a
//! [`RedisServer`] with cluster mode on, joined by `redis-cli --cluster create`. Every
//! node is killed when the cluster drops.
//!
//! The node timeout is short (2 s) so that a killed master's replica is promoted within
//! a test's patience.

use std::process::Command;
use std::time::Duration;

use crate::{RedisServer, wait_for};

/// Milliseconds a node may be unreachable before the cluster fails it over.
pub const NODE_TIMEOUT_MS: u64 = 2000;

pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Three masters, one replica each; returns once every node reports the cluster ok
    /// and all 16,384 slots served.
    pub fn start() -> RedisCluster {
        let timeout = NODE_TIMEOUT_MS.to_string();
        let args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            &timeout,
        ];
        let nodes: Vec<RedisServer> = (0..6)
            .map(|_| RedisServer::start_with_args(false, &args))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli (Debian package redis-tools) is needed for a cluster");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster { nodes };
        wait_for(
            "the cluster to be ok on every node",
            Duration::from_secs(30),
            || cluster.nodes.iter().all(cluster_ok).then_some(()),
        );
        cluster
    }

    /// `redis://` URLs of every node: the seeds a client starts from.
    pub fn seeds(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The nodes that are masters now.
    pub fn masters(&self) -> Vec<&RedisServer> {
        self.nodes.iter().filter(|n| role(n) == "master").collect()
    }
}

/// `CLUSTER INFO` says ok and every slot is assigned.
fn cluster_ok(node: &RedisServer) -> bool {
    let Ok(mut conn) = redis::Client::open(node.url())
        .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)))
    else {
        return false;
    };
    let info: String = redis::cmd("CLUSTER")
        .arg("INFO")
        .query(&mut conn)
        .unwrap_or_default();
    info.contains("cluster_state:ok") && info.contains("cluster_slots_assigned:16384")
}

/// `master` or `slave`, from ROLE; empty when the node does not answer.
fn role(node: &RedisServer) -> String {
    let mut conn = node.conn();
    redis::cmd("ROLE")
        .query::<Vec<redis::Value>>(&mut conn)
        .ok()
        .and_then(|v| match v.first() {
            Some(redis::Value::BulkString(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        })
        .unwrap_or_default()
}
