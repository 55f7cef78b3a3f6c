//! The layering the code is built on, checked: the pure core crate depends on no runtime,
//! network or Redis crate, the simulator only on the core, inside every crate the
//! top-level modules import each other without a cycle (the data flows one way), and in
//! the core and the daemon no file imports a file that imports it back, directly or
//! around a circle. Run with
//! `--no-capture` to see each crate's module graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// The names in a manifest's `[dependencies]` table (not dev- or build-dependencies).
fn dependencies(manifest: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(manifest).expect("read Cargo.toml");
    let mut deps = BTreeSet::new();
    let mut inside = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == "[dependencies]";
            continue;
        }
        if inside && !line.is_empty() && !line.starts_with('#') {
            let name = line.split(['=', '.', ' ']).next().unwrap_or("");
            deps.insert(name.trim().to_owned());
        }
    }
    deps
}

#[test]
fn the_core_crate_depends_on_no_runtime_network_or_redis_crate() {
    let deps = dependencies(&root().join("crates/core/Cargo.toml"));
    assert!(
        deps.contains("serde"),
        "the manifest was not read: {deps:?}"
    );
    for banned in [
        "tokio",
        "tokio-util",
        "hyper",
        "hyper-util",
        "axum",
        "redis",
        "reqwest",
        "quotad-daemon",
        "quotad-sim",
        "quotad-testkit",
    ] {
        assert!(!deps.contains(banned), "quotad-core depends on {banned}");
    }
}

#[test]
fn the_simulator_drives_the_core_and_nothing_of_the_daemon() {
    let deps = dependencies(&root().join("crates/sim/Cargo.toml"));
    assert!(deps.contains("quotad-core"), "{deps:?}");
    for banned in [
        "quotad-daemon",
        "quotad-testkit",
        "tokio",
        "redis",
        "reqwest",
    ] {
        assert!(!deps.contains(banned), "quotad-sim depends on {banned}");
    }
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).expect("read dir").flatten() {
            let p = entry.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The top-level module a file belongs to (`store/redis.rs` → `store`); None for the
/// crate root.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_string_lossy();
    let name = first.trim_end_matches(".rs");
    (name != "lib" && name != "main").then(|| name.to_owned())
}

/// Edges `module → module it names`: through `crate::…`, or `super::…` in a file whose
/// parent is the crate root (`src/x.rs`, `src/x/mod.rs`). Comments are left out (a doc
/// link is not an import), and so are names that are not modules (`crate::some_fn`).
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let files = sources(src);
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_of(src, f)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let Some(from) = module_of(src, &file) else {
            continue;
        };
        let rel = file.strip_prefix(src).expect("under src");
        let top_level = rel.components().count() == 1 || rel.ends_with("mod.rs");
        let mut roots = vec!["crate::"];
        if top_level {
            roots.push("super::");
        }
        let text = std::fs::read_to_string(&file).expect("read source");
        let targets = graph.entry(from.clone()).or_default();
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for root in &roots {
                for (at, _) in line.match_indices(root) {
                    // `quotad_core::…` and friends contain `crate::` too: skip them.
                    if line[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                        continue;
                    }
                    let to: String = line[at + root.len()..]
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if modules.contains(&to) && to != from {
                        targets.insert(to);
                    }
                }
            }
        }
    }
    graph
}

/// A cycle in `graph`, if there is one (depth-first search, white/grey/black).
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == node) {
            let mut cycle = path[i..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, done, path) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut done, &mut Vec::new()))
}

#[test]
fn no_module_imports_a_module_that_imports_it_back() {
    for krate in [
        "crates/core",
        "crates/daemon",
        "crates/sim",
        "crates/testkit",
    ] {
        let graph = module_graph(&root().join(krate).join("src"));
        assert!(graph.len() >= 2, "{krate}: no modules found");
        println!("{krate}:");
        for (from, to) in &graph {
            let to: Vec<&str> = to.iter().map(String::as_str).collect();
            println!("  {from} -> {}", to.join(", "));
        }
        if let Some(cycle) = find_cycle(&graph) {
            panic!("{krate}: import cycle {}", cycle.join(" -> "));
        }
    }
}

/// A source file's module path (`store/redis.rs` → `store::redis`, `store/mod.rs` →
/// `store`, `lib.rs` → the crate root, ``).
fn module_path(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| {
            c.as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_owned()
        })
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts.join("::")
}

