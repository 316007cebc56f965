//! Tenant → node resources: compiles and unpacks are bounded. A module over
//! a `[functions]` count limit is refused before it is compiled, a compile
//! past its deadline is answered 503 and its result dropped, one namespace
//! compiles one module at a time, and a tarball bomb is refused while it
//! streams to disk, leaving nothing stored and no temporary file. Each limit
//! as a pair (obeyed, violated), end to end through a running node; the
//! attack modules and archives are built here, in code. The memory these
//! attacks cost is measured by `benches/bounds.rs` (BENCHMARKS.md), never
//! asserted here. See docs/security.md, "Client → node".

use crate::common::{
    NodeOpts, OPERATOR_AUTH, TEST_CONFIG, TestNode, header, http, json, wait_until,
};
use std::time::Duration;

const BOUNDARY: &str = "mgboundsboundary41";

fn multipart(parts: &[(&str, &[u8])]) -> (String, Vec<u8>) {
    let mut body = Vec::new();
    for (name, data) in parts {
        body.extend_from_slice(
            format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n").as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={BOUNDARY}"), body)
}

/// `POST path` of a multipart body with `key`: status, headers, body text.
fn post_parts(
    node: &TestNode,
    key: &str,
    path: &str,
    parts: &[(&str, &[u8])],
) -> (u16, Vec<(String, String)>, String) {
    let (ct, body) = multipart(parts);
    let auth = format!("Bearer {key}");
    let (s, h, b) = http(
        "POST",
        &node.url(path),
        &[("authorization", &auth), ("content-type", &ct)],
        Some(&body),
    );
    (s, h, String::from_utf8_lossy(&b).into_owned())
}

