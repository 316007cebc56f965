//! Quotas per namespace (docs/quotas.md): each quota reached and refused
//! with `QUOTA_EXCEEDED` naming it, nothing partial stored, another
//! namespace untouched; the operator's overrides; usage exact after a
//! restart and across two nodes of a cluster writing at once.

use crate::common::*;
use crate::functions::deploy as deploy_fn;
use awc::ws::{self, Frame};
use futures_util::{SinkExt as _, StreamExt as _};
use std::time::Duration;

/// Small quotas, so each is reached in a few requests.
const QUOTAS: &str = "[quotas]\nkv_bytes = 100\nkv_keys = 3\nfunctions = 1\nmodule_bytes = 1000000\ndeployments = 1\nhosts = 2\nsite_bytes = 64\nsockets = 1\nsubscriptions = 2\n";

fn node_with_quotas() -> TestNode {
    TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}{QUOTAS}"),
        ..Default::default()
    })
}

fn code_of(body: &str) -> String {
    json(body)["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The `used` of one quota as `GET /v1/namespaces/{ns}/quotas` shows it to the namespace.
fn used(node: &TestNode, key: &str, ns: &str, quota: &str) -> u64 {
    let (s, b) = node.with_key(key, "GET", &format!("/v1/namespaces/{ns}/quotas"), None);
    assert_eq!(s, 200, "{b}");
    json(&b)["quotas"][quota]["used"]
        .as_u64()
        .unwrap_or_else(|| panic!("no {quota} in {b}"))
}

fn put(node: &TestNode, key: &str, k: &str, v: &[u8]) -> (u16, String) {
    node.with_key(key, "PUT", &format!("/v1/kv/{k}"), Some(v))
}

/// KV: a write past `kv_bytes` is 413 and one past `kv_keys` 429, both
/// `QUOTA_EXCEEDED` naming the quota, with nothing written; shrinking and
/// deleting give room back; another namespace is not limited by this one.
#[test]
fn kv_quotas_refuse_whole_and_give_room_back() {
    let node = node_with_quotas();
    let key = node.create_namespace("qkv");
    let other = node.create_namespace("qkv-other");
    // "a" + 50 bytes = 51 of 100.
    assert_eq!(put(&node, &key, "a", &[b'x'; 50]).0, 200);
    assert_eq!(used(&node, &key, "qkv", "kv_bytes"), 51);
    let (s, b) = put(&node, &key, "b", &[b'y'; 60]);
    assert_eq!((s, code_of(&b).as_str()), (413, "QUOTA_EXCEEDED"), "{b}");
    assert!(b.contains("kv_bytes"), "names the quota: {b}");
    assert_eq!(
        node.with_key(&key, "GET", "/v1/kv/b", None).0,
        404,
        "nothing written"
    );
    assert_eq!(used(&node, &key, "qkv", "kv_bytes"), 51);
    // Overwriting "a" smaller makes room.
    assert_eq!(put(&node, &key, "a", &[b'x'; 10]).0, 200);
    assert_eq!(put(&node, &key, "b", &[b'y'; 60]).0, 200);
    assert_eq!(used(&node, &key, "qkv", "kv_bytes"), 11 + 61);
    assert_eq!(put(&node, &key, "c", b"1").0, 200);
    // A fourth key: past kv_keys (3).
    let (s, b) = put(&node, &key, "d", b"1");
    assert_eq!((s, code_of(&b).as_str()), (429, "QUOTA_EXCEEDED"), "{b}");
    assert!(b.contains("kv_keys"), "{b}");
    assert_eq!(node.with_key(&key, "GET", "/v1/kv/d", None).0, 404);
    // Overwriting an existing key is not a new key.
    assert_eq!(put(&node, &key, "c", b"2").0, 200);
    assert_eq!(node.with_key(&key, "DELETE", "/v1/kv/c", None).0, 200);
    assert_eq!(used(&node, &key, "qkv", "kv_keys"), 2);
    assert_eq!(put(&node, &key, "d", b"1").0, 200);
    // The other namespace has its own quota, untouched.
    assert_eq!(put(&node, &other, "a", &[b'z'; 90]).0, 200);
    assert_eq!(used(&node, &other, "qkv-other", "kv_bytes"), 91);
    // A namespace cannot read another's quotas.
    let (s, b) = node.with_key(&other, "GET", "/v1/namespaces/qkv/quotas", None);
    assert_eq!(
        (s, code_of(&b).as_str()),
        (403, "NAMESPACE_MISMATCH"),
        "{b}"
    );
}

/// A guest's `kv_put` counts like any other write: past `kv_keys` the host
/// call fails and nothing is written; with room again the guest writes.
#[test]
fn a_guests_kv_writes_count_against_the_quota() {
    let node = node_with_quotas();
    let key = node.create_namespace("qguest");
    let counter = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/functions/counter.wasm"
    ))
    .unwrap();
    deploy_fn(&node, &key, "counter", &counter, &[]);
    for k in ["a", "b", "c"] {
        assert_eq!(put(&node, &key, k, b"1").0, 200);
    }
    let (_, _, out) = crate::functions::invoke(&node, &key, "counter", b"");
    assert_ne!(
        String::from_utf8_lossy(&out).trim(),
        "1",
        "the guest's write went through"
    );
    assert_eq!(
        node.with_key(&key, "GET", "/v1/kv/count", None).0,
        404,
        "nothing written by the refused guest"
    );
    assert_eq!(used(&node, &key, "qguest", "kv_keys"), 3);
    assert_eq!(node.with_key(&key, "DELETE", "/v1/kv/a", None).0, 200);
    let (s, _, out) = crate::functions::invoke(&node, &key, "counter", b"");
    assert_eq!((s, String::from_utf8_lossy(&out).trim()), (200, "1"));
    assert_eq!(used(&node, &key, "qguest", "kv_keys"), 3);
}

