//! The container image (deploy/container), built from this checkout and run from its own
//! root.
//!
//! Base images cannot be pulled on these machines and containers cannot start on them
//! (podman is refused setrlimit and cgroups), so the test does what `docker build` and
//! `docker run` would, one step short of a container: deploy/container/build-local.sh
//! replays the Dockerfile's build stage in a directory holding only what its COPY lines
//! name (cargo must load the workspace there), assembles the runtime root with the same
//! rootfs.sh as the build stage, builds the `FROM scratch` image with podman (vfs
//! storage) and exports its filesystem. The test then runs the binary from that root
//! under chroot, as the image's user: it validates the baked config, resolves a host
//! name, answers a check from a real Redis and answers its own health check.
//!
//! The image holds the binary the test suite built (a debug build, so it is larger than
//! the shipped one); `deploy/container/build-local.sh` alone builds the release binary
//! in the replayed directory (the size in the README).

use quotad_testkit as common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::{RedisServer, free_port, http, quotad_binary, wait_for};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The `COPY` sources of the Dockerfile's build stage (its first `FROM` up to the second).
fn build_stage_copies(dockerfile: &str) -> Vec<String> {
    let mut stage = 0;
    let mut out = Vec::new();
    for line in dockerfile.lines() {
        if line.starts_with("FROM ") {
            stage += 1;
        }
        if stage != 1 || !line.starts_with("COPY ") || line.contains("--from=") {
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().skip(1).collect();
        if let Some((_dst, sources)) = words.split_last() {
            out.extend(sources.iter().map(|s| s.trim_end_matches('/').to_owned()));
        }
    }
    out
}

/// The crates the binary is built from, as rustc names their artifacts.
const CRATES: [&str; 5] = [
    "quotad",
    "quotad_daemon",
    "quotad_core",
    "quotad_sim",
    "quotad_testkit",
];

/// The inputs listed on the first line of a dep-info file (`target: inputs`), as paths
/// relative to `root` (rustc writes workspace-relative paths, cargo absolute ones).
fn inputs_of(dep_info: &Path, root: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string(dep_info)
        .unwrap_or_else(|e| panic!("read {}: {e}", dep_info.display()));
    let (_, inputs) = text.split_once(": ").expect("dep-info is `target: inputs`");
    inputs
        .lines()
        .next()
        .unwrap_or_default()
        .replace("\\ ", "\u{0}")
        .split(' ')
        .filter(|p| !p.is_empty())
        .map(|p| PathBuf::from(p.replace('\u{0}', " ")))
        .filter_map(|p| match p.strip_prefix(root) {
            Ok(rel) => Some(rel.to_path_buf()),
            Err(_) if p.is_relative() => Some(p),
            Err(_) => None,
        })
        .collect()
}

/// The workspace files the binary is compiled from: cargo's dep-info beside it when
/// `cargo build` wrote one (every local crate's sources, `include_str!`'d Lua and the
/// build script's watched files), else the newest rustc dep-info of each workspace crate
/// in `deps/` (`cargo test --no-run`, as the suite builds, writes only those).
fn binary_inputs(bin: &Path, root: &Path) -> Vec<PathBuf> {
    let beside = bin.with_extension("d");
    if beside.exists() {
        return inputs_of(&beside, root);
    }
    let deps = bin.parent().expect("target/<profile>").join("deps");
    let files: Vec<PathBuf> = std::fs::read_dir(&deps)
        .unwrap_or_else(|e| panic!("list {}: {e}", deps.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    let mut out = Vec::new();
    for krate in CRATES {
        let newest = files
            .iter()
            .filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                    n.ends_with(".d")
                        && n.strip_prefix(krate)
                            .and_then(|rest| rest.strip_prefix('-'))
                            .is_some_and(|hash| !hash.contains('_'))
                })
            })
            .max_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
        if let Some(d) = newest {
            out.extend(inputs_of(d, root));
        }
    }
    out
}

#[test]
fn the_dockerfile_copies_every_file_the_binary_is_built_from() {
    let dockerfile = std::fs::read_to_string(root().join("deploy/container/Dockerfile"))
        .expect("read the Dockerfile");
    let copies = build_stage_copies(&dockerfile);
    for needed in [
        "Cargo.toml",
        "Cargo.lock",
        "build.rs",
        "deploy/container/rootfs.sh",
    ] {
        assert!(copies.iter().any(|c| c == needed), "{needed} is not copied");
    }
    let inputs = binary_inputs(&quotad_binary(), &root());
    assert!(
        inputs.iter().any(|p| p.ends_with("fixed_window.lua")),
        "the dep-info lists the Lua scripts: {inputs:?}"
    );
    // The build script watches the checkout's git refs for the revision; a container
    // build has no .git and gets the revision as a build argument instead.
    let missed: Vec<_> = inputs
        .iter()
        .filter(|p| !p.starts_with(".git"))
        .filter(|p| !copies.iter().any(|c| p.starts_with(c)))
        .collect();
    assert!(
        missed.is_empty(),
        "the build stage copies {copies:?} but the binary is also built from {missed:?}"
    );
}

