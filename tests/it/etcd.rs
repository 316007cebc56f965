//! A node on etcd (`[cluster] etcd`): it serves from etcd, answers 503
//! `STORE_UNAVAILABLE` while etcd is down, and recovers by itself.

use crate::common::{NodeOpts, TEST_CONFIG, TestNode, json};
use crate::etcd_process::EtcdProcess;
use std::time::{Duration, Instant};

fn start_on(etcd: &EtcdProcess) -> TestNode {
    TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[cluster]\n{}", etcd.cluster_toml()),
        env: vec![(
            "MESHGATE_CLUSTER_SECRET".into(),
            "etcd-test-cluster-secret".into(),
        )],
        ..Default::default()
    })
}

/// A namespace and a KV value live in etcd; etcd stopped: a KV read answers 503
/// STORE_UNAVAILABLE promptly; etcd back on the same data: the same read answers
/// 200 with the value, with no restart of the node.
#[test]
fn etcd_outage_answers_503_then_recovers() {
    let mut etcd = EtcdProcess::start();
    let node = start_on(&etcd);
    let key = node.create_namespace("on-etcd");
    let (s, b) = node.with_key(&key, "PUT", "/v1/kv/greeting", Some(b"hello"));
    assert_eq!(s, 200, "{b}");
    assert_eq!(
        node.with_key(&key, "GET", "/v1/kv/greeting", None),
        (200, "hello".to_string())
    );

    etcd.stop();
    let start = Instant::now();
    let (s, b) = node.with_key(&key, "GET", "/v1/kv/greeting", None);
    assert_eq!(s, 503, "{b}");
    let body = json(&b);
    assert_eq!(body["ok"], false, "{b}");
    assert_eq!(body["error"]["code"], "STORE_UNAVAILABLE", "{b}");
    assert_eq!(body["error"]["retryable"], true, "{b}");
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
    let (s, b) = node.with_key(&key, "PUT", "/v1/kv/other", Some(b"x"));
    assert_eq!(
        (s, json(&b)["error"]["code"].as_str()),
        (503, Some("STORE_UNAVAILABLE"))
    );

    etcd.resume();
    let start = Instant::now();
    loop {
        let (s, b) = node.with_key(&key, "GET", "/v1/kv/greeting", None);
        if s == 200 {
            assert_eq!(b, "hello");
            break;
        }
        assert_eq!(s, 503, "{b}");
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "node did not recover: {s} {b}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (s, b) = node.with_key(&key, "PUT", "/v1/kv/other", Some(b"y"));
    assert_eq!(s, 200, "{b}");
}

/// etcd frozen (connections open, no answers): a KV read answers 503
/// STORE_UNAVAILABLE at the store's request timeout (3 s), not at the HTTP
/// layer's; thawed, the node answers 200 again.
#[test]
fn frozen_etcd_answers_503_at_the_timeout() {
    let etcd = EtcdProcess::start();
    let node = start_on(&etcd);
    let key = node.create_namespace("frozen");
    let (s, b) = node.with_key(&key, "PUT", "/v1/kv/k", Some(b"v"));
    assert_eq!(s, 200, "{b}");
    etcd.freeze();
    let start = Instant::now();
    let (s, b) = node.with_key(&key, "GET", "/v1/kv/k", None);
    let took = start.elapsed();
    etcd.thaw();
    assert_eq!(
        (s, json(&b)["error"]["code"].as_str()),
        (503, Some("STORE_UNAVAILABLE")),
        "{b}"
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
    let start = Instant::now();
    while node.with_key(&key, "GET", "/v1/kv/k", None) != (200, "v".to_string()) {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "node did not recover"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A second node on the same etcd sees what the first wrote, and accepts the
/// first node's keys and tokens: the state and the node secrets are shared.
#[test]
fn two_nodes_share_etcd_state() {
    let etcd = EtcdProcess::start();
    let a = start_on(&etcd);
    let b = start_on(&etcd);
    let key = a.create_namespace("shared");
    let (s, body) = a.with_key(&key, "PUT", "/v1/kv/k", Some(b"from-a"));
    assert_eq!(s, 200, "{body}");
    // Node B never saw the creation: it reads the namespace record from etcd.
    let (s, body) = b.op("GET", "/v1/namespaces/shared", None);
    assert_eq!(s, 200, "{body}");
    // The nodes share the server secret and the JWT key through etcd: A's
    // namespace key and a token A issued work on B.
    assert_eq!(
        b.with_key(&key, "GET", "/v1/kv/k", None),
        (200, "from-a".to_string())
    );
    let (s, body) = a.with_key(
        &key,
        "POST",
        "/v1/auth/token",
        Some(format!("{{\"api_key\":\"{key}\"}}").as_bytes()),
    );
    assert_eq!(s, 200, "{body}");
    let token = json(&body)["access_token"].as_str().unwrap().to_string();
    assert_eq!(
        b.with_key(&token, "GET", "/v1/kv/k", None),
        (200, "from-a".to_string())
    );
    // A key revoked through A: refused by A at once, and by B (which had
    // just read and cached it) within its key cache's second.
    let (s, body) = a.with_key(
        &key,
        "POST",
        "/v1/auth/api-keys",
        Some(br#"{"role":"reader","name":"r"}"#),
    );
    assert_eq!(s, 201, "{body}");
    let v = json(&body);
    let reader = v["api_key"].as_str().unwrap().to_string();
    let id = v["key"]["id"].as_str().unwrap().to_string();
    assert_eq!(b.with_key(&reader, "GET", "/v1/kv/k", None).0, 200);
    let path = format!("/v1/auth/api-keys/{id}");
    assert_eq!(a.with_key(&key, "DELETE", &path, None).0, 200);
    assert_eq!(a.with_key(&reader, "GET", "/v1/kv/k", None).0, 401);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (s, body) = b.with_key(&reader, "GET", "/v1/kv/k", None);
        if s == 401 {
            assert!(body.contains("API_KEY_REVOKED"), "{body}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "B still accepts the revoked key: {s} {body}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Without etcd answering at start-up, the node refuses to start and says why.
#[test]
fn unreachable_etcd_fails_start() {
    let mut etcd = EtcdProcess::start();
    let cluster = etcd.cluster_toml();
    etcd.stop();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, format!("[cluster]\n{cluster}")).unwrap();
    let out = std::process::Command::new(crate::common::bin())
        .arg("serve")
        .arg("--config")
        .arg(&cfg)
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env("MESHGATE_OPERATOR_KEY", crate::common::OPERATOR_KEY)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach etcd at"), "{err}");
}

/// A node process started by hand, so its data folder can be one that does
/// not exist yet (`TestNode` creates it first); killed when dropped.
struct Spawned {
    child: std::process::Child,
    base: String,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `meshgate serve` with `data_dir` (left as it is), `config` written
/// under `tmp` and `env` added; waits until `/readyz` answers 200.
fn spawn_node(
    tmp: &std::path::Path,
    data_dir: &std::path::Path,
    config: &str,
    env: &[(&str, &str)],
) -> Spawned {
    use std::io::{BufRead, BufReader};
    let cfg = tmp.join("spawned-config.toml");
    std::fs::write(&cfg, config).unwrap();
    let mut cmd = std::process::Command::new(crate::common::bin());
    cmd.arg("serve")
        .arg("--config")
        .arg(&cfg)
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(data_dir)
        .env("MESHGATE_OPERATOR_KEY", crate::common::OPERATOR_KEY)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn meshgate");
    let (stdout, stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let log2 = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            log2.lock().unwrap().push_str(&format!("{line}\n"));
        }
    });
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(a) = line.strip_prefix("meshgate listening on ") {
                let _ = tx.send(a.to_string());
            }
        }
    });
    let mut node = Spawned {
        child,
        base: String::new(),
        stderr: log,
    };
    node.base = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("node did not start: {}", node.stderr.lock().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(30);
    while crate::common::http("GET", &format!("{}/readyz", node.base), &[], None).0 != 200 {
        assert!(
            Instant::now() < deadline,
            "node never became ready: {}",
            node.stderr.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    node
}

/// A cluster node given a data folder that does not exist yet, and its etcd
/// endpoint as a bare `MESHGATE_CLUSTER_ETCD=http://…` (no TOML array): it
/// creates the folder, keeps its keys there and serves from etcd.
#[test]
fn cluster_node_starts_with_a_fresh_data_folder() {
    let etcd = EtcdProcess::start_plain();
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("not").join("yet").join("data");
    assert!(!data.exists());
    let url = etcd.url();
    let node = spawn_node(
        tmp.path(),
        &data,
        TEST_CONFIG,
        &[
            ("MESHGATE_CLUSTER_ETCD", url.as_str()),
            ("MESHGATE_CLUSTER_SECRET", "etcd-test-cluster-secret"),
        ],
    );
    assert!(data.join("server.secret").is_file());
    assert!(data.join("jwt.key").is_file());
    let auth = format!("Bearer {}", crate::common::OPERATOR_KEY);
    let (s, _, b) = crate::common::http(
        "POST",
        &format!("{}/v1/namespaces", node.base),
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
        Some(br#"{"name":"fresh"}"#),
    );
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    // The namespace lives in etcd: a second node on the same etcd sees it.
    let other = start_on(&etcd);
    assert_eq!(other.op("GET", "/v1/namespaces/fresh", None).0, 200);
}

/// `MESHGATE_CLUSTER_ETCD` with two endpoints, comma-separated: a node
/// started on two that answer (the one test etcd, twice) serves from etcd,
/// and one started on two that are down names both in its refusal.
#[test]
fn etcd_endpoints_as_a_comma_list_in_the_environment() {
    let etcd = EtcdProcess::start_plain();
    let url = etcd.url();
    let node = TestNode::start_with(NodeOpts {
        config: TEST_CONFIG.into(),
        env: vec![
            ("MESHGATE_CLUSTER_ETCD".into(), format!("{url}, {url}")),
            (
                "MESHGATE_CLUSTER_SECRET".into(),
                "etcd-test-cluster-secret".into(),
            ),
        ],
        ..Default::default()
    });
    let key = node.create_namespace("listed");
    let (s, b) = node.with_key(&key, "PUT", "/v1/kv/k", Some(b"v"));
    assert_eq!(s, 200, "{b}");
    let other = start_on(&etcd);
    assert_eq!(other.op("GET", "/v1/namespaces/listed", None).0, 200);

    let mut stopped = EtcdProcess::start_plain();
    let first = stopped.url();
    stopped.stop();
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("config.toml");
    std::fs::write(&cfg, "").unwrap();
    let out = std::process::Command::new(crate::common::bin())
        .arg("serve")
        .arg("--config")
        .arg(&cfg)
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(tmp.path().join("data"))
        .env("MESHGATE_OPERATOR_KEY", crate::common::OPERATOR_KEY)
        .env("MESHGATE_CLUSTER_SECRET", "etcd-test-cluster-secret")
        .env(
            "MESHGATE_CLUSTER_ETCD",
            format!("{first},http://127.0.0.1:{dead}"),
        )
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "cannot reach etcd at {first}, http://127.0.0.1:{dead}"
        )),
        "{err}"
    );
}

/// Deletes the KV key "count"; traps if the host call fails.
const RESET: &str = r#"(module
  (import "meshgate" "kv_delete" (func $kv_delete (param i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 512) "count")
  (func (export "_start")
    (if (call $kv_delete (i32.const 512) (i32.const 5)) (then unreachable))))"#;

fn example(name: &str) -> Vec<u8> {
    std::fs::read(format!(
        "{}/examples/functions/{name}.wasm",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

/// Functions on a node backed by etcd reach the store from the WASM workers:
/// the KV counter counts 1, 2 (kv_get, kv_put), a reset (kv_delete) starts
/// it over, a nested invoke resolves its callee from etcd, a publish and a
/// function with a secret run, and the invocation records are written.
#[test]
fn functions_reach_etcd_from_the_guest() {
    use crate::functions::{deploy, invoke};
    let etcd = EtcdProcess::start();
    let node = start_on(&etcd);
    let key = node.create_namespace("fn-etcd");
    deploy(&node, &key, "counter", &example("counter"), &[]);
    deploy(&node, &key, "reset", RESET.as_bytes(), &[]);
    let count = |want: &str| {
        let (s, _, b) = invoke(&node, &key, "counter", b"");
        let b = String::from_utf8_lossy(&b).into_owned();
        assert_eq!((s, b.trim()), (200, want), "{b}");
    };
    count("1");
    count("2");
    // The guest's KV is the namespace's KV.
    assert_eq!(
        node.with_key(&key, "GET", "/v1/kv/count", None),
        (200, "2".to_string())
    );
    let (s, _, b) = invoke(&node, &key, "reset", b"");
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(node.with_key(&key, "GET", "/v1/kv/count", None).0, 404);
    count("1");

    // Nested invoke: the callee is resolved on the worker thread.
    deploy(&node, &key, "echo", &example("echo"), &[]);
    deploy(&node, &key, "caller", &example("caller"), &[]);
    let (s, _, b) = invoke(&node, &key, "caller", b"through etcd");
    assert_eq!(
        (s, String::from_utf8_lossy(&b).as_ref()),
        (200, "through etcd")
    );
    deploy(&node, &key, "publisher", &example("publisher"), &[]);
    let (s, _, b) = invoke(&node, &key, "publisher", b"hello");
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert!(String::from_utf8_lossy(&b).contains("\"published\":5"));
    let (s, b) = node.with_key(
        &key,
        "PUT",
        "/v1/functions/secrets",
        Some(br#"{"key":"API_TOKEN","value":"hunter2"}"#),
    );
    assert_eq!(s, 200, "{b}");
    let (s, _, b) = invoke(&node, &key, "echo", b"with a secret");
    assert_eq!(
        (s, String::from_utf8_lossy(&b).as_ref()),
        (200, "with a secret")
    );

    // The counter's three invocations are recorded (written by the node's writer).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (s, b) = node.with_key(&key, "GET", "/v1/functions/counter/logs", None);
        assert_eq!(s, 200, "{b}");
        let n = json(&b)["logs"].as_array().map_or(0, Vec::len);
        if n == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "{n} records: {b}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