fn deploy_fn(
    node: &TestNode,
    key: &str,
    name: &str,
    wasm: &[u8],
) -> (u16, Vec<(String, String)>, String) {
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

/// Whether function `name` exists in the key's namespace.
fn stored(node: &TestNode, key: &str, name: &str) -> bool {
    let (s, _) = node.with_key(key, "GET", &format!("/v1/functions/{name}"), None);
    s == 200
}

// ---- modules built in code ----

/// Unsigned LEB128.
fn leb(mut v: u64, out: &mut Vec<u8>) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

fn section(id: u8, content: &[u8], out: &mut Vec<u8>) {
    out.push(id);
    leb(content.len() as u64, out);
    out.extend_from_slice(content);
}

/// A binary module: one type `[] -> []`, `bodies.len()` functions of it
/// (the first exported as `_start`), `globals` i32 globals. Each body is
/// its locals vector and instructions, without `end`.
pub(crate) fn binary_module(bodies: &[Vec<u8>], globals: u64) -> Vec<u8> {
    let mut m = b"\0asm\x01\0\0\0".to_vec();
    section(1, &[1, 0x60, 0, 0], &mut m);
    let mut funcs = Vec::new();
    leb(bodies.len() as u64, &mut funcs);
    funcs.extend(std::iter::repeat_n(0u8, bodies.len()));
    section(3, &funcs, &mut m);
    if globals > 0 {
        let mut g = Vec::new();
        leb(globals, &mut g);
        for _ in 0..globals {
            g.extend_from_slice(&[0x7f, 0x00, 0x41, 0x00, 0x0b]);
        }
        section(6, &g, &mut m);
    }
    let mut exp = vec![1, 6];
    exp.extend_from_slice(b"_start");
    exp.extend_from_slice(&[0, 0]);
    section(7, &exp, &mut m);
    let mut code = Vec::new();
    leb(bodies.len() as u64, &mut code);
    for b in bodies {
        leb(b.len() as u64 + 1, &mut code);
        code.extend_from_slice(b);
        code.push(0x0b);
    }
    section(10, &code, &mut m);
    m
}

/// `n` empty functions.
pub(crate) fn many_functions(n: usize) -> Vec<u8> {
    binary_module(&vec![vec![0u8]; n], 0)
}

/// One function adding `values` i32 constants: as many values for the compiler.
pub(crate) fn many_values(values: usize) -> Vec<u8> {
    let mut body = vec![0u8, 0x41, 0x01];
    for _ in 1..values {
        body.extend_from_slice(&[0x41, 0x01, 0x6a]);
    }
    body.push(0x1a);
    binary_module(&[body], 0)
}

/// `(func (export "_start") ...)` with `extra` module fields around it.
fn wat(extra: &str, start_body: &str) -> Vec<u8> {
    format!("(module {extra} (func (export \"_start\") {start_body}))").into_bytes()
}

fn repeat(item: &str, n: usize) -> String {
    vec![item; n].join(" ")
}

/// Small `[functions]` limits, so each pair is a small module.
const SMALL_LIMITS: &str = "max_functions = 50\nmax_locals_per_function = 100\nmax_locals_total = 300\nmax_globals = 20\nmax_data_segments = 5\nmax_data_bytes = 1024\nmax_function_body_bytes = 4096\n";

/// Every pre-compile count limit as a pair through `POST /v1/functions`: a
/// module just at the limit is deployed and invoked; one just over is 400
/// `MODULE_TOO_COMPLEX` naming the limit, and nothing is stored.
#[test]
fn module_count_limits_obeyed_and_violated() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[functions]\nworkers = 2\n{SMALL_LIMITS}"),
        ..Default::default()
    });
    let key = node.create_namespace("counts");
    let locals = |n: usize| format!("(local {})", repeat("i32", n));
    let mem = "(memory 1)";
    let data = |n: usize| repeat("(data (i32.const 0) \"x\")", n);
    // (limit key, module at the limit, module one over)
    let pairs: Vec<(&str, Vec<u8>, Vec<u8>)> = vec![
        (
            "max_functions",
            wat(&repeat("(func)", 49), ""),
            wat(&repeat("(func)", 50), ""),
        ),
        (
            "max_locals_per_function",
            wat("", &locals(100)),
            wat("", &locals(101)),
        ),
        (
            "max_locals_total",
            wat(&repeat(&format!("(func {})", locals(100)), 2), &locals(100)),
            wat(
                &format!(
                    "{} (func {})",
                    repeat(&format!("(func {})", locals(100)), 2),
                    locals(1)
                ),
                &locals(100),
            ),
        ),
        (
            "max_globals",
            wat(&repeat("(global i32 (i32.const 0))", 20), ""),
            wat(&repeat("(global i32 (i32.const 0))", 21), ""),
        ),
        (
            "max_data_segments",
            wat(&format!("{mem} {}", data(5)), ""),
            wat(&format!("{mem} {}", data(6)), ""),
        ),
        (
            "max_data_bytes",
            wat(
                &format!("{mem} (data (i32.const 0) \"{}\")", "x".repeat(1024)),
                "",
            ),
            wat(
                &format!("{mem} (data (i32.const 0) \"{}\")", "x".repeat(1025)),
                "",
            ),
        ),
        (
            // A body is its locals count (1 byte), the instructions and `end`.
            "max_function_body_bytes",
            wat("", &repeat("nop", 4094)),
            wat("", &repeat("nop", 4095)),
        ),
    ];
    for (i, (limit, under, over)) in pairs.iter().enumerate() {
        let ok = format!("ok{i}");
        let (s, _, b) = deploy_fn(&node, &key, &ok, under);
        assert_eq!(s, 201, "{limit}, at the limit: {b}");
        let (s, _, b) = crate::functions::invoke(&node, &key, &ok, b"");
        assert_eq!(s, 200, "{limit}: {}", String::from_utf8_lossy(&b));

        let bad = format!("bad{i}");
        let (s, _, b) = deploy_fn(&node, &key, &bad, over);
        assert_eq!(
            (s, code(&b).as_str()),
            (400, "MODULE_TOO_COMPLEX"),
            "{limit}: {b}"
        );
        assert!(b.contains(limit), "the message names {limit}: {b}");
        assert!(!stored(&node, &key, &bad), "{limit}: stored");
    }
}

