//! Tenant → node: the disk and compile ledger. What a tenant stores is
//! given back when its records go (a deleted site's or function's blobs are
//! swept, a blob another record shares stays); what an import declares is
//! checked against what it carries (sizes, counters); WAT text is bounded by
//! its own limit and parsed inside the compile gate; block nesting is
//! bounded before compiling. End to end through a running node, as the
//! tenant "evil" would drive it. See docs/security.md, "Tenant → tenant"
//! and "Client → node".

use super::bounds::{binary_module, tarball};
use crate::common::{
    NodeOpts, TEST_CONFIG, TestNode, cluster_mode, http, json, single_node_only, wait_until,
};
use std::time::Duration;

const BOUNDARY: &str = "mgledgerboundary7";

/// `POST path` of a multipart body with `key`: status and body text.
fn post_parts(node: &TestNode, key: &str, path: &str, parts: &[(&str, &[u8])]) -> (u16, String) {
    let mut body = Vec::new();
    for (name, data) in parts {
        body.extend_from_slice(
            format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n").as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    let auth = format!("Bearer {key}");
    let ct = format!("multipart/form-data; boundary={BOUNDARY}");
    let (s, _, b) = http(
        "POST",
        &node.url(path),
        &[("authorization", &auth), ("content-type", &ct)],
        Some(&body),
    );
    (s, String::from_utf8_lossy(&b).into_owned())
}

fn deploy_fn(node: &TestNode, key: &str, name: &str, wasm: &[u8]) -> (u16, String) {
    post_parts(
        node,
        key,
        "/v1/functions",
        &[("name", name.as_bytes()), ("wasm", wasm)],
    )
}

fn code(body: &str) -> String {
    json(body)["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn message(body: &str) -> String {
    json(body)["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Whether function `name` exists in the key's namespace.
fn stored(node: &TestNode, key: &str, name: &str) -> bool {
    node.with_key(key, "GET", &format!("/v1/functions/{name}"), None)
        .0
        == 200
}

fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

/// Bytes the files under `dir` take on disk (allocated blocks).
fn disk_bytes(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    for e in entries.flatten() {
        let Ok(m) = e.metadata() else { continue };
        if m.is_dir() {
            total += disk_bytes(&e.path());
        } else {
            total += m.blocks() * 512;
        }
    }
    total
}

/// `n` bytes no compressor shrinks (xorshift from `seed`, which moves on).
fn noise(n: usize, seed: &mut u64) -> Vec<u8> {
    let mut v = vec![0u8; n];
    for chunk in v.chunks_mut(8) {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        let b = seed.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    v
}

/// A function body of `depth` nested `block`s (the module's final `end`
/// closes the function).
fn nested_blocks(depth: usize) -> Vec<u8> {
    let mut body = vec![0u8];
    body.extend(std::iter::repeat_n([0x02u8, 0x40], depth).flatten());
    body.extend(std::iter::repeat_n(0x0bu8, depth));
    binary_module(&[body], 0)
}

const MIB: u64 = 1 << 20;

/// The attack's WAT text, `(module (func)(func)…)`, of about `bytes` bytes.
fn wat_of_empty_functions(bytes: usize) -> Vec<u8> {
    let mut t = b"(module".to_vec();
    while t.len() + 6 + 1 < bytes {
        t.extend_from_slice(b"(func)");
    }
    t.push(b')');
    t
}

/// Four deploys of a 16 MiB WAT text at once (the attack: +1 GiB each
/// while the text was parsed before the compile gate) are each 413
/// `MODULE_TOO_LARGE` naming `max_wat_bytes`, before the text is parsed;
/// four at once of a text just under the 4 MiB limit are parsed inside the
/// gate, one at a time for the namespace: each is 429 `COMPILE_BUSY` or
/// 400 `MODULE_TOO_COMPLEX`, nothing is stored, and the node's peak RSS
/// grows by at most 768 MiB over all eight (one parse at a time is about
/// 420 MiB alone; on a loaded machine the refused bodies and the allocator's
/// retained pages have added 150 MiB more; the attack was 4 GiB).
#[test]
fn concurrent_wat_deploys_are_bounded_and_parsed_in_the_gate() {
    if single_node_only() {
        return;
    }
    let node = TestNode::start();
    let key = node.create_namespace("evil");
    // A real module first, so the engine's one-time allocations are not counted.
    let (s, b) = deploy_fn(&node, &key, "warm", br#"(module (func (export "_start")))"#);
    assert_eq!(s, 201, "{b}");
    let pid = node.child.as_ref().unwrap().id();
    let before = status_kib(pid, "VmHWM:");
    let at_once = |text: &[u8]| -> Vec<(u16, String)> {
        let barrier = std::sync::Barrier::new(4);
        std::thread::scope(|sc| {
            let handles: Vec<_> = (0..4)
                .map(|i| {
                    let (node, key, barrier) = (&node, &key, &barrier);
                    sc.spawn(move || {
                        barrier.wait();
                        deploy_fn(node, key, &format!("wat{i}"), text)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let big = wat_of_empty_functions(16 << 20);
    for (s, b) in at_once(&big) {
        assert_eq!((s, code(&b).as_str()), (413, "MODULE_TOO_LARGE"), "{b}");
        assert!(message(&b).contains("max_wat_bytes"), "{b}");
    }
    drop(big);
    let under = wat_of_empty_functions((4 << 20) - 64);
    let answers = at_once(&under);
    let busy = answers.iter().filter(|(s, _)| *s == 429).count();
    for (s, b) in &answers {
        assert!(
            (*s, code(b).as_str()) == (429, "COMPILE_BUSY")
                || (*s, code(b).as_str()) == (400, "MODULE_TOO_COMPLEX"),
            "{s} {b}"
        );
    }
    for i in 0..4 {
        assert!(!stored(&node, &key, &format!("wat{i}")), "wat{i} stored");
    }
    let grew = status_kib(pid, "VmHWM:").saturating_sub(before) / 1024;
    eprintln!(
        "four 16 MiB and four 4 MiB WAT deploys at once: {busy} COMPILE_BUSY; node peak RSS +{grew} MiB"
    );
    assert!(grew <= 768, "the node's peak RSS grew by {grew} MiB");
}

/// Nesting depth as a pair: with `max_nesting_depth = 64`, a function of 64
/// nested blocks deploys and runs, one of 65 is 400 `MODULE_TOO_COMPLEX`
/// naming the limit and nothing is stored; with the default limit the
/// attack's 1 MiB body of nested blocks (+330 MB to compile) is refused the
/// same way, before it is compiled.
#[test]
fn nesting_depth_obeyed_and_violated() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[functions]\nmax_nesting_depth = 64\n"),
        ..Default::default()
    });
    let key = node.create_namespace("nest");
    let (s, b) = deploy_fn(&node, &key, "deep64", &nested_blocks(64));
    assert_eq!(s, 201, "{b}");
    assert_eq!(crate::functions::invoke(&node, &key, "deep64", b"").0, 200);
    let (s, b) = deploy_fn(&node, &key, "deep65", &nested_blocks(65));
    assert_eq!((s, code(&b).as_str()), (400, "MODULE_TOO_COMPLEX"), "{b}");
    assert!(message(&b).contains("max_nesting_depth"), "{b}");
    assert!(!stored(&node, &key, "deep65"));

    let default = TestNode::start();
    let evil = default.create_namespace("evil");
    // 1 + 3 bytes per level, within the default 1 MiB function body.
    let attack = nested_blocks(((1 << 20) - 16) / 3);
    assert!(attack.len() > 1 << 19);
    let (s, b) = deploy_fn(&default, &evil, "nested", &attack);
    assert_eq!((s, code(&b).as_str()), (400, "MODULE_TOO_COMPLEX"), "{b}");
    assert!(message(&b).contains("max_nesting_depth"), "{b}");
    assert!(!stored(&default, &evil, "nested"));
}

/// Six deploy/delete cycles of a site of four 16 MiB incompressible files,
/// new bytes each time, grow the node's data folder (sled) by at most 192
/// MiB: each delete gives its four blobs back (before, every cycle kept its
/// 64 MiB: the folder grew without bound while `site_bytes` read 0).
#[test]
fn site_deploy_delete_cycles_keep_the_data_folder_bounded() {
    if single_node_only() {
        return;
    }
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[deploy]\nmax_site_bytes = {}\n", 80 * MIB),
        ..Default::default()
    });
    let key = node.create_namespace("evil");
    let base = disk_bytes(&node.dir);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut sizes = Vec::new();
    for cycle in 1..=6u64 {
        let files: Vec<(String, Vec<u8>)> = (0..4)
            .map(|i| (format!("f{i}.bin"), noise(16 << 20, &mut seed)))
            .collect();
        let files: Vec<(&str, Vec<u8>)> =
            files.iter().map(|(p, d)| (p.as_str(), d.clone())).collect();
        let tgz = tarball(&files);
        drop(files);
        let (s, b) = post_parts(
            &node,
            &key,
            "/v1/deployments",
            &[
                ("name", b"big"),
                ("hosts", b"big.evil.test"),
                ("tarball", &tgz),
            ],
        );
        assert_eq!(s, 201, "cycle {cycle}: {b}");
        let (s, b) = node.with_key(&key, "DELETE", "/v1/deployments/big", None);
        assert_eq!(s, 200, "cycle {cycle}: {b}");
        // The sweep the delete asked for has deleted this cycle's four.
        wait_until(
            Duration::from_secs(120),
            "the deleted site's blobs swept",
            || node.metric_sum("meshgate_blobs_deleted_total") >= (4 * cycle) as f64,
        );
        sizes.push(disk_bytes(&node.dir).saturating_sub(base) / MIB);
    }
    eprintln!("data folder growth after each of six 64 MiB deploy/delete cycles (MiB): {sizes:?}");
    let grew = *sizes.last().unwrap();
    assert!(
        grew <= 192,
        "six cycles grew the data folder by {grew} MiB: {sizes:?}"
    );
}

/// A function's delete gives back its module's blob, while the blob of a
/// module another namespace's function shares (content-addressed: stored
/// once) stays: that function is still exported with its module, which
/// the export reads from the store, and on sled the store holds exactly
/// the shared blob.
#[test]
fn function_delete_frees_its_module_and_a_shared_one_stays() {
    let mut node = TestNode::start();
    let a = node.create_namespace("ledgera");
    let b = node.create_namespace("ledgerb");
    let shared_wat = br#"(module (func (export "_start")))"#;
    let own_wat = br#"(module (func (export "_start") nop nop))"#;
    let sha = |body: &str| {
        json(body)["function"]["sha256"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (s, r) = deploy_fn(&node, &a, "shared", shared_wat);
    assert_eq!(s, 201, "{r}");
    let shared = sha(&r);
    let (s, r) = deploy_fn(&node, &b, "shared", shared_wat);
    assert_eq!(s, 201, "{r}");
    assert_eq!(sha(&r), shared);
    let (s, r) = deploy_fn(&node, &a, "own", own_wat);
    assert_eq!(s, 201, "{r}");
    let own = sha(&r);
    let deleted = node.metric_sum("meshgate_blobs_deleted_total");
    for f in ["shared", "own"] {
        let (s, r) = node.with_key(&a, "DELETE", &format!("/v1/functions/{f}"), None);
        assert_eq!(s, 200, "{r}");
    }
    wait_until(Duration::from_secs(60), "the own module swept", || {
        node.metric_sum("meshgate_blobs_deleted_total") > deleted
    });
    let (s, e) = node.with_key(&b, "GET", "/v1/db/export", None);
    assert_eq!(s, 200, "{e}");
    let blobs = json(&e)["blobs"].clone();
    assert!(
        blobs.get(&shared).is_some(),
        "the shared module is gone: {blobs}"
    );
    assert_eq!(crate::functions::invoke(&node, &b, "shared", b"").0, 200);
    if cluster_mode() {
        return;
    }
    // Read the store itself once the node has stopped.
    node.signal(15);
    assert!(node.wait_exit(Duration::from_secs(30)).is_some());
    let store = meshgate::storage::Store::open_sled(&node.dir).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let blobs = rt
        .block_on(store.scan_keys_unless(b"blob/", 100, b"_none"))
        .unwrap()
        .unwrap();
    let blobs: Vec<String> = blobs
        .iter()
        .map(|k| String::from_utf8_lossy(&k[5..]).into_owned())
        .collect();
    assert_eq!(blobs, vec![shared.clone()], "own module {own}");
}

/// The compiled-module cache follows the blobs: a deleted function's
/// module, deployed and invoked (so compiled and cached in
/// `<data_dir>/wasm-cache`), loses its `.cwasm` file when the sweep deletes
/// its blob, while a function still deployed keeps its own; a stale file
/// of a module no record names (left by an earlier run) is removed by the
/// sweep at start. (Before, every deleted module left ~2.3 MB of artifacts
/// for ever, counted against no quota.)
#[test]
fn a_swept_module_takes_its_compiled_artifacts_with_it() {
    if single_node_only() {
        return;
    }
    let node = TestNode::start();
    let key = node.create_namespace("ledgerc");
    let sha = |body: &str| {
        json(body)["function"]["sha256"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let cache = node.dir.join("wasm-cache");
    let files_of = |sha: &str| -> Vec<String> {
        std::fs::read_dir(&cache)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(sha))
                    .collect()
            })
            .unwrap_or_default()
    };
    let (s, r) = deploy_fn(
        &node,
        &key,
        "gone",
        br#"(module (func (export "_start") nop nop nop))"#,
    );
    assert_eq!(s, 201, "{r}");
    let gone = sha(&r);
    let (s, r) = deploy_fn(
        &node,
        &key,
        "stays",
        br#"(module (func (export "_start") nop))"#,
    );
    assert_eq!(s, 201, "{r}");
    let stays = sha(&r);
    for f in ["gone", "stays"] {
        assert_eq!(crate::functions::invoke(&node, &key, f, b"").0, 200, "{f}");
    }
    assert!(!files_of(&gone).is_empty(), "gone was never cached");
    assert!(!files_of(&stays).is_empty(), "stays was never cached");
    let deleted = node.metric_sum("meshgate_blobs_deleted_total");
    let (s, r) = node.with_key(&key, "DELETE", "/v1/functions/gone", None);
    assert_eq!(s, 200, "{r}");
    wait_until(Duration::from_secs(60), "the deleted module swept", || {
        node.metric_sum("meshgate_blobs_deleted_total") > deleted
    });
    wait_until(Duration::from_secs(30), "its artifacts removed", || {
        files_of(&gone).is_empty()
    });
    assert!(
        !files_of(&stays).is_empty(),
        "a live module's artifact went"
    );
    assert_eq!(crate::functions::invoke(&node, &key, "stays", b"").0, 200);
    // A file left by an earlier run, of a module no record names, goes
    // with the sweep at the next start.
    let orphan = format!("{}-0000000000000000.cwasm", "ab".repeat(32));
    std::fs::write(cache.join(&orphan), b"stale").unwrap();
    let _node = node.crash_and_restart_with(NodeOpts::default());
    wait_until(
        Duration::from_secs(60),
        "the orphan artifact removed",
        || files_of(&"ab".repeat(32)).is_empty(),
    );
    assert!(
        !files_of(&stays).is_empty(),
        "a live module's artifact went"
    );
}

/// An import that declares sizes its blobs do not have is refused 400
/// `IMPORT_SIZE_MISMATCH` (a function version's `size_bytes`, a site
/// file's `size`, a site's `total_bytes` below its files: quotas are
/// counted from these), one whose counters are past 2^53 is 400
/// `INVALID_EXPORT` (a deployment's `latest` of u64::MAX wrapped its next
/// version), and nothing is stored; the honest export imports.
#[test]
fn imports_with_lying_sizes_or_counters_are_refused() {
    let node = TestNode::start();
    let key = node.create_namespace("evil");
    let (s, b) = deploy_fn(&node, &key, "f", br#"(module (func (export "_start")))"#);
    assert_eq!(s, 201, "{b}");
    let tgz = tarball(&[("index.html", b"<h1>evil</h1>".to_vec())]);
    let (s, b) = post_parts(
        &node,
        &key,
        "/v1/deployments",
        &[
            ("name", b"www"),
            ("hosts", b"www.evil.test"),
            ("tarball", &tgz),
        ],
    );
    assert_eq!(s, 201, "{b}");
    let (s, export) = node.with_key(&key, "GET", "/v1/db/export", None);
    assert_eq!(s, 200, "{export}");
    let export = json(&export);
    let what_is_stored = || {
        let (s, e) = node.with_key(&key, "GET", "/v1/db/export", None);
        assert_eq!(s, 200, "{e}");
        let e = json(&e);
        (e["functions"].clone(), e["deployments"].clone())
    };
    let stored_before = what_is_stored();
    type Lie = (&'static str, fn(&mut serde_json::Value), &'static str);
    let lies: [Lie; 5] = [
        (
            "a module's size_bytes",
            |e| e["functions"][0]["versions"][0]["size_bytes"] = 1.into(),
            "IMPORT_SIZE_MISMATCH",
        ),
        (
            "a site file's size",
            |e| {
                e["deployments"][0]["versions"][0]["target"]["files"]["index.html"]["size"] =
                    1.into()
            },
            "IMPORT_SIZE_MISMATCH",
        ),
        (
            "a site's total_bytes",
            |e| e["deployments"][0]["versions"][0]["target"]["total_bytes"] = 0.into(),
            "IMPORT_SIZE_MISMATCH",
        ),
        (
            "a site's total_bytes past 2^53",
            |e| e["deployments"][0]["versions"][0]["target"]["total_bytes"] = u64::MAX.into(),
            "IMPORT_SIZE_MISMATCH",
        ),
        (
            "a deployment's latest",
            |e| e["deployments"][0]["record"]["latest"] = u64::MAX.into(),
            "INVALID_EXPORT",
        ),
    ];
    for (what, lie, want) in lies {
        let mut e = export.clone();
        lie(&mut e);
        let (s, b) = node.with_key(&key, "PUT", "/v1/db/import", Some(e.to_string().as_bytes()));
        assert_eq!((s, code(&b).as_str()), (400, want), "{what}: {b}");
        assert_eq!(what_is_stored(), stored_before, "{what}: something changed");
    }
    let (s, b) = node.with_key(
        &key,
        "PUT",
        "/v1/db/import",
        Some(export.to_string().as_bytes()),
    );
    assert_eq!(s, 200, "the honest export: {b}");
}

/// A history import whose topic `top` is u64::MAX (the next offset wrapped
/// to 0) is refused 400 `INVALID_EXPORT` naming the limit, the history is
/// unchanged, and the next publication takes the next offset.
#[test]
fn history_import_with_offset_u64_max_is_refused() {
    let node = TestNode::start();
    let key = node.create_namespace("evil");
    let rules =
        serde_json::json!({"history": [{"topics": "t.*", "size": 100, "ttl_seconds": 3600}]});
    let (s, b) = node.op(
        "PUT",
        "/v1/namespaces/evil/pubsub",
        Some(&rules.to_string()),
    );
    assert_eq!(s, 200, "{b}");
    let publish = || {
        let (s, b) = node.with_key(
            &key,
            "POST",
            "/v1/pubsub/publish",
            Some(br#"{"topic":"t.x","data_base64":"aGk="}"#),
        );
        assert_eq!(s, 200, "{b}");
        json(&b)["offset"].as_u64().unwrap()
    };
    let first = publish();
    let (s, e) = node.with_key(&key, "GET", "/v1/db/export", None);
    assert_eq!(s, 200, "{e}");
    let mut e = json(&e);
    let epoch = e["history"][0]["epoch"].clone();
    e["history"] =
        serde_json::json!([{"topic": "t.x", "epoch": epoch, "top": u64::MAX, "publications": []}]);
    let (s, b) = node.with_key(&key, "PUT", "/v1/db/import", Some(e.to_string().as_bytes()));
    assert_eq!((s, code(&b).as_str()), (400, "INVALID_EXPORT"), "{b}");
    assert!(message(&b).contains("9007199254740992"), "{b}");
    assert_eq!(publish(), first + 1);
}
