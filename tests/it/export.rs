//! Whole-namespace export and import (`GET /v1/db/export`, `PUT
//! /v1/db/import`, format `meshgate-export` version 2): KV, functions with
//! their versions, sealed secrets and deployments move to a new namespace (on
//! another node of a cluster, and on one sled node) and serve there; an
//! import that fails changes nothing; an import larger than one etcd
//! transaction is one change for readers; bad inputs are 4xx in the envelope.

use crate::common::*;
use crate::deploy::{Upstream, via};
use crate::functions::{deploy, invoke};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// Functions with two workers; loopback upstreams allowed.
const EXTRA: &str = "[functions]\nworkers = 2\n[deploy]\nupstream_allow = [\"127.0.0.0/8\"]\n";

/// A WASI command that writes its whole environment (`K=V\0...`) to stdout:
/// the function's env vars and secrets.
pub(crate) const ENV_WAT: &str = r#"(module
  (import "wasi_snapshot_preview1" "environ_sizes_get" (func $sizes (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "environ_get" (func $get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (drop (call $sizes (i32.const 0) (i32.const 4)))
    (drop (call $get (i32.const 1024) (i32.const 8192)))
    (i32.store (i32.const 16) (i32.const 8192))
    (i32.store (i32.const 20) (i32.load (i32.const 4)))
    (drop (call $write (i32.const 1) (i32.const 16) (i32.const 1) (i32.const 24)))))"#;

fn sled_node() -> TestNode {
    TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}{EXTRA}"),
        ..Default::default()
    })
}

/// Creates a namespace (on `members` when given); returns its owner key.
fn create(node: &TestNode, name: &str, members: Option<&str>) -> String {
    let body = match members {
        Some(m) => json!({"name": name, "members": [m]}),
        None => json!({"name": name}),
    };
    let (s, b) = node.op("POST", "/v1/namespaces", Some(&body.to_string()));
    assert_eq!(s, 201, "create {name}: {b}");
    json(&b)["api_key"].as_str().unwrap().to_string()
}

/// A `.tar.gz` of regular files.
fn tarball(files: &[(&str, &[u8])]) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut b = tar::Builder::new(gz);
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_path(path).unwrap();
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap().finish().unwrap()
}

