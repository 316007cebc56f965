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
    ("observe", 0),
    ("telemetry", 0),
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

// ---------------------------------------------------------------------------
// Files inside a folder (issue #43): the layers above are between top-level
// modules; inside `http/`, `deploy/`, `wasm/` and `actors/` the same rule
// holds between files, with circles of at most two files (a module and the
// one file it is written beside). `src/` is parsed with `syn`: every path a
// file names (`use` trees, expressions, types, patterns) is resolved
// against the module tree (`crate::`, `super::`, `self::`, a child module,
// a name brought in by `use`) to the file that defines the longest module
// prefix of it. Paths inside macro calls are not seen.

/// The folders whose files must not form a circle of more than two.
const FILE_CIRCLE_FOLDERS: &[&str] = &["http", "deploy", "wasm", "actors"];

/// The largest circle allowed inside a folder.
const MAX_FILE_CIRCLE: usize = 2;

/// Folders still being untangled: their circles are printed, not refused.
/// A folder leaves this list when its last circle is gone (the test says so).
const FILE_CIRCLES_NOT_YET: &[&str] = &[];

/// Module path (`["http", "chain", "access"]`) of every file of `src/`, and back.
fn module_files() -> BTreeMap<Vec<String>, String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut out = BTreeMap::new();
    for p in files {
        let rel = p.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
        if rel == "main.rs" {
            continue; // the binary: its `crate::` is another crate
        }
        let mut segs: Vec<String> = rel
            .trim_end_matches(".rs")
            .split('/')
            .map(String::from)
            .collect();
        if segs.last().is_some_and(|s| s == "mod" || s == "lib") {
            segs.pop();
        }
        out.insert(segs, rel);
    }
    out
}

/// What one file names, as absolute module paths.
struct FileRefs {
    /// The module the visitor is in (the file's, then inline `mod x { }`s).
    here: Vec<String>,
    /// Child modules declared at each inline depth (`mod x;`, `mod x { }`).
    children: Vec<BTreeSet<String>>,
    /// Names brought in by `use`, per inline depth: alias -> absolute path.
    aliases: Vec<BTreeMap<String, Vec<String>>>,
    out: Vec<Vec<String>>,
}

impl FileRefs {
    /// The absolute path of `segs` as written in the current module, if it
    /// is a path into this crate.
    fn resolve(&self, segs: &[String]) -> Option<Vec<String>> {
        let first = segs.first()?;
        let mut base = self.here.clone();
        let mut rest = segs;
        match first.as_str() {
            "crate" => {
                base.clear();
                rest = &segs[1..];
            }
            "self" => rest = &segs[1..],
            "super" => {
                while rest.first().is_some_and(|s| s == "super") {
                    base.pop()?;
                    rest = &rest[1..];
                }
            }
            name => {
                let depth = self.children.len() - 1;
                if self.children[depth].contains(name) {
                    // a child module: `base` stays
                } else if let Some(abs) = self.aliases[depth].get(name) {
                    base = abs.clone();
                    rest = &segs[1..];
                } else {
                    return None;
                }
            }
        }
        base.extend(rest.iter().cloned());
        Some(base)
    }

    fn note(&mut self, segs: &[String]) {
        if let Some(abs) = self.resolve(segs) {
            self.out.push(abs);
        }
    }

    /// Expand a `use` tree: every leaf path, and the alias it binds.
    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => self.use_leaf(prefix, &n.ident.to_string(), None),
            syn::UseTree::Rename(r) => {
                self.use_leaf(prefix, &r.ident.to_string(), Some(r.rename.to_string()))
            }
            syn::UseTree::Glob(_) => {
                let p = prefix.clone();
                self.note(&p);
            }
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t);
                }
            }
        }
    }

    fn use_leaf(&mut self, prefix: &[String], name: &str, alias: Option<String>) {
        let mut path = prefix.to_vec();
        if name != "self" || path.is_empty() {
            path.push(name.to_string());
        }
        if let Some(abs) = self.resolve(&path) {
            let bound = alias.unwrap_or_else(|| path.last().unwrap().clone());
            let depth = self.aliases.len() - 1;
            self.aliases[depth].insert(bound, abs.clone());
            self.out.push(abs);
        }
    }
}

impl<'ast> syn::visit::Visit<'ast> for FileRefs {
    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &u.tree);
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        let Some((_, items)) = &m.content else {
            return; // `mod x;`: a declaration, not an import
        };
        self.here.push(m.ident.to_string());
        self.children.push(BTreeSet::new());
        self.aliases.push(BTreeMap::new());
        self.declare(items);
        for i in items {
            self.visit_item(i);
        }
        self.here.pop();
        self.children.pop();
        self.aliases.pop();
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        let segs: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
        if segs.len() > 1 || segs.first().is_some_and(|s| s == "self" || s == "super") {
            self.note(&segs);
        }
        syn::visit::visit_path(self, p);
    }
}

