//! A Sentinel setup on loopback: a master, a replica and three sentinels watching them
//! under one name, every process killed when the setup drops. Failure detection is fast
//! (1 s down-after) so a test can fail over within its patience.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{RedisServer, free_port, wait_for};

/// The name the sentinels monitor the master under.
pub const MASTER_NAME: &str = "quotad";

/// One `redis-server --sentinel` process, killed on drop.
pub struct Sentinel {
    pub port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Sentinel {
    fn start(master_port: u16) -> Sentinel {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\n\
                 sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n\
                 sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
                 sentinel failover-timeout {MASTER_NAME} 5000\n",
                dir.path().display()
            ),
        )
        .expect("write sentinel.conf");
        let child = spawn_sentinel(&conf);
        let s = Sentinel {
            port,
            child,
            _dir: dir,
        };
        wait_for("a sentinel to answer", Duration::from_secs(10), || {
            s.query(&["PING"]).ok().filter(|p| p == "PONG")
        });
        s
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// One command to this sentinel, its reply as a string.
    fn query(&self, args: &[&str]) -> redis::RedisResult<String> {
        let mut conn =
            redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(1))?;
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut conn)
    }

    /// The port of the master this sentinel names now.
    pub fn master_port(&self) -> Option<u16> {
        let mut conn = redis::Client::open(self.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)))
            .ok()?;
        let addr: Vec<String> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(MASTER_NAME)
            .query(&mut conn)
            .ok()?;
        addr.get(1)?.parse().ok()
    }

    /// This sentinel sees the replica and the two other sentinels.
    fn knows_everyone(&self) -> bool {
        let Ok(mut conn) = redis::Client::open(self.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)))
        else {
            return false;
        };
        let mut count = |sub: &str| {
            redis::cmd("SENTINEL")
                .arg(sub)
                .arg(MASTER_NAME)
                .query::<Vec<redis::Value>>(&mut conn)
                .map_or(0, |v| v.len())
        };
        count("REPLICAS") >= 1 && count("SENTINELS") >= 2
    }

    /// `SENTINEL FAILOVER`: promotes the replica without waiting for the master to fail.
    pub fn failover(&self) {
        let reply = self
            .query(&["SENTINEL", "FAILOVER", MASTER_NAME])
            .expect("SENTINEL FAILOVER");
        assert_eq!(reply, "OK");
    }
}

fn spawn_sentinel(conf: &Path) -> Child {
    Command::new(crate::redis_server_path())
        .arg(conf)
        .arg("--sentinel")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn redis-server --sentinel")
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A master, its replica and three sentinels.
pub struct SentinelSetup {
    pub master: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<Sentinel>,
}

impl SentinelSetup {
    /// Returns once the replica is in sync and every sentinel knows both nodes and the
    /// other sentinels (a failover needs them).
    pub fn start() -> SentinelSetup {
        let master = RedisServer::start();
        let replica = RedisServer::start_with_args(
            false,
            &["--replicaof", "127.0.0.1", &master.port.to_string()],
        );
        wait_for("the replica in sync", Duration::from_secs(10), || {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut replica.conn())
                .ok()?;
            info.contains("master_link_status:up").then_some(())
        });
        let sentinels: Vec<Sentinel> = (0..3).map(|_| Sentinel::start(master.port)).collect();
        let setup = SentinelSetup {
            master,
            replica,
            sentinels,
        };
        wait_for(
            "sentinels that know each other and the replica",
            Duration::from_secs(20),
            || {
                setup
                    .sentinels
                    .iter()
                    .all(|s| s.knows_everyone())
                    .then_some(())
            },
        );
        setup
    }

    /// `redis://` URLs of the sentinels.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(Sentinel::url).collect()
    }
}
