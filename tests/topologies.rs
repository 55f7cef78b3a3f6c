//! The Redis topologies the test kit starts for tests of cluster support, brought up and
//! torn down for real.

use std::collections::BTreeSet;
use std::time::Duration;

use quotad_testkit::cluster::RedisCluster;
use quotad_testkit::sentinel::SentinelSetup;
use quotad_testkit::tls::TlsRedis;
use quotad_testkit::wait_for;

/// Processes whose command line names one of `ports`.
fn redis_processes(ports: &BTreeSet<u16>) -> usize {
    let mut n = 0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains("redis-server")
            && ports
                .iter()
                .any(|p| cmd.contains(&format!(" {p} ")) || cmd.contains(&format!(":{p}")))
        {
            n += 1;
        }
    }
    n
}

#[test]
fn a_cluster_of_three_masters_and_three_replicas_starts_and_leaves_no_process() {
    let cluster = RedisCluster::start();
    let ports: BTreeSet<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    assert_eq!(cluster.masters().len(), 3, "three masters");
    assert_eq!(cluster.seeds().len(), 6);
    assert_eq!(redis_processes(&ports), 6);
    // Every master serves a range of slots (its own line in CLUSTER NODES lists one).
    for m in cluster.masters() {
        let mut conn = m.conn();
        let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(&mut conn).unwrap();
        assert!(
            nodes
                .lines()
                .any(|l| l.contains("myself,master") && l.contains('-'))
        );
    }
    drop(cluster);
    assert_eq!(redis_processes(&ports), 0, "every node is gone");
}

#[test]
fn a_sentinel_setup_fails_over_on_request_and_leaves_no_process() {
    let setup = SentinelSetup::start();
    let (master, replica) = (setup.master.port, setup.replica.port);
    let ports: BTreeSet<u16> = [master, replica]
        .into_iter()
        .chain(setup.sentinels.iter().map(|s| s.port))
        .collect();
    assert_eq!(redis_processes(&ports), 5);
    assert_eq!(setup.sentinels[0].master_port(), Some(master));
    setup.sentinels[0].failover();
    wait_for(
        "every sentinel to name the replica",
        Duration::from_secs(20),
        || {
            setup
                .sentinels
                .iter()
                .all(|s| s.master_port() == Some(replica))
                .then_some(())
        },
    );
    drop(setup);
    assert_eq!(redis_processes(&ports), 0, "every process is gone");
}

#[test]
fn a_tls_redis_answers_clients_that_trust_its_ca_only() {
    let redis = TlsRedis::start();
    let ports = BTreeSet::from([redis.port]);
    assert!(redis.url().starts_with("rediss://"));
    assert!(redis.ping(&redis.ca), "a client with the CA is answered");
    assert!(
        !redis.ping(&redis.untrusted_ca),
        "a client that does not trust the server's CA refuses it"
    );
    assert_eq!(redis_processes(&ports), 1);
    drop(redis);
    assert_eq!(redis_processes(&ports), 0, "the server is gone");
}