impl FileRefs {
    /// The child modules and `use` aliases of one module's items, before its
    /// paths are resolved (a `use` may come after the path that needs it).
    fn declare(&mut self, items: &[syn::Item]) {
        let depth = self.children.len() - 1;
        for i in items {
            if let syn::Item::Mod(m) = i {
                self.children[depth].insert(m.ident.to_string());
            }
        }
        for i in items {
            if let syn::Item::Use(u) = i {
                let before = self.out.len();
                self.use_tree(&mut Vec::new(), &u.tree);
                self.out.truncate(before); // noted again when visited
            }
        }
    }
}

/// Edges between files: file (relative to `src/`) -> the files it names.
fn file_graph() -> BTreeMap<String, BTreeSet<String>> {
    let modules = module_files();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph = BTreeMap::new();
    for (module, rel) in &modules {
        let text = std::fs::read_to_string(src.join(rel)).unwrap();
        let file = syn::parse_file(&text).unwrap_or_else(|e| panic!("{rel}: {e}"));
        let mut refs = FileRefs {
            here: module.clone(),
            children: vec![BTreeSet::new()],
            aliases: vec![BTreeMap::new()],
            out: Vec::new(),
        };
        refs.declare(&file.items);
        syn::visit::Visit::visit_file(&mut refs, &file);
        let mut to = BTreeSet::new();
        for abs in refs.out {
            // The file of the longest module prefix of the path.
            let target = (0..=abs.len())
                .rev()
                .find_map(|n| modules.get(&abs[..n]))
                .cloned();
            if let Some(t) = target.filter(|t| t != rel) {
                to.insert(t);
            }
        }
        graph.insert(rel.clone(), to);
    }
    graph
}

/// The graph of the files inside `folder`, with their edges to each other.
fn folder_graph(
    graph: &BTreeMap<String, BTreeSet<String>>,
    folder: &str,
) -> BTreeMap<String, BTreeSet<String>> {
    let inside = |f: &str| f.starts_with(&format!("{folder}/"));
    graph
        .iter()
        .filter(|(f, _)| inside(f))
        .map(|(f, to)| {
            let to = to.iter().filter(|t| inside(t)).cloned().collect();
            (f.clone(), to)
        })
        .collect()
}

#[test]
fn no_circle_of_files_inside_a_folder() {
    let graph = file_graph();
    let mut bad = Vec::new();
    for folder in FILE_CIRCLE_FOLDERS {
        let g = folder_graph(&graph, folder);
        let edges: usize = g.values().map(BTreeSet::len).sum();
        let cs = circles(&g);
        let largest = cs.iter().map(Vec::len).max().unwrap_or(0);
        // The numbers docs/architecture.md quotes (`--nocapture`).
        println!(
            "{folder}/: {} files, {edges} imports between them, largest circle {largest} files",
            g.len()
        );
        for (f, to) in &g {
            if !to.is_empty() {
                println!("  {f} -> {to:?}");
            }
        }
        let big: Vec<_> = cs
            .into_iter()
            .filter(|c| c.len() > MAX_FILE_CIRCLE)
            .collect();
        if FILE_CIRCLES_NOT_YET.contains(folder) {
            assert!(
                !big.is_empty(),
                "{folder}/ has no circle of more than {MAX_FILE_CIRCLE} files: remove it from FILE_CIRCLES_NOT_YET"
            );
            println!("  (not yet refused) circles: {big:?}");
        } else {
            bad.extend(big);
        }
    }
    assert!(
        bad.is_empty(),
        "circles of more than {MAX_FILE_CIRCLE} files inside a folder (docs/architecture.md, \"Inside the folders\"): {bad:#?}"
    );
}

#[test]
fn the_file_checker_resolves_what_a_file_names() {
    // A file `a/b.rs` in a tree with `a/mod.rs`, `a/c.rs`, `a/d/mod.rs`, `a/d/e.rs`.
    let text = "use super::c::{self, X};\n\
                use crate::a::d::e as ee;\n\
                mod inner { use super::super::d::*; }\n\
                fn f() { c::g(); ee::h(); super::Y; crate::z::w(); std::mem::drop(1); }";
    let file = syn::parse_file(text).unwrap();
    let mut refs = FileRefs {
        here: vec!["a".into(), "b".into()],
        children: vec![BTreeSet::new()],
        aliases: vec![BTreeMap::new()],
        out: Vec::new(),
    };
    refs.declare(&file.items);
    syn::visit::Visit::visit_file(&mut refs, &file);
    let got: BTreeSet<String> = refs.out.iter().map(|p| p.join("::")).collect();
    let want: BTreeSet<String> = [
        "a::c",
        "a::c::X",
        "a::d::e",
        "a::d",
        "a::c::g",
        "a::d::e::h",
        "a::Y",
        "z::w",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(got, want);
}
