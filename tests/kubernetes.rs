//! deploy/kubernetes, rendered and checked: every overlay renders; its selectors match the
//! pods' labels; every named port a Service, NetworkPolicy or ServiceMonitor uses is a
//! container port; the probes ask routes the daemon serves (asked of a live one); the
//! embedded config passes `quotad validate` (its secret files given), listens on the
//! container ports, finds its secrets under the Secret's mount, and fits the grace period.
//!
//! Rendering: `kubectl kustomize` when kubectl is on PATH (kustomize v5: components). Debian
//! ships no kubectl new enough, so without one the test renders with `render` below, which
//! implements the kustomize features these files use (resources, components,
//! configMapGenerator with `behavior: replace`, `labels`); where kubectl exists the two
//! renderings must be equal, which keeps the fallback honest.

use quotad_testkit as common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Map, Value, json};
use yaml_rust2::{Yaml, YamlLoader};

const OVERLAYS: [&str; 5] = [
    "single-redis",
    "sentinel",
    "three-regions/eu",
    "three-regions/us",
    "three-regions/ap",
];

fn kube() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes")
}

fn to_json(y: &Yaml) -> Value {
    match y {
        Yaml::Real(s) => s.parse::<f64>().map_or(Value::Null, |f| json!(f)),
        Yaml::Integer(i) => json!(i),
        Yaml::String(s) => json!(s),
        Yaml::Boolean(b) => json!(b),
        Yaml::Array(a) => Value::Array(a.iter().map(to_json).collect()),
        Yaml::Hash(h) => Value::Object(
            h.iter()
                .map(|(k, v)| {
                    (
                        k.as_str().map_or_else(|| format!("{k:?}"), str::to_owned),
                        to_json(v),
                    )
                })
                .collect(),
        ),
        _ => Value::Null,
    }
}

fn load(text: &str) -> Vec<Value> {
    YamlLoader::load_from_str(text)
        .expect("valid YAML")
        .iter()
        .map(to_json)
        .filter(|v| !v.is_null())
        .collect()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The objects a kustomization directory yields, for the features these files use.
fn render(dir: &Path) -> Vec<Value> {
    let k = &load(&read(&dir.join("kustomization.yaml")))[0];
    let mut objects = Vec::new();
    let entries = |key: &str| -> Vec<String> {
        k[key]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect()
    };
    for r in entries("resources").iter().chain(&entries("components")) {
        let path = dir.join(r);
        if path.is_dir() {
            objects.extend(render(&path));
        } else {
            objects.extend(load(&read(&path)));
        }
    }
    for g in k["configMapGenerator"].as_array().into_iter().flatten() {
        let mut data = Map::new();
        for f in g["files"].as_array().into_iter().flatten() {
            let f = f.as_str().expect("a file name");
            data.insert(f.to_owned(), json!(read(&dir.join(f))));
        }
        let mut cm = json!({"apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": g["name"]}, "data": data});
        // `behavior: replace` takes the data and keeps what the base's transformers did to
        // the object (its labels).
        if let Some(at) = objects
            .iter()
            .position(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == g["name"])
        {
            cm["metadata"] = objects.remove(at)["metadata"].clone();
        }
        objects.push(cm);
    }
    for l in k["labels"].as_array().into_iter().flatten() {
        for o in &mut objects {
            for (key, v) in l["pairs"].as_object().into_iter().flatten() {
                o["metadata"]["labels"][key] = v.clone();
            }
        }
    }
    objects
}

/// `kubectl kustomize DIR`, when kubectl is on PATH.
fn kubectl_kustomize(dir: &Path) -> Option<Vec<Value>> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .ok()?;
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(load(&String::from_utf8_lossy(&out.stdout)))
}

/// Objects by (kind, name), for comparing two renderings whatever their order.
fn by_name(objects: &[Value]) -> BTreeMap<(String, String), Value> {
    objects
        .iter()
        .map(|o| {
            let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            ((s(&o["kind"]), s(&o["metadata"]["name"])), o.clone())
        })
        .collect()
}

