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
        // The cluster is ok as soon as the masters cover every slot; the replicas are
        // told whose they are after that. A failover needs them in sync, and tests that
        // look for a master's replica need every node to know it.
        wait_for(
            "three replicas in sync, known to every node",
            Duration::from_secs(30),
            || {
                let synced = cluster.nodes.iter().filter(|n| replica_synced(n)).count();
                let known = cluster.nodes.iter().all(|n| {
                    cluster_nodes(n)
                        .is_some_and(|t| t.lines().filter(|l| l.contains("slave")).count() == 3)
                });
                (synced == 3 && known).then_some(())
            },
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

    /// The hash slot of `key` (`CLUSTER KEYSLOT` on the first node that answers).
    pub fn keyslot(&self, key: &str) -> u16 {
        self.nodes
            .iter()
            .find_map(|n| {
                let mut conn = n.try_conn().ok()?;
                redis::cmd("CLUSTER")
                    .arg("KEYSLOT")
                    .arg(key)
                    .query(&mut conn)
                    .ok()
            })
            .expect("no node answers CLUSTER KEYSLOT")
    }

    /// The index in `nodes` of the master serving `slot`, as the first node that
    /// answers (other than `except`) sees it in `CLUSTER NODES`; None if no master
    /// there serves it (it failed, and no replica took over yet).
    pub fn master_of(&self, slot: u16, except: Option<usize>) -> Option<usize> {
        let text = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i) != except)
            .find_map(|(_, n)| cluster_nodes(n))?;
        text.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let flags = f.get(2)?;
            if !flags.contains("master") || flags.contains("fail") {
                return None;
            }
            let serves = f.iter().skip(8).any(|r| match r.split_once('-') {
                _ if r.starts_with('[') => false, // a slot being migrated or imported
                Some((a, b)) => {
                    a.parse::<u16>().is_ok_and(|a| a <= slot)
                        && b.parse::<u16>().is_ok_and(|b| slot <= b)
                }
                None => r.parse::<u16>() == Ok(slot),
            });
            serves.then(|| self.index_of(f.get(1)?))?
        })
    }

    /// The index of the node at `addr` (`ip:port@cport`, as `CLUSTER NODES` writes it).
    fn index_of(&self, addr: &str) -> Option<usize> {
        let port: u16 = addr.split('@').next()?.rsplit(':').next()?.parse().ok()?;
        self.nodes.iter().position(|n| n.port == port)
    }

    /// The index in `nodes` of a replica of the master at index `master`.
    pub fn replica_of(&self, master: usize) -> Option<usize> {
        let id = self.node_id(master);
        let text = cluster_nodes(&self.nodes[master])?;
        text.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let replica = f.get(2)?.contains("slave") && f.get(3) == Some(&id.as_str());
            replica.then(|| self.index_of(f.get(1)?))?
        })
    }

    /// The cluster's ID of a node.
    pub fn node_id(&self, node: usize) -> String {
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut self.nodes[node].conn())
            .expect("CLUSTER MYID")
    }

    /// First step of moving `slot` from node `from` to node `to` (both masters): the
    /// target IMPORTING, then the source MIGRATING. From here the source answers ASK for
    /// the slot's keys it no longer has.
    pub fn begin_slot_migration(&self, slot: u16, from: usize, to: usize) {
        let (from_id, to_id) = (self.node_id(from), self.node_id(to));
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("IMPORTING")
            .arg(&from_id)
            .query(&mut self.nodes[to].conn())
            .expect("SETSLOT IMPORTING");
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("MIGRATING")
            .arg(&to_id)
            .query(&mut self.nodes[from].conn())
            .expect("SETSLOT MIGRATING");
    }

    /// Moves up to `count` of the slot's keys from `from` to `to` with one MIGRATE;
    /// returns how many it moved (0: none left).
    pub fn migrate_keys(&self, slot: u16, from: usize, to: usize, count: usize) -> usize {
        let mut conn = self.nodes[from].conn();
        let keys: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(count)
            .query(&mut conn)
            .expect("GETKEYSINSLOT");
        if keys.is_empty() {
            return 0;
        }
        let _: () = redis::cmd("MIGRATE")
            .arg("127.0.0.1")
            .arg(self.nodes[to].port)
            .arg("")
            .arg(0)
            .arg(5000)
            .arg("KEYS")
            .arg(&keys)
            .query(&mut conn)
            .expect("MIGRATE");
        keys.len()
    }

    /// Last step: `slot` is `to`'s, told to the target, then to the source, then to every
    /// other master (as `redis-cli --cluster reshard` does).
    pub fn finish_slot_migration(&self, slot: u16, from: usize, to: usize) {
        let to_id = self.node_id(to);
        let others = (0..self.nodes.len())
            .filter(|i| *i != to && *i != from && role(&self.nodes[*i]) == "master");
        for i in [to, from].into_iter().chain(others) {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("NODE")
                .arg(&to_id)
                .query(&mut self.nodes[i].conn())
                .expect("SETSLOT NODE");
        }
    }
}

/// A replica whose link to its master is up (ROLE: `slave`, host, port, `connected`, …).
fn replica_synced(node: &RedisServer) -> bool {
    let Ok(mut conn) = node.try_conn() else {
        return false;
    };
    let role: Vec<redis::Value> = redis::cmd("ROLE").query(&mut conn).unwrap_or_default();
    let text = |v: Option<&redis::Value>| match v {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        _ => String::new(),
    };
    text(role.first()) == "slave" && text(role.get(3)) == "connected"
}

/// `CLUSTER NODES` of `node`, or None when it does not answer.
fn cluster_nodes(node: &RedisServer) -> Option<String> {
    let mut conn = node.try_conn().ok()?;
    redis::cmd("CLUSTER").arg("NODES").query(&mut conn).ok()
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
    let Ok(mut conn) = node.try_conn() else {
        return String::new(); // killed, or not answering
    };
    redis::cmd("ROLE")
        .query::<Vec<redis::Value>>(&mut conn)
        .ok()
        .and_then(|v| match v.first() {
            Some(redis::Value::BulkString(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        })
        .unwrap_or_default()
}