fn podman_available() -> bool {
    Command::new("podman")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The daemon started from the image's root; killed when dropped.
struct Chrooted(Child);

impl Drop for Chrooted {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `quotad ARGS` from the image's root as the image's user (10001), as its ENTRYPOINT runs.
fn in_image(fs: &Path) -> Command {
    let mut c = Command::new("chroot");
    c.arg("--userspec=10001:10001")
        .arg(fs)
        .arg("/usr/local/bin/quotad");
    c
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn the_image_builds_from_local_files_and_serves_checks_from_its_own_root() {
    assert!(
        podman_available(),
        "podman not found: the image test builds the image with it. Install it with \
         `apt-get install -y podman` (or run `bash .ci/run`, which does)"
    );
    let uid =
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").expect("/proc/self"));
    assert_eq!(
        uid, 0,
        "the image test runs the image's root under chroot, which needs root"
    );
    let work = tempfile::tempdir().expect("tempdir");
    let fs = work.path().join("fs");
    let built = Command::new(root().join("deploy/container/build-local.sh"))
        .env("WORK", work.path())
        .env("EXPORT_TO", &fs)
        .env("QUOTAD_BINARY", quotad_binary())
        .env("TAG", "localhost/quotad:test")
        .stdin(Stdio::null())
        .output()
        .expect("run build-local.sh");
    let out = text(&built);
    assert!(built.status.success(), "build-local.sh failed:\n{out}");
    let size_line = out
        .lines()
        .find(|l| l.starts_with("image "))
        .expect("the size line");
    println!("{size_line} (this test's debug binary)");

    // The image: the user, the health check, the entry point.
    let inspect: Value = serde_json::from_str(
        &std::fs::read_to_string(work.path().join("image/inspect.json")).expect("inspect.json"),
    )
    .expect("inspect.json is JSON");
    let image = &inspect[0];
    assert_eq!(image["Config"]["User"], "10001:10001", "{image}");
    assert_eq!(image["Config"]["Entrypoint"][0], "/usr/local/bin/quotad");
    let health: Vec<&str> = image["Healthcheck"]["Test"]
        .as_array()
        .expect("a HEALTHCHECK")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        health,
        [
            "CMD",
            "/usr/local/bin/quotad",
            "healthcheck",
            "--config",
            "/etc/quotad/quotad.toml"
        ]
    );

    // Its root: the binary and what it loads, no shell.
    assert!(fs.join("usr/local/bin/quotad").exists());
    assert!(fs.join("etc/ssl/certs/ca-certificates.crt").exists());
    assert!(!fs.join("bin/sh").exists(), "the image has a shell");

    // The baked config validates from inside.
    let validated = in_image(&fs)
        .args(["validate", "/etc/quotad/quotad.toml"])
        .output()
        .expect("chroot validate");
    assert!(validated.status.success(), "{}", text(&validated));

    // A host name resolved inside the root (the runtime supplies /etc/hosts), a check
    // answered from a real Redis.
    let redis = RedisServer::start();
    let redis_port = redis
        .url()
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse::<u16>().ok())
        .expect("the Redis port");
    std::fs::write(
        fs.join("etc/hosts"),
        "127.0.0.1 localhost\n127.0.0.1 redis.test\n",
    )
    .expect("write /etc/hosts");
    let port = free_port();
    let baked = std::fs::read_to_string(fs.join("etc/quotad/quotad.toml")).expect("baked");
    let config = baked
        .replace(
            "listen = \"0.0.0.0:8686\"",
            &format!("listen = \"127.0.0.1:{port}\""),
        )
        .replace(
            "redis = \"memory\"",
            &format!("redis = \"redis://redis.test:{redis_port}\""),
        );
    assert!(
        config.contains("redis.test"),
        "the baked config names its store"
    );
    std::fs::write(fs.join("etc/quotad/test.toml"), config).expect("write test.toml");
    let log = work.path().join("quotad.log");
    let daemon = Chrooted(
        in_image(&fs)
            .args(["serve", "--config", "/etc/quotad/test.toml"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("chroot serve"),
    );
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_for(
        "the daemon in the image's root",
        Duration::from_secs(15),
        || matches!(http(port, "GET", "/readyz", None, ""), Ok((200, _, _))).then_some(()),
    );
    let (status, _, body) = http(
        port,
        "POST",
        "/v1/check",
        Some("application/json"),
        r#"{"policy":"default","key":"from-the-image"}"#,
    )
    .expect("check");
    assert_eq!(status, 200, "{body}\n{}", log_text());
    let answer: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(answer["allowed"], true, "{answer}");
    assert!(
        redis.keys().iter().any(|k| k.contains("from-the-image")),
        "the check reached Redis through redis.test: {:?}\n{}",
        redis.keys(),
        log_text()
    );

    // The image's health check, healthy and then not.
    let healthy = in_image(&fs)
        .args(["healthcheck", "--config", "/etc/quotad/test.toml"])
        .output()
        .expect("chroot healthcheck");
    assert!(healthy.status.success(), "{}", text(&healthy));
    drop(daemon);
    let down = in_image(&fs)
        .args(["healthcheck", "--config", "/etc/quotad/test.toml"])
        .output()
        .expect("chroot healthcheck");
    assert!(!down.status.success(), "healthy with no daemon");
    assert!(text(&down).contains("unhealthy"), "{}", text(&down));
}
