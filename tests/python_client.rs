//! The spec as a new user meets it: openapi-python-client (from PyPI, the version pinned
//! below) generates a Python client from docs/openapi.json without a warning, and that
//! client calls a live daemon: a check, a batch, an admin reset with and without its
//! token, the policies and the status, each parsed into the generated models.

use quotad_testkit as common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{ADMIN_TOKEN, Config, Policy, Quotad, RedisServer};

const GENERATOR: &str = "openapi-python-client==0.29.1";

/// A virtual environment with the generator, made once per target directory.
fn generator() -> PathBuf {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openapi-python-client-0.29.1");
    let bin = venv.join("bin/openapi-python-client");
    if !bin.exists() {
        let ok = |c: &mut Command| {
            let out = c.output().expect("python3");
            assert!(
                out.status.success(),
                "{c:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        ok(Command::new("python3").arg("-m").arg("venv").arg(&venv));
        ok(Command::new(venv.join("bin/pip")).args([
            "install",
            "-q",
            "--disable-pip-version-check",
            GENERATOR,
        ]));
    }
    venv
}

const CALLS: &str = r#"
import sys
from quotad_client import AuthenticatedClient, Client
from quotad_client.api.default import check, reset_key, list_policies, get_status, readyz
from quotad_client.api.default import set_runtime_limit, get_runtime_limit, list_runtime_limits, delete_runtime_limit
from quotad_client.models import Batch, Check, Decision, BatchDecision, Error, Policies, Reset, Status
from quotad_client.models import RuntimeLimit, RuntimeLimitWrite

url, token = sys.argv[1], sys.argv[2]
c = Client(base_url=url)
d = check.sync(client=c, body=Check(policy="api", key="alice", cost=2))
assert isinstance(d, Decision) and d.allowed and d.remaining == 8, d
b = check.sync(client=c, body=Batch(checks=[Check(policy="api", key="bob"), Check(policy="api", key="carol")]))
assert isinstance(b, BatchDecision) and b.allowed and len(b.results) == 2, b
r = reset_key.sync_detailed(client=c, body=Reset(policy="api", key="alice"))
assert r.status_code == 401 and isinstance(r.parsed, Error) and r.parsed.error.code == "unauthenticated", r
admin = AuthenticatedClient(base_url=url, token=token)
r = reset_key.sync_detailed(client=admin, body=Reset(policy="api", key="alice"))
assert r.status_code == 204, r
d = check.sync(client=c, body=Check(policy="api", key="alice", cost=0))
assert d.remaining == 10, d
p = list_policies.sync(client=c)
assert isinstance(p, Policies) and [x.name for x in p.policies] == ["api"], p
s = get_status.sync(client=c)
assert isinstance(s, Status) and s.region == "local" and s.peers == [], s
assert readyz.sync_detailed(client=c).status_code == 200
# A customer's own limit, set, read, listed and deleted through the admin operations.
r = set_runtime_limit.sync_detailed("api", "alice", client=c, body=RuntimeLimitWrite(limit=50))
assert r.status_code == 401, r
r = set_runtime_limit.sync_detailed("api", "alice", client=admin, body=RuntimeLimitWrite(limit=50))
assert r.status_code == 200 and r.parsed is not None and r.parsed.limit == 50, r
d = check.sync(client=c, body=Check(policy="api", key="alice", cost=0))
assert d.limit == 50 and d.limit_source == "runtime", d
got = get_runtime_limit.sync("api", "alice", client=admin)
assert isinstance(got, RuntimeLimit) and got.limit == 50 and got.expires_at is None, got
page = list_runtime_limits.sync("api", client=admin, count=10)
assert [x.key for x in page.limits] == ["alice"] and page.next_cursor is None, page
r = delete_runtime_limit.sync_detailed("api", "alice", client=admin)
assert r.status_code == 200, r
r = get_runtime_limit.sync_detailed("api", "alice", client=admin)
assert r.status_code == 404 and r.parsed.error.code == "no_runtime_limit", r
print("ok")
"#;

#[test]
fn a_generated_python_client_calls_a_live_daemon() {
    let venv = generator();
    let out_dir = tempfile::tempdir().unwrap();
    let hooks = out_dir.path().join("generator.yaml");
    std::fs::write(&hooks, "post_hooks: []\n").unwrap();
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/openapi.json");
    let target = out_dir.path().join("quotad_client");
    let generated = Command::new(venv.join("bin/openapi-python-client"))
        .arg("generate")
        .arg("--path")
        .arg(&spec)
        .args(["--meta", "none", "--config"])
        .arg(&hooks)
        .arg("--output-path")
        .arg(&target)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&generated.stdout),
        String::from_utf8_lossy(&generated.stderr)
    );
    assert!(generated.status.success(), "{said}");
    assert!(!said.contains("Warning"), "the generator warned:\n{said}");

    let redis = RedisServer::start();
    let q = Quotad::start(
        &Config::redis(&redis.url())
            .policy(Policy::new("api", "fixed_window", 10, "1h").runtime_limits(10))
            .to_toml(),
    );
    let run = Command::new(venv.join("bin/python"))
        .arg("-c")
        .arg(CALLS)
        .arg(q.url())
        .arg(ADMIN_TOKEN)
        .env("PYTHONPATH", out_dir.path())
        .output()
        .unwrap();
    assert!(
        run.status.success() && String::from_utf8_lossy(&run.stdout).trim() == "ok",
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}