fn one<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = objects.iter().filter(|o| o["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind}");
    found[0]
}

/// Whether every label `selector` asks for is among `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|s| !s.is_empty() && s.iter().all(|(k, v)| labels[k] == *v))
}

/// Problems of one rendered overlay, with `probe_ok` telling whether a path is a route
/// the daemon answers 200 on.
fn problems(objects: &[Value], probe_ok: &dyn Fn(&str) -> bool) -> Vec<String> {
    let mut out = Vec::new();
    let dep = one(objects, "Deployment");
    let pod_labels = &dep["spec"]["template"]["metadata"]["labels"];
    let container = &dep["spec"]["template"]["spec"]["containers"][0];
    let ports: BTreeMap<String, i64> = container["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            (
                p["name"].as_str().unwrap_or("").to_owned(),
                p["containerPort"].as_i64().unwrap_or(0),
            )
        })
        .collect();
    let port_known = |p: &Value| match p {
        Value::String(name) => ports.contains_key(name),
        Value::Number(n) => ports.values().any(|v| Some(*v) == n.as_i64()),
        _ => false,
    };
    if !selects(&dep["spec"]["selector"]["matchLabels"], pod_labels) {
        out.push("the Deployment's selector does not match its pods".into());
    }
    for o in objects {
        let kind = o["kind"].as_str().unwrap_or("?");
        let selector = match kind {
            "Service" => &o["spec"]["selector"],
            "PodDisruptionBudget" => &o["spec"]["selector"]["matchLabels"],
            "NetworkPolicy" => &o["spec"]["podSelector"]["matchLabels"],
            _ => continue,
        };
        if !selects(selector, pod_labels) {
            out.push(format!(
                "{kind} {}: its selector matches no pod",
                o["metadata"]["name"]
            ));
        }
    }
    let svc = one(objects, "Service");
    for p in svc["spec"]["ports"].as_array().into_iter().flatten() {
        if !port_known(&p["targetPort"]) {
            out.push(format!(
                "Service targetPort {} is no container port",
                p["targetPort"]
            ));
        }
    }
    for np in objects.iter().filter(|o| o["kind"] == "NetworkPolicy") {
        for rule in np["spec"]["ingress"].as_array().into_iter().flatten() {
            for p in rule["ports"].as_array().into_iter().flatten() {
                if !port_known(&p["port"]) {
                    out.push(format!(
                        "NetworkPolicy ingress port {} is no container port",
                        p["port"]
                    ));
                }
            }
        }
    }
    for sm in objects.iter().filter(|o| o["kind"] == "ServiceMonitor") {
        if !selects(
            &sm["spec"]["selector"]["matchLabels"],
            &svc["metadata"]["labels"],
        ) {
            out.push("the ServiceMonitor selects no Service".into());
        }
        for e in sm["spec"]["endpoints"].as_array().into_iter().flatten() {
            let named = svc["spec"]["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| p["name"] == e["port"]);
            if !named || !probe_ok(e["path"].as_str().unwrap_or("")) {
                out.push(format!(
                    "ServiceMonitor endpoint {e} is no Service port or route"
                ));
            }
        }
    }
    for probe in ["readinessProbe", "livenessProbe"] {
        let get = &container[probe]["httpGet"];
        if !port_known(&get["port"]) || !probe_ok(get["path"].as_str().unwrap_or("")) {
            out.push(format!("{probe} {get} is no container port or route"));
        }
    }
    out
}