/// The paths a `use` tree names, its braces expanded (`a::{b, c::d}` → `a::b`, `a::c::d`).
fn use_paths(tree: &str) -> Vec<String> {
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let Some(open) = tree.find('{') else {
        return vec![tree];
    };
    let (prefix, inner) = (&tree[..open], &tree[open + 1..tree.len() - 1]);
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.is_empty())
        .flat_map(|p| use_paths(&format!("{prefix}{p}")))
        .collect()
}

/// Edges `file → file it imports` inside one crate, through `use` trees and inline
/// `crate::…`/`super::…` paths (a child module's own name, `mod x;` in the file, counts
/// too). A module's file naming its own descendants is how Rust declares them, not an
/// import back: those edges are left out, so a parent and its children form no circle.
fn file_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let files = sources(src);
    let by_module: BTreeMap<String, String> = files
        .iter()
        .map(|f| {
            let rel = f.strip_prefix(src).unwrap().to_string_lossy().into_owned();
            (module_path(src, f), rel)
        })
        .collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let here = module_path(src, file);
        let rel = file
            .strip_prefix(src)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let text: String = std::fs::read_to_string(file)
            .expect("read source")
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let children: BTreeSet<String> = text
            .lines()
            .filter_map(|l| {
                let l = l.trim_start().trim_start_matches("pub ");
                let name = l.strip_prefix("mod ")?.strip_suffix(';')?;
                Some(name.to_owned())
            })
            .collect();
        let mut paths: Vec<String> = Vec::new();
        for (at, _) in text.match_indices("use ") {
            if text[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let stmt = &text[at + 4..];
            if let Some(end) = stmt.find(';') {
                paths.extend(use_paths(&stmt[..end]));
            }
        }
        for root in ["crate::", "super::"] {
            for (at, _) in text.match_indices(root) {
                if text[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
                    continue;
                }
                let path: String = text[at..]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                paths.push(path);
            }
        }
        let targets = graph.entry(rel.clone()).or_default();
        for path in paths {
            let mut segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
            let mut base: Vec<String> = if here.is_empty() {
                Vec::new()
            } else {
                here.split("::").map(str::to_owned).collect()
            };
            match segs.first().copied() {
                Some("crate") => {
                    base.clear();
                    segs.remove(0);
                }
                Some("super") => {
                    while segs.first() == Some(&"super") {
                        base.pop();
                        segs.remove(0);
                    }
                }
                Some("self") => {
                    segs.remove(0);
                }
                Some(first) if children.contains(first) => {}
                _ => continue,
            }
            let mut full = base;
            full.extend(segs.iter().map(|s| s.to_string()));
            // The longest prefix that is a module with a file of its own.
            let to = (0..=full.len())
                .rev()
                .find_map(|n| by_module.get(&full[..n].join("::")));
            let Some(to) = to else { continue };
            let to_module = module_path(src, &src.join(to));
            let descendant = here.is_empty() || to_module.starts_with(&format!("{here}::"));
            if *to != rel && !descendant {
                targets.insert(to.clone());
            }
        }
    }
    graph
}

#[test]
fn no_file_imports_a_file_that_imports_it_back() {
    for krate in ["crates/core", "crates/daemon"] {
        let graph = file_graph(&root().join(krate).join("src"));
        assert!(
            graph.values().map(BTreeSet::len).sum::<usize>() >= 20,
            "{krate}: no imports found"
        );
        if let Some(cycle) = find_cycle(&graph) {
            panic!("{krate}: files in a circle {}", cycle.join(" -> "));
        }
    }
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    assert_eq!(find_cycle(&g), None);
    g.entry("c".into()).or_default().insert("a".into());
    assert_eq!(
        find_cycle(&g),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
}

/// The crates the `quotad` binary links with these features, as `cargo tree` resolves them.
fn linked_crates(features: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO"))
        .current_dir(root())
        .args([
            "tree",
            "--locked",
            "--offline",
            "-p",
            "quotad",
            "-e",
            "normal",
        ])
        .args(["--prefix", "none", "--format", "{p}"])
        .args(features.iter().flat_map(|f| ["--features", f]))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_shipped_binary_links_no_test_kit_and_the_demo_feature_brings_it() {
    let shipped = linked_crates(&[]);
    assert!(shipped.contains("quotad-daemon"), "{shipped}");
    assert!(
        !shipped.contains("quotad-testkit"),
        "`cargo build --release` links the test kit"
    );
    assert!(linked_crates(&["demo"]).contains("quotad-testkit"));
}