/// The attack modules, built here, against a node with the default limits:
/// 100,000 functions, one function of 1,000,000 values and 1,000,000
/// globals are each refused with 400 `MODULE_TOO_COMPLEX` before they are
/// compiled, nothing is stored, and a real module still deploys and runs.
#[test]
fn attack_modules_are_refused_before_compiling() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[functions]\nworkers = 2\n"),
        ..Default::default()
    });
    let key = node.create_namespace("attack");
    for (name, wasm, limit) in [
        ("fns", many_functions(100_000), "max_functions"),
        ("values", many_values(1_000_000), "max_function_body_bytes"),
        (
            "globals",
            binary_module(&[vec![0]], 1_000_000),
            "max_globals",
        ),
    ] {
        let (s, _, b) = deploy_fn(&node, &key, name, &wasm);
        assert_eq!(
            (s, code(&b).as_str()),
            (400, "MODULE_TOO_COMPLEX"),
            "{name}: {b}"
        );
        assert!(b.contains(limit), "{name}: {b}");
        assert!(!stored(&node, &key, name), "{name} stored");
    }
    // A real-sized one (5,000 functions) passes the same checks.
    let (s, _, b) = deploy_fn(&node, &key, "real", &many_functions(5_000));
    assert_eq!(s, 201, "{b}");
    let (s, _, _) = crate::functions::invoke(&node, &key, "real", b"");
    assert_eq!(s, 200);
}

/// The compile deadline as a pair: a 5,000-function module deploys and runs
/// on a node with the default deadline; on a node whose deadline is 1 ms
/// the same deploy is 503 `COMPILE_TIMEOUT` with `Retry-After`, and so is
/// another namespace's (it gets a slot or waits for one, and either way
/// its compile outlasts 1 ms); nothing is stored.
#[test]
fn compile_deadline_obeyed_and_violated() {
    let module = many_functions(9_000);
    let roomy = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[functions]\nworkers = 2\n"),
        ..Default::default()
    });
    let key = roomy.create_namespace("roomy");
    let (s, _, b) = deploy_fn(&roomy, &key, "f", &module);
    assert_eq!(s, 201, "{b}");
    assert_eq!(crate::functions::invoke(&roomy, &key, "f", b"").0, 200);
    drop(roomy);

    let tight = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[functions]\nworkers = 2\ncompile_timeout_ms = 1\n"),
        ..Default::default()
    });
    let a = tight.create_namespace("tight");
    let b_key = tight.create_namespace("other");
    let (s, h, b) = deploy_fn(&tight, &a, "f", &module);
    assert_eq!((s, code(&b).as_str()), (503, "COMPILE_TIMEOUT"), "{b}");
    assert_eq!(header(&h, "retry-after"), Some("1"));
    let (s, h, b) = deploy_fn(&tight, &b_key, "h", &many_functions(9_002));
    assert_eq!((s, code(&b).as_str()), (503, "COMPILE_TIMEOUT"), "{b}");
    assert_eq!(header(&h, "retry-after"), Some("1"));
    assert!(!stored(&tight, &a, "f"), "f stored");
    assert!(!stored(&tight, &b_key, "h"), "h stored");
}

/// The compile gate's two refusals, each pinned: while a namespace holds a
/// compile slot (a long compile, stood for by the fault-injection route
/// `debug/hold-compile`), its next deploy is refused at once with 429
/// `COMPILE_BUSY`, and with the node's one slot taken another namespace's
/// deploy waits for it until its deadline: 503 `COMPILE_TIMEOUT`. Both
/// with `Retry-After`, neither stored; before the hold the same module
/// deploys (the pair's obeyed side).
#[test]
fn compile_busy_for_the_namespace_and_timeout_for_another() {
    let node = TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}[functions]\nworkers = 2\ncompile_concurrency = 1\ncompile_timeout_ms = 1000\n\
             [debug]\nfault_injection = true\n"
        ),
        ..Default::default()
    });
    let holder = node.create_namespace("holder");
    let other = node.create_namespace("waiter");
    // Three distinct modules: a module compiled once is not compiled again.
    let module = |n: usize| many_functions(n);
    // On the node that compiles the namespaces' deploys (cluster mode:
    // their member, where the forwarded deploys go).
    let hold = |ms: u64| {
        let (s, _, b) = http(
            "POST",
            &format!(
                "{}/v1/namespaces/holder/debug/hold-compile?ms={ms}",
                node.member_base()
            ),
            &[OPERATOR_AUTH],
            None,
        );
        assert_eq!(s, 202, "{}", String::from_utf8_lossy(&b));
    };
    let (s, _, b) = deploy_fn(&node, &other, "before", &module(10));
    assert_eq!(s, 201, "{b}");
    hold(60_000);
    let (s, h, b) = deploy_fn(&node, &holder, "f", &module(11));
    assert_eq!((s, code(&b).as_str()), (429, "COMPILE_BUSY"), "{b}");
    assert_eq!(header(&h, "retry-after"), Some("1"));
    let (s, h, b) = deploy_fn(&node, &other, "g", &module(12));
    assert_eq!((s, code(&b).as_str()), (503, "COMPILE_TIMEOUT"), "{b}");
    assert_eq!(header(&h, "retry-after"), Some("1"));
    assert!(!stored(&node, &holder, "f"), "f stored");
    assert!(!stored(&node, &other, "g"), "g stored");
}