#[test]
fn every_overlay_renders_and_its_parts_fit_together() {
    // The routes the probes and the ServiceMonitor ask, asked of a live daemon.
    let daemon = common::Quotad::serve(
        "[store]\nredis = \"memory\"\n[[policy]]\nname = \"p\"\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1s\"\n",
    );
    let probe_ok = |path: &str| matches!(daemon.try_get(path), Some((200, _)));
    let secrets = tempfile::tempdir().expect("tempdir");
    for (name, content) in [
        ("redis-password", "a-password\n"),
        ("peer-secret", "0123456789abcdef0123456789abcdef\n"),
    ] {
        std::fs::write(secrets.path().join(name), content).expect("write a secret");
    }
    let kubectl = Command::new("kubectl")
        .arg("version")
        .arg("--client")
        .output()
        .is_ok_and(|o| o.status.success());
    if !kubectl {
        println!("kubectl not on PATH: rendering with the test's own kustomize subset");
    }
    let mut failures = Vec::new();
    for overlay in OVERLAYS {
        let dir = kube().join("overlays").join(overlay);
        let ours = render(&dir);
        let objects = match kubectl_kustomize(&dir) {
            Some(theirs) => {
                assert_eq!(
                    by_name(&ours),
                    by_name(&theirs),
                    "{overlay}: the fallback renders otherwise"
                );
                theirs
            }
            None => ours,
        };
        failures.extend(
            problems(&objects, &probe_ok)
                .into_iter()
                .map(|p| format!("{overlay}: {p}")),
        );

        // The config: valid with its secrets in place, on the container's ports, its
        // secret files under the Secret's mount, drained within the grace period.
        let dep = one(&objects, "Deployment");
        let pod = &dep["spec"]["template"]["spec"];
        let mount = pod["containers"][0]["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| m["name"] == "secrets")
            .and_then(|m| m["mountPath"].as_str())
            .expect("a secrets mount");
        let toml = one(&objects, "ConfigMap")["data"]["quotad.toml"]
            .as_str()
            .expect("quotad.toml")
            .to_owned();
        let local = toml.replace(
            &format!("{mount}/"),
            &format!("{}/", secrets.path().display()),
        );
        assert_ne!(
            local, toml,
            "{overlay}: the config reads no secret from {mount}"
        );
        let path = secrets.path().join("quotad.toml");
        std::fs::write(&path, &local).expect("write the config");
        let out = Command::new(env!("CARGO_BIN_EXE_quotad"))
            .arg("validate")
            .arg(&path)
            .output()
            .expect("validate");
        assert!(
            out.status.success(),
            "{overlay}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let settings = quotad_daemon::Settings::load(&path).expect("valid");
        let container_port = |name: &str| {
            pod["containers"][0]["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["name"] == name)
                .and_then(|p| p["containerPort"].as_u64())
        };
        let port_of = |e: &quotad_daemon::Endpoint| match e {
            quotad_daemon::Endpoint::Tcp(a) if a.ip().is_unspecified() => Some(u64::from(a.port())),
            _ => None,
        };
        if port_of(settings.listen()) != container_port("http") {
            failures.push(format!(
                "{overlay}: listen {} is not 0.0.0.0 on the http port",
                settings.listen()
            ));
        }
        if settings.grpc_listen().and_then(port_of) != container_port("grpc") {
            failures.push(format!(
                "{overlay}: grpc_listen is not 0.0.0.0 on the grpc port"
            ));
        }
        let grace = Duration::from_secs(pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(0));
        let drain = settings.longest_stop();
        if grace <= drain {
            failures.push(format!(
                "{overlay}: grace {grace:?} does not exceed the drain {drain:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The checks find what they look for: a Service whose selector matches no pod, a probe
/// on a path the daemon does not serve.
#[test]
fn the_checks_catch_a_wrong_selector_and_a_wrong_probe() {
    let mut objects = render(&kube().join("overlays/single-redis"));
    assert!(
        problems(&objects, &|p| p == "/healthz"
            || p == "/readyz"
            || p == "/metrics")
        .is_empty()
    );
    for o in &mut objects {
        if o["kind"] == "Service" {
            o["spec"]["selector"] = json!({"app.kubernetes.io/name": "quotd"});
        }
        if o["kind"] == "Deployment" {
            o["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["path"] =
                json!("/health");
        }
    }
    let found = problems(&objects, &|p| {
        p == "/healthz" || p == "/readyz" || p == "/metrics"
    });
    assert_eq!(found.len(), 2, "{found:?}");
}
