//! Functions (docs/design.md §4): deploy, invoke, limits as obeyed/violated pairs,
//! bad deploys, isolation between namespaces, crash safety of a deploy and
//! the compiled-artifact cache across a restart. Each test drives a real node.

use crate::common::{
    NodeOpts, TEST_CONFIG, TestNode, header, http, json, single_node_only, wait_until,
};
use std::time::{Duration, Instant};

/// Two workers so a stuck guest never holds the whole pool in these tests.
fn config(extra: &str) -> String {
    format!("{TEST_CONFIG}\n[functions]\nworkers = 2\n{extra}\n")
}

fn start(extra: &str) -> TestNode {
    TestNode::start_with(NodeOpts {
        config: config(extra),
        ..Default::default()
    })
}

fn echo_wasm() -> Vec<u8> {
    std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/functions/echo.wasm"
    ))
    .unwrap()
}

const BOUNDARY: &str = "mgtestboundary7d3a91";

/// A `multipart/form-data` body built by hand.
fn multipart(parts: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = Vec::new();
    for (name, data) in parts {
        b.extend_from_slice(format!("--{BOUNDARY}\r\n").as_bytes());
        if *name == "wasm" {
            b.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"; filename=\"m.wasm\"\r\nContent-Type: application/wasm\r\n\r\n").as_bytes(),
            );
        } else {
            b.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes(),
            );
        }
        b.extend_from_slice(data);
        b.extend_from_slice(b"\r\n");
    }
    b.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    b
}

fn deploy_parts(node: &TestNode, key: &str, parts: &[(&str, &[u8])]) -> (u16, String) {
    let auth = format!("Bearer {key}");
    let ct = format!("multipart/form-data; boundary={BOUNDARY}");
    let (s, _, b) = http(
        "POST",
        &node.url("/v1/functions"),
        &[("authorization", &auth), ("content-type", &ct)],
        Some(&multipart(parts)),
    );
    (s, String::from_utf8_lossy(&b).into_owned())
}

pub(crate) fn deploy(
    node: &TestNode,
    key: &str,
    name: &str,
    wasm: &[u8],
    extra: &[(&str, &str)],
) -> u64 {
    let mut parts: Vec<(&str, &[u8])> = vec![("name", name.as_bytes()), ("wasm", wasm)];
    for (k, v) in extra {
        parts.push((k, v.as_bytes()));
    }
    let (s, b) = deploy_parts(node, key, &parts);
    assert_eq!(s, 201, "deploy {name}: {b}");
    json(&b)["function"]["version"].as_u64().unwrap()
}

/// Invokes `path` (a function name, maybe `@version`); returns status, headers, body.
pub(crate) fn invoke(
    node: &TestNode,
    key: &str,
    name: &str,
    input: &[u8],
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let auth = format!("Bearer {key}");
    http(
        "POST",
        &node.url(&format!("/v1/functions/{name}/invoke")),
        &[("authorization", &auth)],
        Some(input),
    )
}

fn code(body: &[u8]) -> String {
    json(&String::from_utf8_lossy(body))["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn function_names(node: &TestNode, key: &str) -> Vec<String> {
    let (s, b) = node.with_key(key, "GET", "/v1/functions", None);
    assert_eq!(s, 200, "{b}");
    json(&b)["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap().to_string())
        .collect()
}

/// A counter summed over the node (cluster mode: every node of the cluster,
/// since the member that runs the function is not the one the test talks to).
fn metric(node: &TestNode, name: &str) -> u64 {
    node.metric_sum(name) as u64
}

/// Until a guest runs on a worker (cluster mode: on any node), e.g. the
/// spinning one a thread just invoked.
fn wait_guest_running(node: &TestNode) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while node.metric_sum("meshgate_wasm_pool_busy") < 1.0 {
        assert!(Instant::now() < deadline, "the guest never started");
        std::thread::sleep(Duration::from_millis(20));
    }
}

const LOOP: &str = r#"(module (func (export "_start") (loop (br 0))))"#;

/// Grows memory 1 MiB at a time until refused, then insists (traps).
const MEMORY_BOMB: &str = r#"(module (memory (export "memory") 1)
  (func (export "_start")
    (loop (br_if 0 (i32.ne (memory.grow (i32.const 16)) (i32.const -1))))
    unreachable))"#;

/// Grows memory by 1 MiB once; traps if refused.
const MEMORY_ONE_MIB: &str = r#"(module (memory (export "memory") 1)
  (func (export "_start")
    (if (i32.eq (memory.grow (i32.const 16)) (i32.const -1)) (then unreachable))))"#;

const STACK_OVERFLOW: &str = r#"(module (func $f (export "_start") (call $f)))"#;

/// Recurses 1,000 deep and returns.
const STACK_BOUNDED: &str = r#"(module
  (func $r (param i32) (if (local.get 0) (then (call $r (i32.sub (local.get 0) (i32.const 1))))))
  (func (export "_start") (call $r (i32.const 1000))))"#;

/// Invokes itself ("chain"): the innermost refused call writes '0' - code,
/// each level above appends '.'.
const CHAIN: &str = r#"(module
  (import "meshgate" "invoke" (func $invoke (param i32 i32 i32 i32 i32 i32) (result i64)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 512) "chain")
  (func (export "_start")
    (local $r i64) (local $len i32)
    (local.set $r (call $invoke (i32.const 512) (i32.const 5) (i32.const 0) (i32.const 0) (i32.const 1024) (i32.const 4096)))
    (if (i64.ge_s (local.get $r) (i64.const 0))
      (then
        (local.set $len (i32.wrap_i64 (local.get $r)))
        (i32.store8 (i32.add (i32.const 1024) (local.get $len)) (i32.const 46))
        (local.set $len (i32.add (local.get $len) (i32.const 1))))
      (else
        (i32.store8 (i32.const 1024) (i32.sub (i32.const 48) (i32.wrap_i64 (local.get $r))))
        (local.set $len (i32.const 1))))
    (i32.store (i32.const 0) (i32.const 1024))
    (i32.store (i32.const 4) (local.get $len))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 16)))))"#;

