//! The shape of the crate (docs/architecture.md): layers, bottom up, and no
//! import from a lower layer into a higher one, nor a circle of modules.
//! Reads `src/` as text: every `crate::<module>` a file names is an import
//! of that top-level module.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module of `src/` and its layer, bottom up.
const LAYERS: &[(&str, u8)] = &[
    // The base: imports nothing above it.
    ("util", 0),
    ("error", 0),
    ("config", 0),
    ("metrics", 0),
    ("storage", 0),
    // Pure identity primitives (formats, signatures, grants).
    ("auth", 1),
    // The sandbox.
    ("wasm", 2),
    // The domain.
    ("namespace", 3),
    ("identity", 3),
    ("quota", 3),
    ("pubsub", 3),
    ("placement", 3),
    ("cluster", 3),
    ("functions", 3),
    ("deploy", 3),
    // The supervisors that own namespace state.
    ("actors", 4),
    // The chain, the routes, the sockets, the dashboard: alone map errors to statuses.
    ("http", 5),
    // Assembly: start-up and drain.
    ("node", 6),
    // The command line and the binary.
    ("cli", 7),
    ("cli_client", 7),
    ("main", 7),
    ("lib", 7),
];

/// The upward imports there are, each with why (docs/architecture.md,
/// "Exceptions"). A new one fails the test; one that is gone must be removed
/// here too, so the list stays true.
const ALLOWED_UPWARD: &[(&str, &str, &str)] = &[];

/// Module circles allowed (each a pair, explained in docs/architecture.md): the
/// CLI's command table and its HTTP client.
const ALLOWED_CIRCLES: &[&[&str]] = &[&["cli", "cli_client"]];

fn layer(module: &str) -> Option<u8> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|(_, l)| *l)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of `text` without its comments (`//` to the end of a line,
/// doc comments included): a doc link to another layer is not an import.
fn code_of(text: &str) -> String {
    text.lines()
        .map(|l| {
            // The first `//` outside a string (`"http://..."` is not a comment).
            let cut = l
                .match_indices("//")
                .map(|(i, _)| i)
                .find(|&i| l[..i].matches('"').count() % 2 == 0);
            cut.map_or(l, |i| &l[..i])
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `crate::<name>` in the code of `text` (identifier characters after `crate::`).
fn crate_refs(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let code = code_of(text);
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        // `$crate::` and `some_crate::` are not this crate.
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.insert(name);
        }
    }
    out
}

/// (file relative to `src/`, its top-level module, the modules it names).
fn imports() -> Vec<(String, String, BTreeSet<String>)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let rel = p.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
            let top = rel
                .split('/')
                .next()
                .unwrap()
                .trim_end_matches(".rs")
                .to_string();
            let refs = crate_refs(&std::fs::read_to_string(&p).unwrap());
            (rel, top, refs)
        })
        .collect()
}

#[test]
fn every_module_has_a_layer() {
    let mut missing = BTreeSet::new();
    for (rel, top, refs) in imports() {
        if layer(&top).is_none() {
            missing.insert(format!("{top} (file {rel})"));
        }
        for m in refs {
            if layer(&m).is_none() {
                missing.insert(format!("{m} (named in {rel})"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "modules without a layer in tests/architecture.rs: {missing:?}"
    );
}

#[test]
fn no_import_runs_upward() {
    let mut found = Vec::new();
    for (rel, top, refs) in imports() {
        let (Some(own), false) = (layer(&top), top == "lib") else {
            continue;
        };
        for m in refs {
            if layer(&m).is_some_and(|l| l > own) {
                found.push((rel.clone(), m));
            }
        }
    }
    let unexplained: Vec<_> = found
        .iter()
        .filter(|(f, m)| !ALLOWED_UPWARD.iter().any(|(af, am, _)| af == f && am == m))
        .collect();
    assert!(
        unexplained.is_empty(),
        "imports from a lower layer into a higher one (move the code, or explain the exception in ALLOWED_UPWARD and docs/architecture.md): {unexplained:?}"
    );
    let stale: Vec<_> = ALLOWED_UPWARD
        .iter()
        .filter(|(af, am, _)| !found.iter().any(|(f, m)| f == af && m == am))
        .collect();
    assert!(
        stale.is_empty(),
        "exceptions in ALLOWED_UPWARD that no longer exist (remove them): {stale:?}"
    );
}

#[test]
fn crate_http_is_named_only_by_http_and_the_assembly() {
    let outside: Vec<_> = imports()
        .into_iter()
        .filter(|(_, top, refs)| {
            refs.contains("http") && !matches!(top.as_str(), "http" | "node" | "lib")
        })
        .map(|(rel, ..)| rel)
        .collect();
    assert!(
        outside.is_empty(),
        "crate::http named outside src/http/ and src/node.rs: {outside:?}"
    );
}

/// Strongly connected components of the module graph (Tarjan), larger than one.
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        t.index.insert(v, t.next);
        t.low.insert(v, t.next);
        t.next += 1;
        t.stack.push(v);
        t.on.insert(v);
        if let Some(ws) = t.g.get(v) {
            for w in ws {
                let w = w.as_str();
                if !t.g.contains_key(w) {
                    continue;
                }
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let l = t.low[v].min(t.low[w]);
                    t.low.insert(v, l);
                } else if t.on.contains(w) {
                    let l = t.low[v].min(t.index[w]);
                    t.low.insert(v, l);
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut c = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                c.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if c.len() > 1 {
                c.sort();
                t.out.push(c);
            }
        }
    }
    let mut t = T {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn no_circle_of_modules() {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (_, top, refs) in imports() {
        if top == "lib" || top == "main" {
            continue;
        }
        let e = graph.entry(top.clone()).or_default();
        e.extend(refs.into_iter().filter(|m| *m != top));
    }
    let bad: Vec<_> = circles(&graph)
        .into_iter()
        .filter(|c| !ALLOWED_CIRCLES.iter().any(|a| a.iter().eq(c.iter())))
        .collect();
    assert!(bad.is_empty(), "circles of modules: {bad:?}");
}

#[test]
fn the_checker_finds_what_it_looks_for() {
    // The parts the tests above rely on, on known input.
    let refs = crate_refs(
        "use crate::http::ApiError; $crate::x; my_crate::y; crate::util::now()\n\
         /// see [`crate::node::start`]\n\
         let u = \"http://h/\"; crate::error::x(); // crate::actors::y",
    );
    assert_eq!(
        refs,
        ["error", "http", "util"]
            .into_iter()
            .map(String::from)
            .collect()
    );
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(circles(&g), vec![vec!["a", "b", "c"]]);
}