/// A function deploy by multipart: status and body.
fn deploy_raw(node: &TestNode, key: &str, name: &str, wasm: &[u8]) -> (u16, String) {
    let boundary = "qfnboundary";
    let mut body = Vec::new();
    body.extend_from_slice(
        format!("--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\n{name}\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"wasm\"; filename=\"m.wasm\"\r\nContent-Type: application/wasm\r\n\r\n").as_bytes(),
    );
    body.extend_from_slice(wasm);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let auth = format!("Bearer {key}");
    let ct = format!("multipart/form-data; boundary={boundary}");
    let (s, _, b) = http(
        "POST",
        &node.url("/v1/functions"),
        &[("authorization", &auth), ("content-type", &ct)],
        Some(&body),
    );
    (s, String::from_utf8_lossy(&b).into_owned())
}

/// Functions: a second function is 429 (`functions`), a new version of the
/// first is not; `module_bytes` counts every kept version (413 past it);
/// nothing stored by a refused deploy; deleting gives the quota back.
#[test]
fn function_quotas_refuse_whole() {
    let node = node_with_quotas();
    let key = node.create_namespace("qfn");
    let echo = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/functions/echo.wasm"
    ))
    .unwrap();
    deploy_fn(&node, &key, "one", &echo, &[]);
    deploy_fn(&node, &key, "one", &echo, &[]);
    assert_eq!(used(&node, &key, "qfn", "functions"), 1);
    assert_eq!(
        used(&node, &key, "qfn", "module_bytes"),
        2 * echo.len() as u64
    );
    let (s, before) = node.with_key(&key, "GET", "/v1/functions", None);
    assert_eq!(s, 200);
    let (s, b) = deploy_raw(&node, &key, "two", &echo);
    assert_eq!((s, code_of(&b).as_str()), (429, "QUOTA_EXCEEDED"), "{b}");
    assert!(b.contains("functions"), "{b}");
    assert_eq!(node.with_key(&key, "GET", "/v1/functions", None).1, before);
    // The operator lowers module_bytes to what the kept versions use: a
    // new version is refused (413), the function still serves.
    let (s, b) = node.op(
        "PUT",
        "/v1/namespaces/qfn/quotas",
        Some(&format!("{{\"module_bytes\": {}}}", 2 * echo.len())),
    );
    assert_eq!(s, 200, "{b}");
    let (s, b) = deploy_raw(&node, &key, "one", &echo);
    assert_eq!((s, code_of(&b).as_str()), (413, "QUOTA_EXCEEDED"), "{b}");
    assert!(b.contains("module_bytes"), "{b}");
    let (s, v) = node.with_key(&key, "GET", "/v1/functions/one/versions", None);
    assert_eq!(s, 200);
    assert_eq!(
        json(&v)["versions"].as_array().map(Vec::len),
        Some(2),
        "{v}"
    );
    let (s, _, out) = crate::functions::invoke(&node, &key, "one", b"still");
    assert_eq!((s, &out[..]), (200, &b"still"[..]));
    // Deleting gives both quotas back.
    assert_eq!(
        node.with_key(&key, "DELETE", "/v1/functions/one", None).0,
        200
    );
    assert_eq!(used(&node, &key, "qfn", "functions"), 0);
    assert_eq!(used(&node, &key, "qfn", "module_bytes"), 0);
    deploy_fn(&node, &key, "two", &echo, &[]);
}