/// Tries B's KV key "secret", publishes "t1", invokes "btrig"; writes the
/// three results as '0' - code (so "101": not found, published, not found).
const PROBE: &str = r#"(module
  (import "meshgate" "kv_get" (func $kv_get (param i32 i32 i32 i32) (result i64)))
  (import "meshgate" "publish" (func $publish (param i32 i32 i32 i32) (result i32)))
  (import "meshgate" "invoke" (func $invoke (param i32 i32 i32 i32 i32 i32) (result i64)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 512) "secret")
  (data (i32.const 528) "t1")
  (data (i32.const 544) "x")
  (data (i32.const 560) "btrig")
  (func $put (param $at i32) (param $r i64)
    (i32.store8 (i32.add (i32.const 1024) (local.get $at))
      (i32.sub (i32.const 48) (i32.wrap_i64 (local.get $r)))))
  (func (export "_start")
    (call $put (i32.const 0) (call $kv_get (i32.const 512) (i32.const 6) (i32.const 2048) (i32.const 64)))
    (call $put (i32.const 1) (i64.extend_i32_s (call $publish (i32.const 528) (i32.const 2) (i32.const 544) (i32.const 1))))
    (call $put (i32.const 2) (call $invoke (i32.const 560) (i32.const 5) (i32.const 0) (i32.const 0) (i32.const 2048) (i32.const 64)))
    (i32.store (i32.const 0) (i32.const 1024))
    (i32.store (i32.const 4) (i32.const 3))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 16)))))"#;

/// Writes "1" to its namespace's KV key "hit" (a pub/sub trigger target).
const MARK_HIT: &str = r#"(module
  (import "meshgate" "kv_put" (func $kv_put (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 512) "hit")
  (data (i32.const 528) "1")
  (func (export "_start")
    (drop (call $kv_put (i32.const 512) (i32.const 3) (i32.const 528) (i32.const 1)))))"#;

