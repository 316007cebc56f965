//! A node on etcd (`[cluster] etcd`): it serves from etcd, answers 503
//! `STORE_UNAVAILABLE` while etcd is down, and recovers by itself.

use crate::common::{NodeOpts, TEST_CONFIG, TestNode, json};
use crate::etcd_process::EtcdProcess;
use std::time::{Duration, Instant};

fn start_on(etcd: &EtcdProcess) -> TestNode {
    TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[cluster]\netcd = [\"{}\"]\n", etcd.url()),
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
    let reader = v["key"].as_str().unwrap().to_string();
    let id = v["record"]["id"].as_str().unwrap().to_string();
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
    let url = etcd.url();
    etcd.stop();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, format!("[cluster]\netcd = [\"{url}\"]\n")).unwrap();
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