fn deploy_site(node: &TestNode, key: &str, name: &str, host: &str, index: &[u8]) {
    let boundary = "mgexportboundary3";
    let mut body = Vec::new();
    for (part, data) in [
        ("name", name.as_bytes().to_vec()),
        ("hosts", host.as_bytes().to_vec()),
        ("tarball", tarball(&[("index.html", index)])),
    ] {
        body.extend_from_slice(
            format!("--{boundary}\r\ncontent-disposition: form-data; name=\"{part}\"; filename=\"{part}\"\r\ncontent-type: application/octet-stream\r\n\r\n").as_bytes(),
        );
        body.extend_from_slice(&data);
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
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
}

/// Fills namespace `key` with KV, function `env` (versions 1 and 2), secret
/// API_TOKEN, static site `www` on `www.moved.test` and upstream `api` on
/// `api.moved.test`.
fn fill(node: &TestNode, key: &str, up: &Upstream) {
    for (k, v) in [("greeting", &b"hello"[..]), ("dir/bin", b"\x00\xff")] {
        let (s, b) = node.with_key(key, "PUT", &format!("/v1/kv/{k}"), Some(v));
        assert_eq!(s, 200, "{b}");
    }
    for v in ["1", "2"] {
        let meta = format!(r#"{{"env_vars":{{"VERSION":"{v}"}}}}"#);
        deploy(node, key, "env", ENV_WAT.as_bytes(), &[("metadata", &meta)]);
    }
    let (s, b) = node.with_key(
        key,
        "PUT",
        "/v1/functions/secrets",
        Some(br#"{"key":"API_TOKEN","value":"hunter2"}"#),
    );
    assert_eq!(s, 200, "{b}");
    deploy_site(node, key, "www", "www.moved.test", b"<h1>moved</h1>");
    let (s, b) = node.with_key(
        key,
        "POST",
        "/v1/deployments",
        Some(
            json!({"name": "api", "hosts": ["api.moved.test"], "upstream": {"instances": [up.url()]}})
                .to_string()
                .as_bytes(),
        ),
    );
    assert_eq!(s, 201, "{b}");
}

fn export(node: &TestNode, key: &str) -> String {
    let (s, b) = node.with_key(key, "GET", "/v1/db/export", None);
    assert_eq!(s, 200, "{b}");
    b
}

fn import(node: &TestNode, key: &str, query: &str, body: &[u8]) -> (u16, Value) {
    let (s, b) = node.with_key(key, "PUT", &format!("/v1/db/import{query}"), Some(body));
    (s, serde_json::from_str(&b).unwrap_or(Value::String(b)))
}

/// The error envelope's code, after checking its shape.
fn code(v: &Value) -> &str {
    assert_eq!(v["ok"], false, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(v["error"]["retryable"].is_boolean(), "{v}");
    v["error"]["code"].as_str().unwrap()
}

/// What a namespace holds, as its export shows it, without the secrets'
/// ciphertext (sealed afresh by every export).
fn contents(node: &TestNode, key: &str) -> Value {
    let mut e = json(&export(node, key));
    let names: Vec<Value> = e["secrets"]["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].clone())
        .collect();
    e["secrets"] = json!(names);
    e["namespace"] = Value::Null;
    for d in e["deployments"].as_array_mut().unwrap() {
        d["record"]["namespace"] = Value::Null;
    }
    e
}

fn output(node: &TestNode, key: &str, name: &str) -> String {
    let (s, _, b) = invoke(node, key, name, b"");
    let out = String::from_utf8_lossy(&b).into_owned();
    assert_eq!(s, 200, "{name}: {out}");
    out
}

/// The moved namespace serves everything through `node`: the KV, both
/// function versions with the secret, the site and the upstream.
fn assert_serves(node: &TestNode, key: &str) {
    assert_eq!(
        node.with_key(key, "GET", "/v1/kv/greeting", None),
        (200, "hello".into())
    );
    let out = output(node, key, "env");
    assert!(out.contains("VERSION=2"), "{out:?}");
    assert!(out.contains("API_TOKEN=hunter2"), "{out:?}");
    let out = output(node, key, "env@1");
    assert!(out.contains("VERSION=1"), "{out:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (s, _, b) = via(node, "www.moved.test", "GET", "/", &[], None);
        if s == 200 {
            assert_eq!(b, b"<h1>moved</h1>");
            break;
        }
        assert!(Instant::now() < deadline, "site not served: {s}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (s, _, b) = via(node, "api.moved.test", "GET", "/x", &[], None);
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json(&String::from_utf8_lossy(&b))["path"], "/x");
}

/// The scenario: `src` filled through `from`, exported, imported into a new
/// namespace `dst` (named `dst_name`) through `to`: with `dst`'s owner key
/// refused with 403 `SECRETS_BOUND_ELSEWHERE` (the secrets are sealed to
/// `src`; nothing changes); by the operator re-sealing them, refused with 409
/// `HOST_TAKEN` (nothing changes) while `src` holds the hosts, then, the
/// hosts released, it serves.
fn round_trip(from: &TestNode, src: &str, to: &TestNode, dst: &str, dst_name: &str) {
    let up = Upstream::start("moved");
    fill(from, src, &up);
    assert_serves(from, src);
    let exported = export(from, src);
    let e = json(&exported);
    assert_eq!(
        (e["format"].as_str(), e["version"].as_u64()),
        (Some("meshgate-export"), Some(2))
    );
    assert_eq!(e["functions"][0]["versions"].as_array().unwrap().len(), 2);
    assert!(!exported.contains("hunter2"), "the secret travels sealed");

    let before = contents(to, dst);
    let (s, v) = import(to, dst, "", exported.as_bytes());
    assert_eq!((s, code(&v)), (403, "SECRETS_BOUND_ELSEWHERE"), "{v}");
    assert_eq!(
        contents(to, dst),
        before,
        "a refused import changes nothing"
    );
    let reseal = format!("?secrets=reseal&namespace={dst_name}");
    let (s, v) = import(to, OPERATOR_KEY, &reseal, exported.as_bytes());
    assert_eq!((s, code(&v)), (409, "HOST_TAKEN"), "{v}");
    assert_eq!(
        contents(to, dst),
        before,
        "a refused import changes nothing"
    );
    assert_eq!(to.with_key(dst, "GET", "/v1/kv/greeting", None).0, 404);

    for d in ["www", "api"] {
        let (s, b) = from.with_key(src, "DELETE", &format!("/v1/deployments/{d}"), None);
        assert_eq!(s, 200, "{b}");
    }
    let (s, v) = import(to, OPERATOR_KEY, &reseal, exported.as_bytes());
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["counts"],
        json!({"kv": 2, "functions": 1, "secrets": 1, "deployments": 2, "history_topics": 0})
    );
    assert_serves(to, dst);
}

/// On etcd: a namespace of node a exported and imported into a new
/// namespace of node b (the same cluster secret: the secret opens) serves
/// there: KV, both function versions with the secret, site and upstream.
#[cfg(feature = "cluster")]
#[test]
fn whole_namespace_moves_to_another_node_of_the_cluster() {
    let etcd = crate::etcd_process::EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let node = |id: &str| {
        TestNode::start_with(NodeOpts {
            config: format!(
                "{TEST_CONFIG}{EXTRA}[cluster]\n{}node_id = \"{id}\"\nregister_seconds = 1\n",
                etcd.cluster_toml()
            ),
            env: vec![(
                "MESHGATE_CLUSTER_SECRET".into(),
                "export-test-secret".into(),
            )],
            data_dir: Some(tmp.path().join(id)),
            ..Default::default()
        })
    };
    let (a, b) = (node("a"), node("b"));
    let src = create(&a, "src", Some("a"));
    let dst = create(&b, "dst", Some("b"));
    round_trip(&a, &src, &b, &dst, "dst");
}

/// On one sled node: the same move into a new namespace; then the export
/// of the moved namespace imported on another node (another server
/// secret): 409 `SECRETS_SEALED_ELSEWHERE` and nothing changes, with
/// `?secrets=skip` everything but the secret.
#[test]
fn whole_namespace_moves_on_sled_and_secrets_stay_in_their_cluster() {
    if single_node_only() {
        return;
    }
    let node = sled_node();
    let src = create(&node, "src", None);
    let dst = create(&node, "dst", None);
    round_trip(&node, &src, &node, &dst, "dst");

    let other = sled_node();
    let key = create(&other, "elsewhere", None);
    let exported = export(&node, &dst);
    let before = contents(&other, &key);
    let (s, v) = import(&other, &key, "", exported.as_bytes());
    assert_eq!((s, code(&v)), (409, "SECRETS_SEALED_ELSEWHERE"), "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("secrets=skip")
    );
    assert_eq!(contents(&other, &key), before);
    // The hosts are dst's on `node` but free on `other` (its own store).
    let (s, v) = import(&other, &key, "?secrets=skip", exported.as_bytes());
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["counts"]["secrets"], 0);
    let out = output(&other, &key, "env");
    assert!(
        out.contains("VERSION=2") && !out.contains("API_TOKEN"),
        "{out:?}"
    );
}

/// Imports that fail half way change nothing: a host another namespace
/// holds, a blob that does not match its hash, a function version whose
/// module is not carried (even though the store has it), a module that is
/// no WebAssembly, an invalid host,
/// a body over the limit (413 `IMPORT_TOO_LARGE`); bad inputs are 4xx in
/// the envelope; the KV-only format 1 still imports.
#[test]
fn failed_imports_change_nothing_and_bad_inputs_are_4xx() {
    if single_node_only() {
        return;
    }
    let node = sled_node();
    let victim = create(&node, "victim", None);
    let holder = create(&node, "holder", None);
    let up = Upstream::start("held");
    fill(&node, &victim, &up);
    let (s, b) = node.with_key(
        &holder,
        "POST",
        "/v1/deployments",
        Some(
            json!({"name": "held", "hosts": ["held.test"], "upstream": {"instances": [up.url()]}})
                .to_string()
                .as_bytes(),
        ),
    );
    assert_eq!(s, 201, "{b}");
    let good = json(&export(&node, &victim));
    let before = contents(&node, &victim);

    // A new KV and a deployment on a host of `holder`: the whole import is refused.
    let mut taken = good.clone();
    taken["kv"] = json!([{"key": "new", "value_base64": "bmV3"}]);
    taken["deployments"][0]["versions"][0]["hosts"] = json!(["held.test"]);
    let mut bad_blob = good.clone();
    let sha = bad_blob["functions"][0]["versions"][0]["sha256"]
        .as_str()
        .unwrap()
        .to_string();
    bad_blob["blobs"][&sha] = json!("bm90IHRoZSBtb2R1bGU=");
    // A module the store holds (victim's own) but the export does not carry:
    // a blob is never reached by naming its hash.
    let mut missing_blob = good.clone();
    missing_blob["blobs"].as_object_mut().unwrap().remove(&sha);
    // A module that matches its hash but is no WebAssembly: refused as a deploy would.
    let mut not_wasm = good.clone();
    {
        use base64::Engine;
        let junk = b"not a module at all";
        let junk_sha = hex::encode(ring::digest::digest(&ring::digest::SHA256, junk));
        not_wasm["blobs"][&junk_sha] =
            json!(base64::engine::general_purpose::STANDARD.encode(junk));
        not_wasm["functions"][0]["versions"][0]["sha256"] = json!(junk_sha);
    }
    let mut bad_host = good.clone();
    bad_host["deployments"][1]["versions"][0]["hosts"] = json!(["not a host"]);
    let mut bad_kv = good.clone();
    bad_kv["kv"] = json!([{"key": "k", "value_base64": "***"}]);
    let mut other_version = good.clone();
    other_version["version"] = json!(3);
    let too_large = {
        let mut b = br#"{"format":"meshgate-export","version":2,"kv":[{"key":"k","value_base64":""#
            .to_vec();
        b.extend(std::iter::repeat_n(b'A', (64 << 20) - 40));
        b.extend_from_slice(br#""}]}"#);
        b
    };
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "host taken",
            taken.to_string().into_bytes(),
            409,
            "HOST_TAKEN",
        ),
        (
            "blob hash",
            bad_blob.to_string().into_bytes(),
            400,
            "INVALID_EXPORT",
        ),
        (
            "blob missing",
            missing_blob.to_string().into_bytes(),
            400,
            "INVALID_EXPORT",
        ),
        (
            "bad host",
            bad_host.to_string().into_bytes(),
            400,
            "INVALID_HOST",
        ),
        (
            "not wasm",
            not_wasm.to_string().into_bytes(),
            400,
            "INVALID_MODULE",
        ),
        (
            "bad kv",
            bad_kv.to_string().into_bytes(),
            400,
            "INVALID_EXPORT",
        ),
        (
            "version 3",
            other_version.to_string().into_bytes(),
            400,
            "UNSUPPORTED_EXPORT_VERSION",
        ),
        (
            "no format",
            br#"{"kv":[]}"#.to_vec(),
            400,
            "UNSUPPORTED_EXPORT_FORMAT",
        ),
        ("not JSON", b"{\"format\":".to_vec(), 400, "MALFORMED_JSON"),
        (
            "unknown field",
            br#"{"format":"meshgate-export","version":2,"extra":1}"#.to_vec(),
            400,
            "INVALID_EXPORT",
        ),
        ("too large", too_large, 413, "IMPORT_TOO_LARGE"),
    ];
    for (what, body, status, want) in cases {
        let (s, v) = import(&node, &victim, "", &body);
        assert_eq!((s, code(&v)), (status, want), "{what}: {v}");
        assert_eq!(
            contents(&node, &victim),
            before,
            "{what} changed the namespace"
        );
    }
    let (s, v) = import(
        &node,
        &victim,
        "?secrets=maybe",
        good.to_string().as_bytes(),
    );
    assert_eq!((s, code(&v)), (400, "BAD_QUERY"));
    // `held.test` stays holder's; victim still serves as before.
    let (s, _, b) = via(&node, "held.test", "GET", "/held", &[], None);
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_serves(&node, &victim);
    // The old KV-only format still imports (the KV only).
    let (s, v) = import(
        &node,
        &victim,
        "",
        br#"{"format":1,"kv":[{"key":"only","value_base64":"MQ=="}]}"#,
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        node.with_key(&victim, "GET", "/v1/kv/greeting", None).0,
        404
    );
    assert_eq!(
        node.with_key(&victim, "GET", "/v1/kv/only", None),
        (200, "1".into())
    );
    assert!(output(&node, &victim, "env").contains("API_TOKEN=hunter2"));
}

/// On etcd, imports of 300 keys (more than one etcd transaction holds) into
/// a namespace on members a and b, alternating all-"a" and all-"b" values,
/// made through a while a reader exports through b in a loop: every export
/// is all one value, and the last import's is what stays. An import whose
/// functions/secrets/deployments part exceeds one transaction (130 secrets)
/// is 413 `IMPORT_TOO_LARGE` naming `--max-txn-ops`, nothing changed.
#[cfg(feature = "cluster")]
#[test]
fn import_larger_than_an_etcd_transaction_is_one_change() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let etcd = crate::etcd_process::EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let node = |id: &str| {
        TestNode::start_with(NodeOpts {
            config: format!(
                "{TEST_CONFIG}{EXTRA}[cluster]\n{}node_id = \"{id}\"\nregister_seconds = 1\n",
                etcd.cluster_toml()
            ),
            env: vec![(
                "MESHGATE_CLUSTER_SECRET".into(),
                "export-test-secret".into(),
            )],
            data_dir: Some(tmp.path().join(id)),
            ..Default::default()
        })
    };
    let (a, b) = (node("a"), node("b"));
    let (s, body) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"big","members":["a","b"]}"#),
    );
    assert_eq!(s, 201, "{body}");
    let auth = format!("Bearer {OPERATOR_KEY}");
    let call = |n: &TestNode, method: &str, path: &str, body: Option<&[u8]>| {
        let (s, h, b) = http(
            method,
            &n.url(path),
            &[("authorization", &auth), ("x-namespace", "big")],
            body,
        );
        (
            s,
            header(&h, "x-meshgate-member").map(str::to_string),
            String::from_utf8_lossy(&b).into_owned(),
        )
    };
    let body = |v: &str, n: usize| {
        use base64::Engine;
        let value = base64::engine::general_purpose::STANDARD.encode(v);
        let kv: Vec<Value> = (0..n)
            .map(|i| json!({"key": format!("k{i:03}"), "value_base64": value}))
            .collect();
        json!({"format": "meshgate-export", "version": 2, "kv": kv}).to_string()
    };
    let (s, _, r) = call(&a, "PUT", "/v1/db/import", Some(body("a", 300).as_bytes()));
    assert_eq!(s, 200, "{r}");

    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicUsize::new(0));
    let reader = {
        let (stop, reads, base) = (stop.clone(), reads.clone(), b.base.clone());
        let auth = auth.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let (s, _, body) = http(
                    "GET",
                    &format!("{base}/v1/db/export"),
                    &[("authorization", &auth), ("x-namespace", "big")],
                    None,
                );
                let body = String::from_utf8_lossy(&body);
                assert_eq!(s, 200, "{body}");
                let e = json(&body);
                let values: std::collections::BTreeSet<&str> = e["kv"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x["value_base64"].as_str().unwrap())
                    .collect();
                assert_eq!(e["kv"].as_array().unwrap().len(), 300);
                assert_eq!(values.len(), 1, "an export saw a mix: {values:?}");
                reads.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    for round in 0..8 {
        let v = if round % 2 == 0 { "b" } else { "a" };
        let (s, _, r) = call(&a, "PUT", "/v1/db/import", Some(body(v, 300).as_bytes()));
        assert_eq!(s, 200, "{r}");
    }
    stop.store(true, Ordering::Relaxed);
    reader.join().expect("the reader saw only whole imports");
    assert!(reads.load(Ordering::Relaxed) > 0);
    let (s, _, v) = call(&b, "GET", "/v1/kv/k299", None);
    assert_eq!((s, v.as_str()), (200, "a"));
    // Nothing of the journal is left behind: the KV takes writes at once.
    let (s, _, r) = call(&b, "PUT", "/v1/kv/k000", Some(b"z"));
    assert_eq!(s, 200, "{r}");

    // 130 secrets cannot flip in one transaction with the rest: 413 naming
    // the limit and the etcd setting, and nothing changes.
    let many = create(&a, "many", Some("a"));
    for i in 0..130 {
        let (s, r) = a.with_key(
            &many,
            "PUT",
            "/v1/functions/secrets",
            Some(
                json!({"key": format!("S{i}"), "value": "v"})
                    .to_string()
                    .as_bytes(),
            ),
        );
        assert_eq!(s, 200, "{r}");
    }
    let exported = export(&a, &many);
    let (s, _, before) = call(&b, "GET", "/v1/db/export", None);
    assert_eq!(s, 200);
    let (s, _, r) = call(
        &a,
        "PUT",
        "/v1/db/import?secrets=reseal",
        Some(exported.as_bytes()),
    );
    let v = json(&r);
    assert_eq!((s, code(&v)), (413, "IMPORT_TOO_LARGE"), "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("128") && m.contains("--max-txn-ops"), "{m}");
    let (_, _, after) = call(&b, "GET", "/v1/db/export", None);
    assert_eq!(json(&after), json(&before));
}

/// An export is built in memory and held until its client has read it:
/// twenty clients asking for a 60 MB export and reading slowly held 1.7 GB
/// of the node (BENCHMARKS.md). Now one export of a namespace is built or
/// sent at a time on a node (a second is 429 `EXPORT_BUSY`, retryable,
/// while another namespace's goes on), and an export no import could take
/// (over 64 MiB) is refused with 413 `EXPORT_TOO_LARGE`, the namespace
/// untouched.
#[test]
fn exports_are_one_at_a_time_and_never_larger_than_an_import() {
    use std::io::{Read, Write};
    let node = sled_node();
    let key = create(&node, "big", None);
    let other = create(&node, "small", None);
    let value = vec![b'v'; 1_000_000];
    let put = |i: usize| {
        let (s, b) = node.with_key(&key, "PUT", &format!("/v1/kv/k{i}"), Some(&value));
        assert_eq!(s, 200, "{b}");
    };
    for i in 0..20 {
        put(i);
    }
    let (s, _) = node.with_key(&other, "PUT", "/v1/kv/a", Some(b"1"));
    assert_eq!(s, 200);

    // A client asks for the export (27 MB), reads its status line and no more.
    let addr: std::net::SocketAddr = node.addr.parse().unwrap();
    let mut slow = std::net::TcpStream::connect(addr).unwrap();
    write!(
        slow,
        "GET /v1/db/export HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n\r\n"
    )
    .unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut status = [0u8; 12];
    slow.read_exact(&mut status).unwrap();
    assert_eq!(&status, b"HTTP/1.1 200");
    let busy = || {
        let (s, headers, b) = http(
            "GET",
            &node.url("/v1/db/export"),
            &[("authorization", &format!("Bearer {key}"))],
            None,
        );
        (
            s,
            headers,
            serde_json::from_slice::<Value>(&b).unwrap_or_default(),
        )
    };
    let (s, headers, v) = busy();
    assert_eq!((s, code(&v)), (429, "EXPORT_BUSY"), "{v}");
    assert_eq!(v["error"]["retryable"], true);
    assert!(
        headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("retry-after")),
        "{headers:?}"
    );
    // Another namespace exports meanwhile.
    let small: Value = serde_json::from_str(&export(&node, &other)).unwrap();
    assert_eq!(small["kv"].as_array().unwrap().len(), 1);
    // Once the slow client is gone, the namespace exports again.
    drop(slow);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (s, _, v) = busy();
        if s == 200 {
            assert_eq!(v["kv"].as_array().unwrap().len(), 20);
            break;
        }
        assert_eq!((s, code(&v)), (429, "EXPORT_BUSY"));
        assert!(Instant::now() < deadline, "the slot never came back");
        std::thread::sleep(Duration::from_millis(100));
    }

    // 70 MB of values: an export no import could take.
    for i in 20..70 {
        put(i);
    }
    for _ in 0..2 {
        let (s, _, v) = busy();
        assert_eq!((s, code(&v)), (413, "EXPORT_TOO_LARGE"), "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(&(64 << 20).to_string()), "{msg}");
    }
    let (s, b) = node.with_key(&key, "GET", "/v1/kv/k69", None);
    assert_eq!((s, b.len()), (200, 1_000_000));
}