// ---- site tarballs ----

/// A `.tar.gz` of (path, bytes) regular files.
pub(crate) fn tarball(files: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut b = tar::Builder::new(gz);
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, path, &data[..]).unwrap();
    }
    b.into_inner().unwrap().finish().unwrap()
}

/// `n` bytes that compress to almost nothing, distinct by `tag`.
pub(crate) fn zeros(n: usize, tag: u8) -> Vec<u8> {
    let mut v = vec![0u8; n];
    v[0] = tag;
    v
}

fn deploy_site(node: &TestNode, key: &str, name: &str, host: &str, tgz: &[u8]) -> (u16, String) {
    let (s, _, b) = post_parts(
        node,
        key,
        "/v1/deployments",
        &[
            ("name", name.as_bytes()),
            ("hosts", host.as_bytes()),
            ("tarball", tgz),
        ],
    );
    (s, b)
}

/// The temporary site folders left under the node's data folder.
fn site_tmp_dirs(node: &TestNode) -> usize {
    std::fs::read_dir(node.dir.join("tmp"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Tarball bombs as pairs with the site limits: one 64 MiB file (64 KiB
/// compressed) over `max_site_file_bytes`, and four distinct 3 MiB files
/// over `max_site_unpacked_bytes`, are each 413 `SITE_TOO_LARGE` with nothing
/// stored and no temporary file left; a site of two 3 MiB files and a page,
/// within both, is deployed and serves every byte.
#[test]
fn tarball_bombs_refused_and_normal_site_deployed() {
    if crate::common::single_node_only() {
        return;
    }
    let node = TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}[deploy]\nmax_site_unpacked_bytes = 8388608\nmax_site_file_bytes = 4194304\n"
        ),
        ..Default::default()
    });
    let key = node.create_namespace("sites");
    let one_big = tarball(&[
        ("index.html", b"hi".to_vec()),
        ("bomb.bin", zeros(64 << 20, 1)),
    ]);
    assert!(one_big.len() < 256 << 10, "a bomb: {} bytes", one_big.len());
    let many = tarball(&[
        ("a.bin", zeros(3 << 20, 1)),
        ("b.bin", zeros(3 << 20, 2)),
        ("c.bin", zeros(3 << 20, 3)),
        ("d.bin", zeros(3 << 20, 4)),
    ]);
    for (what, t) in [("one big file", &one_big), ("many files", &many)] {
        let (s, b) = deploy_site(&node, &key, "bomb", "bomb.test", t);
        assert_eq!(
            (s, code(&b).as_str()),
            (413, "SITE_TOO_LARGE"),
            "{what}: {b}"
        );
        let (s, _) = node.with_key(&key, "GET", "/v1/deployments/bomb", None);
        assert_eq!(s, 404, "{what}: stored");
        wait_until(Duration::from_secs(10), "temporary files removed", || {
            site_tmp_dirs(&node) == 0
        });
    }
    let (_, b) = node.with_key(&key, "GET", "/v1/deployments", None);
    assert_eq!(json(&b)["deployments"].as_array().unwrap().len(), 0);

    let good = tarball(&[
        ("index.html", b"<h1>ok</h1>".to_vec()),
        ("a.bin", zeros(3 << 20, 1)),
        ("b.bin", zeros(3 << 20, 2)),
    ]);
    let (s, b) = deploy_site(&node, &key, "good", "good.test", &good);
    assert_eq!(s, 201, "{b}");
    let (s, _, body) = crate::deploy::via(&node, "good.test", "GET", "/", &[], None);
    assert_eq!((s, body.as_slice()), (200, &b"<h1>ok</h1>"[..]));
    let (s, _, body) = crate::deploy::via(&node, "good.test", "GET", "/b.bin", &[], None);
    assert_eq!(s, 200);
    assert_eq!(body, zeros(3 << 20, 2));
    wait_until(Duration::from_secs(10), "temporary files removed", || {
        site_tmp_dirs(&node) == 0
    });
}
