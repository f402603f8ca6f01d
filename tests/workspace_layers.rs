//! The crate layers of ARCHITECTURE.md, checked against `cargo metadata`.
//!
//! Every workspace crate has a layer ([`LAYERS`], the numbers of ARCHITECTURE.md's crate table;
//! `bin` is the top). A normal or build dependency of one workspace crate on another may point
//! down the layers or stay within one, never up. Dev-dependencies are not checked: they link
//! only into tests. On top of the layers, a few crates must never link each other by any path
//! ([`NEVER_LINKS`]), and `omni-ipc` depends on no workspace crate at all, not even in tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::process::Command;

/// ARCHITECTURE.md's crate table: each workspace crate and its layer (0 = L0, ...; 5 = bin).
const LAYERS: &[(&str, u8)] = &[
    ("omni-cache", 0),
    ("omni-ipc", 0),
    ("omni-protocol", 0),
    ("omni-config", 1),
    ("omni-backend", 1),
    ("omni-gguf", 1),
    ("omni-tokenizer", 1),
    ("omni-mm", 1),
    ("omni-tts", 2),
    ("omni-models", 2),
    ("omni-core", 2),
    ("omni-worker", 3),
    ("omni-launch", 3),
    ("omni-stage", 3),
    ("omni-server", 4),
    ("omni-bench", 4),
    ("omni-engine", 5),
];

/// Crates that must not link the listed ones, directly or through any other crate, with the
/// reason (normal and build dependencies).
const NEVER_LINKS: &[(&str, &[&str], &str)] = &[
    (
        "omni-server",
        &[
            "omni-core",
            "omni-models",
            "omni-backend",
            "omni-worker",
            "omni-launch",
            "omni-stage",
        ],
        "the server never links engine, model or GPU code: that boundary is a process boundary",
    ),
    (
        "omni-core",
        &["omni-models", "omni-backend"],
        "the engine core has no model or device code",
    ),
    (
        "omni-worker",
        &["omni-core"],
        "a worker talks to the engine core only over omni-ipc; its tests may use omni-core",
    ),
];

/// Crates that depend on no workspace crate, of any kind.
const NO_WORKSPACE_DEPS: &[&str] = &["omni-ipc"];

/// One dependency of a workspace crate on another: (to, kind), kind as cargo names it
/// ("normal", "dev", "build").
type Edges = BTreeMap<String, Vec<(String, String)>>;

/// Each workspace crate's dependencies on other workspace crates, from
/// `cargo metadata --format-version 1 --no-deps`.
fn workspace_edges() -> Edges {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../../Cargo.toml");
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--manifest-path",
        ])
        .arg(manifest)
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let packages = meta["packages"].as_array().expect("packages");
    let names: BTreeSet<String> = packages
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    packages
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter_map(|d| {
                    let to = d["name"].as_str()?;
                    names.contains(to).then(|| {
                        let kind = d["kind"].as_str().unwrap_or("normal");
                        (to.to_string(), kind.to_string())
                    })
                })
                .collect();
            (p["name"].as_str().unwrap().to_string(), deps)
        })
        .collect()
}

fn layer(name: &str) -> Option<u8> {
    LAYERS.iter().find(|(n, _)| *n == name).map(|&(_, l)| l)
}

fn label(layer: u8) -> String {
    if layer == 5 {
        "bin".into()
    } else {
        format!("L{layer}")
    }
}

/// Normal and build edges only: what a crate links outside its tests.
fn links(edges: &Edges, from: &str) -> Vec<String> {
    edges
        .get(from)
        .into_iter()
        .flatten()
        .filter(|(_, kind)| kind != "dev")
        .map(|(to, _)| to.clone())
        .collect()
}

/// The path `from -> ... -> to` over linked edges, if there is one.
fn link_path(edges: &Edges, from: &str, to: &str) -> Option<Vec<String>> {
    let mut parent: BTreeMap<String, String> = BTreeMap::new();
    let mut queue = VecDeque::from([from.to_string()]);
    while let Some(at) = queue.pop_front() {
        for next in links(edges, &at) {
            if next == from || parent.contains_key(&next) {
                continue;
            }
            parent.insert(next.clone(), at.clone());
            if next == to {
                let mut path = vec![next];
                while let Some(p) = parent.get(path.last().unwrap()) {
                    path.push(p.clone());
                }
                path.reverse();
                return Some(path);
            }
            queue.push_back(next);
        }
    }
    None
}

#[test]
fn every_workspace_crate_has_a_layer() {
    let edges = workspace_edges();
    let members: BTreeSet<&str> = edges.keys().map(String::as_str).collect();
    let listed: BTreeSet<&str> = LAYERS.iter().map(|&(n, _)| n).collect();
    let missing: Vec<_> = members.difference(&listed).collect();
    let stale: Vec<_> = listed.difference(&members).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "workspace crates without a layer: {missing:?}; layers of crates that are gone: \
         {stale:?} (update LAYERS here and the crate table of ARCHITECTURE.md)"
    );
}

#[test]
fn workspace_dependencies_point_down_the_layers() {
    let edges = workspace_edges();
    let mut up = Vec::new();
    for from in edges.keys() {
        let Some(lf) = layer(from) else { continue };
        for to in links(&edges, from) {
            let Some(lt) = layer(&to) else { continue };
            if lt > lf {
                up.push(format!("{from} ({}) -> {to} ({})", label(lf), label(lt)));
            }
        }
    }
    assert!(
        up.is_empty(),
        "dependencies that point up the layers of ARCHITECTURE.md's crate table:\n  {}",
        up.join("\n  ")
    );
}

#[test]
fn process_boundaries_are_not_linked() {
    let edges = workspace_edges();
    let mut broken = Vec::new();
    for &(from, forbidden, why) in NEVER_LINKS {
        assert!(edges.contains_key(from), "{from} is not a workspace crate");
        for &to in forbidden {
            if let Some(path) = link_path(&edges, from, to) {
                broken.push(format!("{} ({why})", path.join(" -> ")));
            }
        }
    }
    for &from in NO_WORKSPACE_DEPS {
        for (to, kind) in edges.get(from).into_iter().flatten() {
            broken.push(format!(
                "{from} -> {to} ({kind}: {from} depends on no workspace crate)"
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "forbidden links:\n  {}",
        broken.join("\n  ")
    );
}

#[test]
fn architecture_md_crate_table_matches_the_layers() {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../ARCHITECTURE.md"
    ))
    .unwrap();
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with("Crates"))
        .expect("ARCHITECTURE.md has a `## Crates` section");
    let mut table = BTreeMap::new();
    for row in section.lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let (Some(&level), Some(&name)) = (cells.get(1), cells.get(2)) else {
            continue;
        };
        let level = match level {
            "bin" => 5,
            l => match l.strip_prefix('L').and_then(|n| n.parse::<u8>().ok()) {
                Some(n) => n,
                None => continue, // the header and separator rows
            },
        };
        let name = name
            .split('`')
            .nth(1)
            .expect("crate names are in backticks");
        table.insert(name.to_string(), level);
    }
    let layers: BTreeMap<String, u8> = LAYERS.iter().map(|&(n, l)| (n.into(), l)).collect();
    assert_eq!(
        table, layers,
        "ARCHITECTURE.md's crate table (left) and this test's LAYERS (right) differ"
    );
}