/// Deploy → invoke (JSON and raw answers, headers), versions, pinning, logs, delete.
#[test]
fn functions_deploy_invoke_versions_logs() {
    let node = start("");
    let key = node.create_namespace("fa");
    assert_eq!(deploy(&node, &key, "echo", &echo_wasm(), &[]), 1);
    let (s, h, b) = invoke(&node, &key, "echo", br#"{"hello":1}"#);
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(b, br#"{"hello":1}"#);
    assert_eq!(header(&h, "content-type"), Some("application/json"));
    assert!(header(&h, "x-request-id").is_some());
    assert!(header(&h, "x-duration-ms").is_some());
    let (_, h, b) = invoke(&node, &key, "echo", b"raw bytes");
    assert_eq!(b, b"raw bytes");
    assert_eq!(header(&h, "content-type"), Some("application/octet-stream"));

    // Version 2 is another module; @1 still runs the first.
    assert_eq!(
        deploy(&node, &key, "echo", STACK_BOUNDED.as_bytes(), &[]),
        2
    );
    let (s, _, b) = invoke(&node, &key, "echo", b"x");
    assert_eq!((s, b.as_slice()), (200, &b""[..]));
    let (s, _, b) = invoke(&node, &key, "echo@1", b"x");
    assert_eq!((s, b.as_slice()), (200, &b"x"[..]));
    let (s, b) = node.with_key(&key, "GET", "/v1/functions/echo/versions", None);
    assert_eq!(s, 200);
    assert_eq!(json(&b)["versions"].as_array().unwrap().len(), 2);

    // Records arrive through the writer's queue, and `logs` waits for the
    // records queued before it: calls answered before are there at once
    // (on a cluster, where the call may have run on another member than
    // the one that reads, they arrive within the writer's linger).
    if !crate::common::cluster_mode() {
        let (s, b) = node.with_key(&key, "GET", "/v1/functions/echo/logs", None);
        assert_eq!(s, 200);
        assert_eq!(json(&b)["logs"].as_array().unwrap().len(), 4, "{b}");
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (s, b) = node.with_key(&key, "GET", "/v1/functions/echo/logs", None);
        assert_eq!(s, 200);
        if json(&b)["logs"].as_array().unwrap().len() >= 4 {
            break;
        }
        assert!(Instant::now() < deadline, "no records: {b}");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Unknown function and unknown version: 404.
    assert_eq!(invoke(&node, &key, "nope", b"").0, 404);
    assert_eq!(invoke(&node, &key, "echo@9", b"").0, 404);
    // Input over 1 MiB: 413.
    assert_eq!(
        invoke(&node, &key, "echo", &vec![b'a'; (1 << 20) + 1]).0,
        413
    );

    let (s, _) = node.with_key(&key, "DELETE", "/v1/functions/echo", None);
    assert_eq!(s, 200);
    assert_eq!(invoke(&node, &key, "echo", b"").0, 404);
    assert!(function_names(&node, &key).is_empty());
}

/// Timeout pair: an infinite loop is 504 FUNCTION_TIMEOUT at its 1 s deadline
/// while another invoke of the namespace succeeds meanwhile.
#[test]
fn functions_timeout_obeyed_and_violated() {
    let node = start("");
    let key = node.create_namespace("ft");
    deploy(
        &node,
        &key,
        "spin",
        LOOP.as_bytes(),
        &[("timeout_seconds", "1")],
    );
    deploy(&node, &key, "echo", &echo_wasm(), &[]);
    let (n2, k2) = (node.base.clone(), key.clone());
    let spin = std::thread::spawn(move || {
        let t = Instant::now();
        let auth = format!("Bearer {k2}");
        let (s, _, b) = http(
            "POST",
            &format!("{n2}/v1/functions/spin/invoke"),
            &[("authorization", &auth)],
            Some(b""),
        );
        (s, b, t.elapsed())
    });
    wait_guest_running(&node);
    let (s, _, b) = invoke(&node, &key, "echo", b"still here");
    assert_eq!((s, b.as_slice()), (200, &b"still here"[..]));
    let (s, b, took) = spin.join().unwrap();
    assert_eq!(s, 504, "{}", String::from_utf8_lossy(&b));
    assert_eq!(code(&b), "FUNCTION_TIMEOUT");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "took {took:?}"
    );
}

/// Memory pair: 1 MiB of growth under a 4 MiB cap runs; a bomb under a 2 MiB
/// cap is stopped with FUNCTION_MEMORY_LIMIT.
#[test]
fn functions_memory_obeyed_and_violated() {
    let node = start("");
    let key = node.create_namespace("fm");
    deploy(
        &node,
        &key,
        "grow",
        MEMORY_ONE_MIB.as_bytes(),
        &[("memory_limit_mb", "4")],
    );
    deploy(
        &node,
        &key,
        "bomb",
        MEMORY_BOMB.as_bytes(),
        &[("memory_limit_mb", "2")],
    );
    assert_eq!(invoke(&node, &key, "grow", b"").0, 200);
    let (s, _, b) = invoke(&node, &key, "bomb", b"");
    assert_eq!(s, 500, "{}", String::from_utf8_lossy(&b));
    assert_eq!(code(&b), "FUNCTION_MEMORY_LIMIT");
}

/// Stack pair: 1,000-deep recursion runs; unbounded recursion is 500 FUNCTION_TRAPPED.
#[test]
fn functions_stack_obeyed_and_violated() {
    let node = start("");
    let key = node.create_namespace("fs");
    deploy(&node, &key, "deep", STACK_BOUNDED.as_bytes(), &[]);
    deploy(&node, &key, "overflow", STACK_OVERFLOW.as_bytes(), &[]);
    assert_eq!(invoke(&node, &key, "deep", b"").0, 200);
    let (s, _, b) = invoke(&node, &key, "overflow", b"");
    assert_eq!(s, 500);
    assert_eq!(code(&b), "FUNCTION_TRAPPED");
    assert!(
        String::from_utf8_lossy(&b).contains("stack"),
        "{}",
        String::from_utf8_lossy(&b)
    );
}

/// Depth pair: a self-invoking chain runs at depths 0..=5 and the call that
/// would be depth 6 is refused with LIMIT (-4): the answer is "4" + 5 dots.
#[test]
fn functions_invoke_depth_limit() {
    let node = start("");
    let key = node.create_namespace("fd");
    deploy(&node, &key, "chain", CHAIN.as_bytes(), &[]);
    let (s, _, b) = invoke(&node, &key, "chain", b"");
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(String::from_utf8_lossy(&b), "4.....");
}

/// Fair-share pair: namespace A alone takes both workers; with its queue (1)
/// full it answers 429 FUNCTION_BUSY with Retry-After at once, while namespace
/// B's invoke is admitted and served at once (on the pool's spare thread,
/// while A's spins still hold both workers) and A's waiting call runs too.
#[test]
fn functions_namespace_cap_does_not_starve_others() {
    // The queued call waits for the 6 s spins to end: a wait far past them,
    // so a loaded machine that starts them late still serves it.
    let node = start("namespace_concurrency = 1\nqueue_wait_ms = 30000");
    let ka = node.create_namespace("ca");
    let kb = node.create_namespace("cb");
    deploy(
        &node,
        &ka,
        "spin",
        LOOP.as_bytes(),
        // Long enough that both spins overlap even when the second call is
        // slow to arrive (a loaded machine, a forwarding hop on a cluster).
        &[("timeout_seconds", "6")],
    );
    deploy(&node, &ka, "echo", &echo_wasm(), &[]);
    deploy(&node, &kb, "echo", &echo_wasm(), &[]);
    let call_a = |name: &'static str| {
        let (n2, k2) = (node.base.clone(), ka.clone());
        std::thread::spawn(move || {
            let auth = format!("Bearer {k2}");
            http(
                "POST",
                &format!("{n2}/v1/functions/{name}/invoke"),
                &[("authorization", &auth)],
                Some(b"w"),
            )
            .0
        })
    };
    let spins = [call_a("spin"), call_a("spin")];
    let deadline = Instant::now() + Duration::from_secs(20);
    while node.metric_sum("meshgate_wasm_pool_busy") < 2.0 {
        assert!(
            Instant::now() < deadline,
            "the guests never took both workers"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let waiting = call_a("echo");
    while node.metric_sum("meshgate_wasm_pool_queued") < 1.0 {
        assert!(Instant::now() < deadline, "A's call never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (s, h, b) = invoke(&node, &ka, "echo", b"a");
    assert_eq!(s, 429, "{}", String::from_utf8_lossy(&b));
    assert_eq!(code(&b), "FUNCTION_BUSY");
    assert!(header(&h, "retry-after").is_some());
    let (s, _, b) = invoke(&node, &kb, "echo", b"b");
    assert_eq!((s, b.as_slice()), (200, &b"b"[..]));
    // B did not wait for a worker: both of A's 6 s spins still run.
    assert!(
        spins.iter().all(|s| !s.is_finished()),
        "B was served only after A's spins ended"
    );
    for spin in spins {
        assert_eq!(spin.join().unwrap(), 504);
    }
    assert_eq!(waiting.join().unwrap(), 200);
    // Once the queue has room, A is served again.
    assert_eq!(invoke(&node, &ka, "echo", b"a").0, 200);
}

/// A bad deploy: its parts, the status and code it must get.
type Case<'a> = (Vec<(&'a str, &'a [u8])>, u16, &'a str);

/// Bad deploys: each refused with a clear code, and nothing is stored.
#[test]
fn functions_bad_deploys_store_nothing() {
    let node = start("max_module_bytes = 65536");
    let key = node.create_namespace("fb");
    let echo = echo_wasm();
    let unknown = r#"(module (import "env" "nope" (func)) (func (export "_start")))"#;
    let big = vec![0u8; 70_000];
    let cases: Vec<Case> = vec![
        (
            vec![("name", b"f"), ("wasm", b"hello, not wasm")],
            400,
            "INVALID_MODULE",
        ),
        (
            vec![("name", b"f"), ("wasm", &echo[..100])],
            400,
            "INVALID_MODULE",
        ),
        (
            vec![("name", b"f"), ("wasm", unknown.as_bytes())],
            400,
            "UNKNOWN_IMPORT",
        ),
        (vec![("name", b"f")], 400, "MISSING_PART"),
        (vec![("wasm", &echo)], 400, "MISSING_PART"),
        (
            vec![("name", b"f"), ("wasm", &echo), ("memory_limit_mb", b"0")],
            400,
            "INVALID_LIMIT",
        ),
        (
            vec![("name", b"f"), ("wasm", &echo), ("memory_limit_mb", b"257")],
            400,
            "INVALID_LIMIT",
        ),
        (
            vec![("name", b"f"), ("wasm", &echo), ("timeout_seconds", b"61")],
            400,
            "INVALID_LIMIT",
        ),
        (
            vec![
                ("name", b"f"),
                ("wasm", &echo),
                ("metadata", br#"{"cron":"* *"}"#),
            ],
            400,
            "INVALID_CRON",
        ),
        (
            vec![("name", b"f"), ("wasm", &echo), ("metadata", b"{nope")],
            400,
            "INVALID_METADATA",
        ),
        (
            vec![("name", b"Bad/Name"), ("wasm", &echo)],
            400,
            "INVALID_NAME",
        ),
        (
            vec![("name", b"f"), ("wasm", &big)],
            413,
            "MODULE_TOO_LARGE",
        ),
    ];
    for (parts, status, want) in cases {
        let (s, b) = deploy_parts(&node, &key, &parts);
        assert_eq!((s, code(b.as_bytes()).as_str()), (status, want), "{b}");
        if want == "UNKNOWN_IMPORT" {
            assert!(b.contains("env::nope"), "the import is named: {b}");
        }
        assert!(
            function_names(&node, &key).is_empty(),
            "stored after {want}"
        );
    }
    // Not multipart at all.
    let (s, _) = node.with_key(&key, "POST", "/v1/functions", Some(b"{}"));
    assert_eq!(s, 400);
    assert!(function_names(&node, &key).is_empty());
}

/// Isolation: A's function reaches neither B's KV, nor B's topics (B's
/// trigger does not fire), nor B's functions, by nested invoke or HTTP.
#[test]
fn functions_namespaces_are_isolated() {
    let node = start("");
    let ka = node.create_namespace("ia");
    let kb = node.create_namespace("ib");
    let (s, _) = node.with_key(&kb, "PUT", "/v1/kv/secret", Some(b"b-data"));
    assert_eq!(s, 200);
    deploy(
        &node,
        &kb,
        "btrig",
        MARK_HIT.as_bytes(),
        &[("metadata", r#"{"pubsub_topics":["t*"]}"#)],
    );
    // A's own trigger on the same topics: the probe's publish fires it, which
    // shows that publish was taken and its triggers started.
    deploy(
        &node,
        &ka,
        "atrig",
        MARK_HIT.as_bytes(),
        &[("metadata", r#"{"pubsub_topics":["t*"]}"#)],
    );
    deploy(&node, &ka, "probe", PROBE.as_bytes(), &[]);

    let (s, _, b) = invoke(&node, &ka, "probe", b"");
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(
        String::from_utf8_lossy(&b),
        "101",
        "not found, published, not found"
    );

    // HTTP: A's credential cannot call B's function by either route.
    assert_eq!(invoke(&node, &ka, "btrig", b"").0, 404);
    let auth = format!("Bearer {ka}");
    let (s, _, _) = http(
        "POST",
        &node.url("/v1/invoke/ib/btrig"),
        &[("authorization", &auth)],
        Some(b""),
    );
    assert_eq!(s, 403);
    let (s, _, _) = http("POST", &node.url("/v1/invoke/ib/btrig"), &[], Some(b""));
    assert_eq!(s, 401, "not public: anonymous refused");

    // A's publish of "t1" did not fire B's trigger: it fired A's own (the
    // dispatch that would have started B's too), whose mark comes first.
    wait_until(Duration::from_secs(5), "A's trigger never fired", || {
        node.with_key(&ka, "GET", "/v1/kv/hit", None).0 == 200
    });
    assert_eq!(node.with_key(&kb, "GET", "/v1/kv/hit", None).0, 404);

    // The pair: a publish in B fires B's trigger.
    let (s, b) = node.with_key(
        &kb,
        "POST",
        "/v1/pubsub/publish",
        Some(br#"{"topic":"t1","data_base64":"eA=="}"#),
    );
    assert_eq!(s, 200, "{b}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while node.with_key(&kb, "GET", "/v1/kv/hit", None).0 != 200 {
        assert!(Instant::now() < deadline, "B's trigger never fired");
        std::thread::sleep(Duration::from_millis(50));
    }
    // B's functions ran once in all: for B's publish, none for A's.
    wait_until(Duration::from_secs(5), "B's run never counted", || {
        invocations(&node, "ib") >= 1
    });
    assert_eq!(
        invocations(&node, "ib"),
        1,
        "B's trigger ran for A's publish"
    );
}

/// A public function answers anonymous callers on /v1/invoke/{namespace}/{name}.
#[test]
fn functions_public_route() {
    let node = start("");
    let key = node.create_namespace("pub");
    deploy(&node, &key, "echo", &echo_wasm(), &[("is_public", "true")]);
    let (s, _, b) = http("POST", &node.url("/v1/invoke/pub/echo"), &[], Some(b"hi"));
    assert_eq!((s, b.as_slice()), (200, &b"hi"[..]));
    let (s, _, _) = http("POST", &node.url("/v1/invoke/pub/none"), &[], Some(b"hi"));
    assert_eq!(s, 404);
}

/// An anonymous call of a private function on the public route is refused
/// from its record: the node loads or compiles no module for it (after a
/// restart nothing is in memory), while a public one is loaded and runs.
#[test]
fn functions_public_route_refuses_private_before_compiling() {
    if single_node_only() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let opts = NodeOpts {
        config: config(""),
        data_dir: Some(tmp.path().join("data")),
        ..Default::default()
    };
    let mut node = TestNode::start_with(opts.clone());
    let key = node.create_namespace("priv");
    deploy(&node, &key, "secret", &echo_wasm(), &[]);
    let public = br#"(module (func (export "_start")) (func (export "other")))"#;
    deploy(&node, &key, "open", public, &[("is_public", "true")]);
    node.kill9();
    node = TestNode::start_with(opts);
    // Modules loaded (from the artifact cache) or compiled since the start.
    let loaded = |node: &TestNode| {
        let (s, b) = node.with_key(&key, "GET", "/v1/functions/secret", None);
        assert_eq!(s, 200, "{b}");
        let e = &json(&b)["engine"];
        e["cache_hits"].as_u64().unwrap() + e["cache_misses"].as_u64().unwrap()
    };
    assert_eq!(loaded(&node), 0);
    for _ in 0..3 {
        let (s, _, b) = http(
            "POST",
            &node.url("/v1/invoke/priv/secret"),
            &[],
            Some(b"hi"),
        );
        assert_eq!(s, 401, "{}", String::from_utf8_lossy(&b));
        assert_eq!(
            json(&String::from_utf8_lossy(&b))["error"]["code"],
            "MISSING_CREDENTIAL"
        );
    }
    assert_eq!(
        loaded(&node),
        0,
        "a private module was loaded for an anonymous caller"
    );
    // The pair: a public function is loaded for the same caller.
    let (s, _, b) = http("POST", &node.url("/v1/invoke/priv/open"), &[], Some(b""));
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(loaded(&node), 1);
    drop(tmp);
}

/// Secrets are listed by name only and reach the guest as env vars (not shown here:
/// the C echo does not print env); deleting one makes it 404.
#[test]
fn functions_secrets() {
    let node = start("");
    let key = node.create_namespace("sec");
    let (s, b) = node.with_key(
        &key,
        "PUT",
        "/v1/functions/secrets",
        Some(br#"{"key":"API_TOKEN","value":"hunter2"}"#),
    );
    assert_eq!(s, 200, "{b}");
    let (s, b) = node.with_key(&key, "GET", "/v1/functions/secrets", None);
    assert_eq!(s, 200);
    assert_eq!(json(&b)["secrets"], serde_json::json!(["API_TOKEN"]));
    assert!(!b.contains("hunter2"));
    let (s, _) = node.with_key(&key, "DELETE", "/v1/functions/secrets/API_TOKEN", None);
    assert_eq!(s, 200);
    let (s, _) = node.with_key(&key, "DELETE", "/v1/functions/secrets/API_TOKEN", None);
    assert_eq!(s, 404);
}

/// SIGKILL in the middle of a deploy: after a restart the function is at its
/// old version or its new one and answers; the restart serves the first
/// invoke from the artifact cache (no compile).
#[test]
fn functions_crash_during_deploy_and_warm_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let opts = NodeOpts {
        config: config(""),
        data_dir: Some(dir.clone()),
        ..Default::default()
    };
    let mut node = TestNode::start_with(opts.clone());
    let key = node.create_namespace("crash");
    deploy(&node, &key, "f", &echo_wasm(), &[]);
    for (i, delay_ms) in [0u64, 5, 20, 60].into_iter().enumerate() {
        // A different module each round, so every deploy compiles and stores a blob.
        let wat = format!(r#"(module (func (export "_start")) (func (export "round_{i}")))"#);
        let body = multipart(&[("name", b"f"), ("wasm", wat.as_bytes())]);
        let url = node.url("/v1/functions");
        let auth = format!("Bearer {key}");
        let t = std::thread::spawn(move || {
            let ct = format!("multipart/form-data; boundary={BOUNDARY}");
            std::panic::catch_unwind(|| {
                http(
                    "POST",
                    &url,
                    &[("authorization", &auth), ("content-type", &ct)],
                    Some(&body),
                )
            })
            .ok()
        });
        // Kept: not a wait for anything. The delay is the round's crash
        // point (0 to 60 ms into the deploy); no event marks a point inside
        // the deploy to kill at, and the test is that any point is safe.
        std::thread::sleep(Duration::from_millis(delay_ms));
        node.kill9();
        let _ = t.join();
        node = TestNode::start_with(opts.clone());
        let (s, b) = node.with_key(&key, "GET", "/v1/functions/f", None);
        assert_eq!(s, 200, "{b}");
        let v = json(&b)["function"]["current_version"].as_u64().unwrap();
        assert!(v >= 1 && v <= 2 + i as u64, "version {v}");
        let (s, _, b) = invoke(&node, &key, "f", b"ping");
        assert_eq!(s, 200, "round {i}: {}", String::from_utf8_lossy(&b));
    }
    // A clean restart: the first invoke loads the compiled artifact.
    node.kill9();
    let node = TestNode::start_with(opts);
    let (s, _, _) = invoke(&node, &key, "f", b"ping");
    assert_eq!(s, 200);
    assert_eq!(metric(&node, "meshgate_wasm_cache_misses_total"), 0);
    assert!(metric(&node, "meshgate_wasm_cache_hits_total") >= 1);
    drop(tmp);
}

/// Cron: a 6-field every-second schedule fires the function, and keeps firing
/// after a restart without any request touching the namespace.
#[test]
fn functions_cron_trigger() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = NodeOpts {
        config: config(""),
        data_dir: Some(tmp.path().join("data")),
        ..Default::default()
    };
    let mut node = TestNode::start_with(opts.clone());
    let key = node.create_namespace("cron");
    deploy(
        &node,
        &key,
        "tick",
        MARK_HIT.as_bytes(),
        &[("metadata", r#"{"cron":"* * * * * *"}"#)],
    );
    let wait_hit = |node: &TestNode| {
        let deadline = Instant::now() + Duration::from_secs(6);
        while node.with_key(&key, "GET", "/v1/kv/hit", None).0 != 200 {
            assert!(Instant::now() < deadline, "cron never fired");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait_hit(&node);
    node.kill9();
    // After a restart no request touches the namespace: only /metrics is read.
    let node = TestNode::start_with(opts);
    let deadline = Instant::now() + Duration::from_secs(6);
    loop {
        if invocations(&node, "cron") >= 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "cron did not fire after the restart"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The CLI deploys, lists, invokes, shows the logs and deletes.
#[test]
fn functions_cli() {
    let node = start("");
    let key = node.create_namespace("cli");
    let run = |args: &[&str], stdin: Option<&[u8]>| {
        use std::io::Write;
        let mut c = std::process::Command::new(crate::common::bin())
            .args(args)
            .args(["--url", node.base.as_str(), "--key", key.as_str()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        if let Some(i) = stdin {
            c.stdin.take().unwrap().write_all(i).unwrap();
        }
        drop(c.stdin.take());
        let out = c.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let echo = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/functions/echo.wasm");
    let out = run(
        &["fn", "deploy", echo, "--name", "echo", "--timeout", "5"],
        None,
    );
    assert!(out.contains("\"version\": 1"), "{out}");
    assert!(run(&["fn", "list"], None).contains("\"echo\""));
    assert_eq!(run(&["fn", "invoke", "echo", "hello"], None), "hello");
    assert_eq!(
        run(&["fn", "invoke", "echo"], Some(b"from stdin")),
        "from stdin"
    );
    // `fn logs` prints the function's invocation records as JSON: the two
    // calls above (the record writer may lag behind the answers).
    let mut logs = serde_json::Value::Null;
    wait_until(
        Duration::from_secs(10),
        "the two calls in `fn logs`",
        || {
            logs = json(&run(&["fn", "logs", "echo"], None));
            logs["logs"].as_array().is_some_and(|l| l.len() >= 2)
        },
    );
    let records = logs["logs"].as_array().unwrap();
    assert_eq!(records.len(), 2, "{logs:#}");
    for r in records {
        assert_eq!(
            (
                r["function"].as_str(),
                r["status"].as_str(),
                r["trigger"].as_str()
            ),
            (Some("echo"), Some("ok"), Some("http")),
            "{r:#}"
        );
    }
    run(&["fn", "delete", "echo"], None);
    assert!(!run(&["fn", "list"], None).contains("\"echo\""));
}

/// Publishes "loop" again whenever it runs (a trigger that feeds itself).
const REPUBLISH: &str = r#"(module
  (import "meshgate" "publish" (func $publish (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 512) "loop")
  (func (export "_start")
    (drop (call $publish (i32.const 512) (i32.const 4) (i32.const 512) (i32.const 4)))))"#;

/// The invocations of `ns`'s functions (cluster mode: in the whole cluster).
fn invocations(node: &TestNode, ns: &str) -> u64 {
    node.metric_sum(&format!(
        "meshgate_function_invocations_total{{namespace=\"{ns}\"}}"
    )) as u64
}

/// Trigger depth: a function triggered by the topic it publishes to runs
/// exactly 5 times for one client publish (depths 1 to 5), then the chain stops.
#[test]
fn functions_pubsub_trigger_depth_is_bounded() {
    let node = start("");
    let key = node.create_namespace("loopns");
    deploy(
        &node,
        &key,
        "again",
        REPUBLISH.as_bytes(),
        &[("metadata", r#"{"pubsub_topics":["loop"]}"#)],
    );
    let (s, b) = node.with_key(
        &key,
        "POST",
        "/v1/pubsub/publish",
        Some(br#"{"topic":"loop","data_base64":"eA=="}"#),
    );
    assert_eq!(s, 200, "{b}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while invocations(&node, "loopns") < 5 {
        assert!(Instant::now() < deadline, "chain stalled");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The fifth run's publish (depth 5) is taken like the others (the
    // client's and four runs' before it), and fires nothing.
    let published =
        || node.metric_sum("meshgate_pubsub_published_total{namespace=\"loopns\"}") as u64;
    wait_until(Duration::from_secs(5), "the fifth run's publish", || {
        published() >= 6
    });
    // A sentinel behind it in the namespace's mailbox: a client publish that
    // fires another function. Once that has run, a sixth run of the chain,
    // started before it, would have run too.
    deploy(
        &node,
        &key,
        "sentinel",
        MARK_HIT.as_bytes(),
        &[("metadata", r#"{"pubsub_topics":["sentinel"]}"#)],
    );
    let (s, b) = node.with_key(
        &key,
        "POST",
        "/v1/pubsub/publish",
        Some(br#"{"topic":"sentinel","data_base64":"eA=="}"#),
    );
    assert_eq!(s, 200, "{b}");
    wait_until(Duration::from_secs(5), "the sentinel never ran", || {
        invocations(&node, "loopns") >= 6 && node.with_key(&key, "GET", "/v1/kv/hit", None).0 == 200
    });
    assert_eq!(published(), 7, "the chain's six and the sentinel's one");
    assert_eq!(
        invocations(&node, "loopns"),
        6,
        "five runs and the sentinel"
    );
}

/// The claims provider: a function of the namespace adds custom claims to the
/// namespace's tokens (at issue and at refresh); one that answers no JSON object
/// fails the issue with 502; an unknown function cannot be named.
#[test]
fn claims_provider_adds_custom_claims() {
    let node = TestNode::start();
    let key = node.create_namespace("claims");
    deploy(&node, &key, "echo", &echo_wasm(), &[]);
    let (s, b) = node.op(
        "PUT",
        "/v1/namespaces/claims/claims-provider",
        Some(r#"{"function":"nope"}"#),
    );
    assert_eq!(s, 404, "{b}");
    let (s, b) = node.op(
        "PUT",
        "/v1/namespaces/claims/claims-provider",
        Some(r#"{"function":"echo"}"#),
    );
    assert_eq!(s, 200, "{b}");
    // The echo provider answers its input, a JSON object: {subject, namespace, grants}.
    let body = format!(r#"{{"api_key":"{key}"}}"#);
    let (s, b) = node.with_key("", "POST", "/v1/auth/token", Some(body.as_bytes()));
    assert_eq!(s, 200, "{b}");
    let tokens = json(&b);
    let tok = tokens["access_token"].as_str().unwrap().to_string();
    let (s, b) = node.with_key(&tok, "GET", "/v1/auth/whoami", None);
    assert_eq!(s, 200, "{b}");
    let who = json(&b);
    assert_eq!(who["custom"]["namespace"], "claims");
    assert_eq!(who["custom"]["subject"], who["subject"]);
    // Refresh runs it again.
    let rt = tokens["refresh_token"].as_str().unwrap();
    let (s, b) = node.with_key(
        "",
        "POST",
        "/v1/auth/refresh",
        Some(format!(r#"{{"refresh_token":"{rt}"}}"#).as_bytes()),
    );
    assert_eq!(s, 200, "{b}");
    let tok2 = json(&b)["access_token"].as_str().unwrap().to_string();
    assert_eq!(
        json(&node.with_key(&tok2, "GET", "/v1/auth/whoami", None).1)["custom"]["namespace"],
        "claims"
    );
    // A provider whose output is not a JSON object fails the issue.
    let not_json = "(module (import \"wasi_snapshot_preview1\" \"fd_write\" (func $w (param i32 i32 i32 i32) (result i32))) (memory (export \"memory\") 1) (data (i32.const 16) \"plain\") (func (export \"_start\") (i32.store (i32.const 0) (i32.const 16)) (i32.store (i32.const 4) (i32.const 5)) (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))";
    deploy(&node, &key, "plain", not_json.as_bytes(), &[]);
    assert_eq!(
        node.op(
            "PUT",
            "/v1/namespaces/claims/claims-provider",
            Some(r#"{"function":"plain"}"#)
        )
        .0,
        200
    );
    let (s, b) = node.with_key("", "POST", "/v1/auth/token", Some(body.as_bytes()));
    assert_eq!(s, 502, "{b}");
    assert_eq!(json(&b)["error"]["code"], "CLAIMS_PROVIDER_FAILED");
    // Removing it restores plain tokens.
    assert_eq!(
        node.op(
            "PUT",
            "/v1/namespaces/claims/claims-provider",
            Some(r#"{"function":null}"#)
        )
        .0,
        200
    );
    assert_eq!(
        node.with_key("", "POST", "/v1/auth/token", Some(body.as_bytes()))
            .0,
        200
    );
}

/// A pure guest (only stdout and the `log` import) that runs longer than
/// the budget of a call on the request's thread: it writes a log line,
/// loops a while, then answers. Through the node it answers once, its call
/// record holds the one line (the stopped run on the request thread left
/// nothing), and the node answers other requests meanwhile.
const SLOW_PURE: &str = r#"(module
  (import "meshgate" "log" (func $log (param i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "started")
  (data (i32.const 80) "done")
  (func (export "_start") (local i32)
    (drop (call $log (i32.const 1) (i32.const 64) (i32.const 7)))
    (loop (local.set 0 (i32.add (local.get 0) (i32.const 1)))
          (br_if 0 (i32.lt_u (local.get 0) (i32.const 450000000))))
    (i32.store (i32.const 0) (i32.const 80))
    (i32.store (i32.const 4) (i32.const 4))
    (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"#;

#[test]
fn a_slow_pure_function_answers_once_with_one_set_of_logs() {
    // One HTTP worker: a guest kept on the request's thread would hold it.
    let node = start("[server]\nworkers = 1\n");
    let key = node.create_namespace("fpure");
    deploy(&node, &key, "slow", SLOW_PURE.as_bytes(), &[]);
    let caller = std::thread::spawn({
        let url = node.url("/v1/functions/slow/invoke");
        let auth = format!("Bearer {key}");
        move || http("POST", &url, &[("authorization", &auth)], Some(b""))
    });
    // While the guest runs, the node serves another request: the call is
    // seen in flight (the guest runs from its arrival to its answer), /livez
    // answers, and the call is still running after that answer.
    let in_flight = || {
        let (_, _, b) = http(
            "GET",
            &node.url("/metrics"),
            &[crate::common::OPERATOR_AUTH],
            None,
        );
        String::from_utf8_lossy(&b)
            .lines()
            .find_map(|l| {
                l.strip_prefix("meshgate_http_in_flight ")?
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or(0.0)
    };
    wait_until(Duration::from_secs(30), "the call in flight", || {
        assert!(
            !caller.is_finished(),
            "the call ended before it was seen running"
        );
        in_flight() >= 1.0
    });
    assert_eq!(http("GET", &node.url("/livez"), &[], None).0, 200);
    assert!(
        !caller.is_finished() && in_flight() >= 1.0,
        "/livez answered only once the guest was done"
    );
    let (s, _, b) = caller.join().unwrap();
    assert_eq!(
        (s, b.as_slice()),
        (200, &b"done"[..]),
        "{}",
        String::from_utf8_lossy(&b)
    );
    let mut records = Vec::new();
    wait_until(Duration::from_secs(10), "the call's record", || {
        let (s, b) = node.with_key(&key, "GET", "/v1/functions/slow/logs", None);
        assert_eq!(s, 200);
        records = json(&b)["logs"].as_array().unwrap().clone();
        !records.is_empty()
    });
    assert_eq!(records.len(), 1, "one call, one record: {records:?}");
    let lines: Vec<&str> = records[0]["logs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["message"].as_str().unwrap())
        .collect();
    assert_eq!(lines, ["started"]);
}

/// Prints what a WASI program learns of its environment, as the
/// wasi-testsuite's environ cases check it: `environ_sizes_get`'s errno,
/// count and buffer size, `environ_get`'s errno, each variable's offset in
/// the buffer (u32 little-endian), then the buffer itself (one iovec per
/// `fd_write`: wasmtime-wasi writes only the first of several).
const ENVIRON_PROBE: &str = r#"(module
  (import "wasi_snapshot_preview1" "environ_sizes_get" (func $sizes (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "environ_get" (func $env (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (local $i i32) (local $o i32)
    (i32.store (i32.const 8192) (call $sizes (i32.const 0) (i32.const 4)))
    (i32.store (i32.const 8196) (i32.load (i32.const 0)))
    (i32.store (i32.const 8200) (i32.load (i32.const 4)))
    (i32.store (i32.const 8204) (call $env (i32.const 1024) (i32.const 4096)))
    (local.set $o (i32.const 8208))
    (block $done (loop $next
      (br_if $done (i32.ge_u (local.get $i) (i32.load (i32.const 0))))
      (i32.store (local.get $o)
        (i32.sub (i32.load (i32.add (i32.const 1024) (i32.mul (local.get $i) (i32.const 4))))
                 (i32.const 4096)))
      (local.set $o (i32.add (local.get $o) (i32.const 4)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $next)))
    (i32.store (i32.const 16) (i32.const 8192))
    (i32.store (i32.const 20) (i32.sub (local.get $o) (i32.const 8192)))
    (drop (call $write (i32.const 1) (i32.const 16) (i32.const 1) (i32.const 32)))
    (i32.store (i32.const 16) (i32.const 4096))
    (i32.store (i32.const 20) (i32.load (i32.const 4)))
    (drop (call $write (i32.const 1) (i32.const 16) (i32.const 1) (i32.const 32)))))"#;

/// What `ENVIRON_PROBE` prints under wasmtime-wasi's preview 1 given `env`.
fn environ_under_wasmtime_wasi(env: &[(&str, &str)]) -> Vec<u8> {
    use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
    let engine = wasmtime::Engine::default();
    let module = wasmtime::Module::new(&engine, ENVIRON_PROBE).unwrap();
    let mut linker = wasmtime::Linker::new(&engine);
    wasmtime_wasi::p1::add_to_linker_sync(&mut linker, |t| t).unwrap();
    let out = MemoryOutputPipe::new(1 << 16);
    let wasi = wasmtime_wasi::WasiCtxBuilder::new()
        .args(&["probe"])
        .envs(env)
        .stdout(out.clone())
        .build_p1();
    let mut store = wasmtime::Store::new(&engine, wasi);
    let instance = linker.instantiate(&mut store, &module).unwrap();
    instance
        .get_typed_func::<(), ()>(&mut store, "_start")
        .unwrap()
        .call(&mut store, ())
        .unwrap();
    out.contents().to_vec()
}

/// The probe's output, read back: (count, buffer size, the variables).
fn environ_of(out: &[u8]) -> (u32, u32, Vec<String>) {
    let word = |i: usize| u32::from_le_bytes(out[i * 4..i * 4 + 4].try_into().unwrap());
    assert_eq!((word(0), word(3)), (0, 0), "both calls succeed: {out:?}");
    let (count, size) = (word(1), word(2));
    let buffer = &out[16 + 4 * count as usize..];
    assert_eq!(buffer.len(), size as usize, "{out:?}");
    let vars = (0..count as usize)
        .map(|i| {
            let at = word(4 + i) as usize;
            let end = at + buffer[at..].iter().position(|&b| b == 0).unwrap();
            String::from_utf8(buffer[at..end].to_vec()).unwrap()
        })
        .collect();
    (count, size, vars)
}

/// A guest's environment is exactly what its deployer set: deployed with no
/// variables it sees none (a `traceparent` on the request adds nothing),
/// with two it sees exactly those two.
#[test]
fn a_guest_sees_exactly_the_environment_its_deployer_set() {
    let node = start("");
    let key = node.create_namespace("envs");
    deploy(&node, &key, "none", ENVIRON_PROBE.as_bytes(), &[]);
    deploy(
        &node,
        &key,
        "two",
        ENVIRON_PROBE.as_bytes(),
        &[("metadata", r#"{"env_vars":{"A":"1","B":"two words"}}"#)],
    );
    let auth = format!("Bearer {key}");
    let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let run = |name: &str| {
        let (s, _, b) = http(
            "POST",
            &node.url(&format!("/v1/functions/{name}/invoke")),
            &[("authorization", &auth), ("traceparent", tp)],
            Some(b""),
        );
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
        environ_of(&b)
    };
    assert_eq!(run("none"), (0, 0, vec![]));
    assert_eq!(
        run("two"),
        (2, 16, vec!["A=1".to_string(), "B=two words".to_string()])
    );
}

/// The environ cases of the public wasi-testsuite that need no filesystem
/// (`environ_sizes_get-no-variables`, `environ_sizes_get-multiple-variables`,
/// `environ_get-multiple-variables`, with that suite's variables: a quote
/// and a newline in values), run by the node and by wasmtime-wasi with the
/// same variables: the answers agree byte for byte and are what the cases
/// expect.
#[test]
fn wasi_testsuite_environ_cases_answer_as_wasmtime_wasi() {
    let node = start("");
    let key = node.create_namespace("wasienv");
    let vars = [("a", "text"), ("b", "escap \" ing"), ("c", "new\nline")];
    let env_json = serde_json::json!({
        "env_vars": vars.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
            .collect::<serde_json::Map<String, serde_json::Value>>()
    })
    .to_string();
    deploy(&node, &key, "none", ENVIRON_PROBE.as_bytes(), &[]);
    deploy(
        &node,
        &key,
        "many",
        ENVIRON_PROBE.as_bytes(),
        &[("metadata", env_json.as_str())],
    );
    for (case, name, env, expect) in [
        ("environ_sizes_get-no-variables", "none", &[][..], vec![]),
        (
            "environ_*-multiple-variables",
            "many",
            &vars[..],
            vec!["a=text", "b=escap \" ing", "c=new\nline"],
        ),
    ] {
        let (s, _, ours) = crate::functions::invoke(&node, &key, name, b"");
        assert_eq!(s, 200, "{case}: {}", String::from_utf8_lossy(&ours));
        let theirs = environ_under_wasmtime_wasi(env);
        assert_eq!(ours, theirs, "{case}: meshgate and wasmtime-wasi differ");
        let (count, size, got) = environ_of(&ours);
        let size_expected: usize = expect.iter().map(|v| v.len() + 1).sum();
        assert_eq!(
            (count as usize, size as usize, got),
            (
                expect.len(),
                size_expected,
                expect.iter().map(|v| v.to_string()).collect::<Vec<_>>()
            ),
            "{case}"
        );
    }
}

/// wasmtime's pooling allocator reuses its instance slots: after twenty
/// calls one after another, the slots that held an instance and are free
/// again are at least one (the engine pools) and a handful at most (each
/// call took a slot used before, not a new one).
#[test]
fn calls_reuse_the_pooled_instance_slots() {
    let node = start("");
    let key = node.create_namespace("pooled");
    deploy(&node, &key, "echo", &echo_wasm(), &[]);
    for i in 0..20 {
        let (s, _, b) = invoke(&node, &key, "echo", format!("{i}").as_bytes());
        assert_eq!((s, b), (200, format!("{i}").into_bytes()));
    }
    let mut warm = 0.0;
    wait_until(
        Duration::from_secs(10),
        "the pool gauges sampled with a warm slot",
        || {
            warm = node.metric_sum("meshgate_wasm_instance_slots_warm");
            warm >= 1.0
        },
    );
    assert!(warm <= 4.0, "{warm} slots used for 20 calls in a row");
}

/// A guest with 8 MiB of data in a 10 MiB memory, which reads (input `r`)
/// or writes (`w`) one byte of each 4 KiB page of that data, then puts KV
/// key `ready` and waits (polling) for key `go`.
fn cow_guest() -> Vec<u8> {
    let wat = format!(
        r#"(module
  (import "meshgate" "kv_put" (func $kv_put (param i32 i32 i32 i32) (result i32)))
  (import "meshgate" "kv_get" (func $kv_get (param i32 i32 i32 i32) (result i64)))
  (import "wasi_snapshot_preview1" "fd_read" (func $read (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 160)
  (data (i32.const 0) "{data}")
  (data (i32.const 9437184) "ready")
  (data (i32.const 9437200) "go")
  (func (export "_start")
    (local $p i32) (local $sum i32)
    (i32.store (i32.const 9437400) (i32.const 9437300))
    (i32.store (i32.const 9437404) (i32.const 1))
    (drop (call $read (i32.const 0) (i32.const 9437400) (i32.const 1) (i32.const 9437408)))
    (block $done (loop $page
      (br_if $done (i32.ge_u (local.get $p) (i32.const 8388608)))
      (if (i32.eq (i32.load8_u (i32.const 9437300)) (i32.const 119))
        (then (i32.store8 (local.get $p) (i32.const 98)))
        (else (local.set $sum (i32.add (local.get $sum) (i32.load8_u (local.get $p))))))
      (local.set $p (i32.add (local.get $p) (i32.const 4096)))
      (br $page)))
    (i32.store (i32.const 9437600) (local.get $sum))
    (drop (call $kv_put (i32.const 9437184) (i32.const 5) (i32.const 9437184) (i32.const 5)))
    (loop $wait
      (br_if $wait (i64.lt_s
        (call $kv_get (i32.const 9437200) (i32.const 2) (i32.const 9437500) (i32.const 16))
        (i64.const 0))))))"#,
        data = "a".repeat(8 << 20)
    );
    wat::parse_str(&wat).unwrap()
}

/// The node's anonymous (private, written) resident memory, in KiB.
fn rss_anon_kib(node: &TestNode) -> u64 {
    let pid = node.child.as_ref().unwrap().id();
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// A guest's memory starts from the module's copy-on-write image: while a
/// guest that only read its 8 MiB of data runs, the node's private memory
/// has not grown by that data (the pages are the image's, shared); a guest
/// that wrote one byte of each of those pages, measured the same way, has
/// grown it by about 8 MiB (so the measure sees a copy when there is one:
/// without the image, the data is copied into every instance).
#[test]
fn guest_memory_starts_from_a_copy_on_write_image() {
    if single_node_only() {
        return;
    }
    let node = start("");
    let key = node.create_namespace("cow");
    deploy(
        &node,
        &key,
        "big",
        &cow_guest(),
        &[("timeout_seconds", "30"), ("memory_limit_mb", "16")],
    );
    // Once with `go` already set: the module's image is made, the slot used.
    assert_eq!(node.with_key(&key, "PUT", "/v1/kv/go", Some(b"1")).0, 200);
    assert_eq!(invoke(&node, &key, "big", b"r").0, 200);
    let grown_kib = |mode: &'static [u8]| -> u64 {
        assert_eq!(node.with_key(&key, "DELETE", "/v1/kv/go", None).0, 200);
        let _ = node.with_key(&key, "DELETE", "/v1/kv/ready", None);
        let before = rss_anon_kib(&node);
        std::thread::scope(|s| {
            let url = node.url("/v1/functions/big/invoke");
            let auth = format!("Bearer {key}");
            let call = s.spawn(move || http("POST", &url, &[("authorization", &auth)], Some(mode)));
            wait_until(
                Duration::from_secs(30),
                "the guest went over its data",
                || node.with_key(&key, "GET", "/v1/kv/ready", None).0 == 200,
            );
            let during = rss_anon_kib(&node);
            assert_eq!(node.with_key(&key, "PUT", "/v1/kv/go", Some(b"1")).0, 200);
            let (s, _, b) = call.join().unwrap();
            assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
            during.saturating_sub(before)
        })
    };
    let read = grown_kib(b"r");
    let written = grown_kib(b"w");
    eprintln!("private memory grown while running: read {read} KiB, written {written} KiB");
    assert!(read < 3 << 10, "reading the data grew it by {read} KiB");
    assert!(
        written >= 6 << 10,
        "writing the data grew it by {written} KiB only"
    );
}