fn tarball(files: &[(&str, &[u8])]) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut b = tar::Builder::new(gz);
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_path(path).unwrap();
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap().finish().unwrap()
}

fn deploy_site(node: &TestNode, key: &str, name: &str, hosts: &str, tgz: &[u8]) -> (u16, String) {
    let boundary = "qsiteboundary";
    let mut body = Vec::new();
    for (n, data) in [
        ("name", name.as_bytes()),
        ("hosts", hosts.as_bytes()),
        ("tarball", tgz),
    ] {
        body.extend_from_slice(
            format!("--{boundary}\r\ncontent-disposition: form-data; name=\"{n}\"; filename=\"{n}\"\r\ncontent-type: application/octet-stream\r\n\r\n").as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    let auth = format!("Bearer {key}");
    let ct = format!("multipart/form-data; boundary={boundary}");
    let (s, _, b) = http(
        "POST",
        &node.url("/v1/deployments"),
        &[("authorization", &auth), ("content-type", &ct)],
        Some(&body),
    );
    (s, String::from_utf8_lossy(&b).into_owned())
}

/// Deployments: `hosts`, `site_bytes` and `deployments` each refused with
/// nothing stored (no deployment, no host claim: another namespace can
/// still take the host); a new version of a deployment is not a new one.
#[test]
fn deployment_quotas_refuse_whole() {
    let node = node_with_quotas();
    let key = node.create_namespace("qdep");
    let other = node.create_namespace("qdep-other");
    let small = tarball(&[("index.html", b"hi")]);
    let (s, b) = deploy_site(
        &node,
        &key,
        "s",
        "a.qdep.test,b.qdep.test,c.qdep.test",
        &small,
    );
    assert_eq!((s, code_of(&b).as_str()), (429, "QUOTA_EXCEEDED"), "{b}");
    assert!(b.contains("hosts"), "{b}");
    let big = tarball(&[("index.html", &[b'x'; 100])]);
    let (s, b) = deploy_site(&node, &key, "s", "a.qdep.test", &big);
    assert_eq!((s, code_of(&b).as_str()), (413, "QUOTA_EXCEEDED"), "{b}");
    assert!(b.contains("site_bytes"), "{b}");
    let (s, b) = node.with_key(&key, "GET", "/v1/deployments", None);
    assert_eq!(s, 200);
    assert_eq!(
        json(&b)["deployments"].as_array().map(Vec::len),
        Some(0),
        "{b}"
    );
    // No claim was left behind: the other namespace takes the host.
    let (s, b) = deploy_site(&node, &other, "o", "c.qdep.test", &small);
    assert_eq!(s, 201, "{b}");
    let (s, b) = deploy_site(&node, &key, "s", "a.qdep.test,b.qdep.test", &small);
    assert_eq!(s, 201, "{b}");
    let (s, b) = deploy_site(&node, &key, "s", "a.qdep.test", &small);
    assert_eq!(s, 201, "a new version: {b}");
    assert_eq!(used(&node, &key, "qdep", "deployments"), 1);
    assert_eq!(used(&node, &key, "qdep", "hosts"), 1);
    assert_eq!(used(&node, &key, "qdep", "site_bytes"), 4);
    let (s, b) = deploy_site(&node, &key, "t", "d.qdep.test", &small);
    assert_eq!((s, code_of(&b).as_str()), (429, "QUOTA_EXCEEDED"), "{b}");
    assert!(b.contains("deployments"), "{b}");
    assert_eq!(
        node.with_key(&key, "DELETE", "/v1/deployments/s", None).0,
        200
    );
    assert_eq!(used(&node, &key, "qdep", "deployments"), 0);
    assert_eq!(used(&node, &key, "qdep", "site_bytes"), 0);
    assert_eq!(used(&node, &key, "qdep", "hosts"), 0);
    let (s, b) = deploy_site(&node, &key, "t", "d.qdep.test", &small);
    assert_eq!(s, 201, "{b}");
}

type Socket = actix_codec::Framed<awc::BoxedSocket, awc::ws::Codec>;

async fn try_connect(node: &TestNode, path: &str, key: &str) -> Result<Socket, u16> {
    let sep = if path.contains('?') { '&' } else { '?' };
    let url = format!("ws://{}{path}{sep}token={key}", node.addr);
    match awc::Client::builder()
        .timeout(Duration::from_secs(30))
        .finish()
        .ws(url)
        .connect()
        .await
    {
        Ok((_, s)) => Ok(s),
        Err(awc::error::WsClientError::InvalidResponseStatus(s)) => Err(s.as_u16()),
        Err(e) => panic!("ws connect: {e}"),
    }
}

async fn answer(s: &mut Socket, id: u64) -> serde_json::Value {
    loop {
        let f = tokio::time::timeout(Duration::from_secs(30), s.next())
            .await
            .expect("a frame")
            .expect("open")
            .expect("valid");
        if let Frame::Text(b) = f {
            let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
            if v["id"] == id {
                return v;
            }
        }
    }
}

/// Sockets and subscriptions: a second socket is refused 429 before the
/// upgrade while the first is open, and let in once it closed; a third
/// subscription is refused with a QUOTA_EXCEEDED frame until one ends.
#[actix_rt::test]
async fn socket_and_subscription_quotas() {
    let node = node_with_quotas();
    let key = node.create_namespace("qws");
    let mut first = try_connect(&node, "/v1/ws", &key)
        .await
        .expect("first socket");
    assert_eq!(
        try_connect(&node, "/v1/ws", &key).await.err(),
        Some(429),
        "a second socket past `sockets`"
    );
    for (id, topic) in [(1, "t1"), (2, "t2"), (3, "t3")] {
        let frame = serde_json::json!({"id": id, "type": "subscribe", "topic": topic});
        first
            .send(ws::Message::Text(frame.to_string().into()))
            .await
            .unwrap();
    }
    assert_eq!(answer(&mut first, 1).await["ok"], true);
    assert_eq!(answer(&mut first, 2).await["ok"], true);
    let third = answer(&mut first, 3).await;
    assert_eq!(third["error"]["code"], "QUOTA_EXCEEDED", "{third}");
    let frame = serde_json::json!({"id": 4, "type": "unsubscribe", "topic": "t1"});
    first
        .send(ws::Message::Text(frame.to_string().into()))
        .await
        .unwrap();
    assert_eq!(answer(&mut first, 4).await["ok"], true);
    let frame = serde_json::json!({"id": 5, "type": "subscribe", "topic": "t3"});
    first
        .send(ws::Message::Text(frame.to_string().into()))
        .await
        .unwrap();
    assert_eq!(answer(&mut first, 5).await["ok"], true);
    let _ = first.send(ws::Message::Close(None)).await;
    drop(first);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match try_connect(&node, "/v1/pubsub/ws?topic=t9", &key).await {
            Ok(_) => break,
            Err(429) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(s) => panic!("the socket quota was not given back: {s}"),
        }
    }
}

/// The operator's overrides: shown with the usage, enforced, validated
/// (unknown quota 400, a tenant key 403), and the usage is the same after
/// a restart on the same data folder.
#[test]
fn operator_overrides_and_usage_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let opts = || NodeOpts {
        config: format!("{TEST_CONFIG}{QUOTAS}"),
        data_dir: Some(dir.path().join("data")),
        ..Default::default()
    };
    let node = TestNode::start_with(opts());
    let key = node.create_namespace("qop");
    let (s, b) = node.op(
        "PUT",
        "/v1/namespaces/qop/quotas",
        Some(r#"{"kv_keys": 5}"#),
    );
    assert_eq!(s, 200, "{b}");
    for i in 0..5 {
        assert_eq!(put(&node, &key, &format!("k{i}"), b"v").0, 200);
    }
    assert_eq!(put(&node, &key, "k5", b"v").0, 429);
    let (s, b) = node.op("GET", "/v1/namespaces/qop", None);
    assert_eq!(s, 200, "{b}");
    let shown = json(&b);
    assert_eq!(shown["quotas"]["kv_keys"]["limit"], 5, "{b}");
    assert_eq!(shown["quotas"]["kv_keys"]["used"], 5, "{b}");
    assert_eq!(shown["quotas"]["kv_bytes"]["limit"], 100, "{b}");
    let (s, b) = node.op("PUT", "/v1/namespaces/qop/quotas", Some(r#"{"disk": 5}"#));
    assert_eq!((s, code_of(&b).as_str()), (400, "BAD_REQUEST"), "{b}");
    let (s, b) = node.with_key(
        &key,
        "PUT",
        "/v1/namespaces/qop/quotas",
        Some(br#"{"kv_keys": 99}"#),
    );
    assert_eq!(s, 403, "{b}");
    drop(node);
    let node = TestNode::start_with(opts());
    assert_eq!(used(&node, &key, "qop", "kv_keys"), 5);
    assert_eq!(
        used(&node, &key, "qop", "kv_bytes"),
        5 * 3,
        "\"k0\" + \"v\", five times"
    );
    assert_eq!(put(&node, &key, "k5", b"v").0, 429, "still enforced");
    // Back to the default (3): deleting is always allowed, writing new keys not.
    let (s, _) = node.op("PUT", "/v1/namespaces/qop/quotas", Some("{}"));
    assert_eq!(s, 200);
    assert_eq!(put(&node, &key, "k6", b"v").0, 429);
    assert_eq!(node.with_key(&key, "DELETE", "/v1/kv/k0", None).0, 200);
    assert_eq!(used(&node, &key, "qop", "kv_keys"), 4);
}

/// Two nodes of a cluster, both members of one namespace, write new keys
/// at once: exactly `kv_keys` land cluster-wide, the rest are refused, and
/// both nodes show the same exact usage.
#[cfg(feature = "cluster")]
#[test]
fn usage_is_exact_across_a_cluster() {
    use crate::etcd_process::EtcdProcess;
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let member = |id: &str| NodeOpts {
        config: format!(
            "{TEST_CONFIG}[quotas]\nkv_keys = 20\n[cluster]\n{}node_id = \"{id}\"\nregister_seconds = 1\n",
            etcd.cluster_toml()
        ),
        env: vec![(
            "MESHGATE_CLUSTER_SECRET".into(),
            "quota-test-cluster-secret-0123456789abcdef".into(),
        )],
        data_dir: Some(tmp.path().join(id)),
        listen: Some(format!("127.0.0.1:{}", free_port())),
        ..Default::default()
    };
    let a = TestNode::start_with(member("a"));
    let b = TestNode::start_with(member("b"));
    let (s, body) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"qc","members":["a","b"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    let key = json(&body)["api_key"].as_str().unwrap().to_string();
    let run = |node: &TestNode, tag: &str| {
        (0..15)
            .filter(|i| put(node, &key, &format!("{tag}{i}"), b"v").0 == 200)
            .count()
    };
    let (ok_a, ok_b) = std::thread::scope(|sc| {
        let ta = sc.spawn(|| run(&a, "a"));
        let tb = sc.spawn(|| run(&b, "b"));
        (ta.join().unwrap(), tb.join().unwrap())
    });
    assert_eq!(ok_a + ok_b, 20, "exactly the quota landed: {ok_a} + {ok_b}");
    let (s, list) = a.with_key(&key, "GET", "/v1/kv?limit=100", None);
    assert_eq!(s, 200);
    assert_eq!(
        json(&list)["keys"].as_array().map(Vec::len),
        Some(20),
        "{list}"
    );
    assert_eq!(used(&a, &key, "qc", "kv_keys"), 20);
    assert_eq!(used(&b, &key, "qc", "kv_keys"), 20);
}

/// A KV listing names the keys under its prefix, in byte order, up to its
/// limit, whatever their values weigh: it reads keys only (it read every
/// value too: over 250 values of 1 MB a listing cost the node 41 ms of CPU,
/// BENCHMARKS.md).
#[test]
fn a_kv_listing_names_keys_in_order_up_to_its_limit() {
    let node = TestNode::start();
    let key = node.create_namespace("kl");
    let big = vec![b'x'; 1_000_000];
    for k in ["b/2", "b/1", "a/1", "b/3"] {
        let value: &[u8] = if k.starts_with("b/") { &big } else { b"v" };
        assert_eq!(put(&node, &key, k, value).0, 200);
    }
    let list = |q: &str| {
        let (s, b) = node.with_key(&key, "GET", &format!("/v1/kv?{q}"), None);
        assert_eq!(s, 200, "{b}");
        json(&b)["keys"].clone()
    };
    assert_eq!(list("prefix=b/"), serde_json::json!(["b/1", "b/2", "b/3"]));
    assert_eq!(list("prefix=b/&limit=2"), serde_json::json!(["b/1", "b/2"]));
    assert_eq!(
        list("prefix="),
        serde_json::json!(["a/1", "b/1", "b/2", "b/3"])
    );
    let (s, _) = node.with_key(&key, "DELETE", "/v1/kv/b/2", None);
    assert_eq!(s, 200);
    assert_eq!(list("prefix=b/"), serde_json::json!(["b/1", "b/3"]));
}
