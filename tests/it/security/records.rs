//! Every store record authenticated (docs/security.md "Node → etcd", the
//! store writer). The attack: whoever can write etcd, holding neither the
//! cluster secret nor the operator key, pointed bank's function version at
//! evil's module (its record copied from evil's key, or its module hash
//! edited), and an anonymous call of bank's public function printed bank's
//! `DB_PASSWORD`. Deployment, host, secret and dashboard-session records
//! could be moved the same way. Now every record carries a MAC bound to its
//! key (`src/storage/record_mac.rs`) and a blob is checked against its hash:
//! each forged record is refused, logged and counted.
#![cfg(feature = "cluster")]

use super::secrets::{DATA, SECRET, dump, raw_get, raw_put};
use crate::common::*;
use crate::etcd_process::EtcdProcess;
use crate::functions::deploy;
use meshgate::storage::{MAC_OVERHEAD, MAC_V1};
use serde_json::{Value, json};

/// The refusal counter.
const REFUSED: &str = "meshgate_store_records_refused_total";
/// bank's secret, which evil's module must never print.
const PASSWORD: &str = "bank-db-password-7f3a";
/// The module of bank's `pay`: writes `paid` and nothing else.
const PAY_WAT: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "paid")
  (func (export "_start")
    (i32.store (i32.const 16) (i32.const 64))
    (i32.store (i32.const 20) (i32.const 4))
    (drop (call $write (i32.const 1) (i32.const 16) (i32.const 1) (i32.const 24)))))"#;

/// A node on `etcd` with the test cluster secret (a fresh one reads every
/// record from the store: nothing cached).
fn node_on(etcd: &EtcdProcess) -> TestNode {
    TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}[functions]\nworkers = 2\n[cluster]\n{}",
            etcd.cluster_toml()
        ),
        env: vec![("MESHGATE_CLUSTER_SECRET".into(), SECRET.into())],
        ..Default::default()
    })
}

/// The store key and record of the one record whose store key starts with `prefix`.
fn record(etcd: &EtcdProcess, prefix: &str) -> (Vec<u8>, Vec<u8>) {
    let full = [DATA, prefix.as_bytes()].concat();
    let found: Vec<_> = dump(etcd)
        .into_iter()
        .filter(|(k, _)| k.starts_with(&full))
        .map(|(k, v)| (k[DATA.len()..].to_vec(), v[1..].to_vec()))
        .collect();
    assert_eq!(found.len(), 1, "one record under {prefix}");
    found.into_iter().next().unwrap()
}

/// An anonymous call of `ns`'s public function `pay`: status and body.
fn call_pay(node: &TestNode, ns: &str) -> (u16, String) {
    let (s, _, b) = http(
        "POST",
        &node.url(&format!("/v1/invoke/{ns}/pay")),
        &[],
        Some(b""),
    );
    (s, String::from_utf8_lossy(&b).into_owned())
}

fn set_secret(node: &TestNode, key: &str, name: &str, value: &str) {
    let body = json!({"key": name, "value": value}).to_string();
    let (s, b) = node.with_key(key, "PUT", "/v1/functions/secrets", Some(body.as_bytes()));
    assert_eq!(s, 200, "{b}");
}

/// On etcd: bank's public function `pay` (its module prints `paid`, its
/// namespace holds secret DB_PASSWORD) and evil's `pay` (a module that
/// prints its whole environment). The store writer puts evil's version
/// record, MAC and all, under bank's key; then bank's own record with its
/// module hash edited to evil's module. Each time a fresh node refuses the
/// record: the anonymous call of bank's `pay` never runs evil's module nor
/// prints the password (the 500 `INTERNAL` envelope), the refusal is logged
/// and counted. bank's record put back, the call prints `paid` again.
#[test]
fn swapped_function_version_is_refused_on_etcd() {
    let etcd = EtcdProcess::start_plain();
    let first = node_on(&etcd);
    let bank = first.create_namespace("bank");
    let evil = first.create_namespace("evil");
    deploy(
        &first,
        &bank,
        "pay",
        PAY_WAT.as_bytes(),
        &[("is_public", "true")],
    );
    set_secret(&first, &bank, "DB_PASSWORD", PASSWORD);
    deploy(
        &first,
        &evil,
        "pay",
        crate::export::ENV_WAT.as_bytes(),
        &[("is_public", "true")],
    );
    assert_eq!(call_pay(&first, "bank"), (200, "paid".to_string()));
    drop(first);

    let (bank_key, bank_record) = record(&etcd, "fnver/bank/pay/");
    let (_, evil_record) = record(&etcd, "fnver/evil/pay/");
    // bank's record with its module hash replaced by evil's, its MAC kept.
    let evil_sha = {
        assert_eq!(evil_record[0], MAC_V1, "the record carries a MAC");
        let v: Value = serde_json::from_slice(&evil_record[MAC_OVERHEAD..]).unwrap();
        v["sha256"].as_str().unwrap().to_string()
    };
    let at = MAC_OVERHEAD;
    let mut meta: Value = serde_json::from_slice(&bank_record[at..]).unwrap();
    meta["sha256"] = json!(evil_sha);
    let mut edited = bank_record[..at].to_vec();
    edited.extend_from_slice(&serde_json::to_vec(&meta).unwrap());

    for (what, forged) in [("evil's record", evil_record), ("edited hash", edited)] {
        raw_put(&etcd, &bank_key, &forged);
        let node = node_on(&etcd);
        let before = node.metric_sum(REFUSED);
        let (s, b) = call_pay(&node, "bank");
        assert!(!b.contains(PASSWORD), "{what}: bank's secret printed: {b}");
        assert_eq!(s, 500, "{what}: {b}");
        assert_eq!(json(&b)["error"]["code"], "INTERNAL", "{what}: {b}");
        assert!(node.metric_sum(REFUSED) > before, "{what}: not counted");
        let name = String::from_utf8_lossy(&bank_key).into_owned();
        wait_until(
            std::time::Duration::from_secs(10),
            "a WARN naming bank's version record",
            || {
                node.stderr.lock().unwrap().lines().any(|l| {
                    l.contains("WARN") && l.contains("Store record refused") && l.contains(&name)
                })
            },
        );
    }
    raw_put(&etcd, &bank_key, &bank_record);
    let node = node_on(&etcd);
    assert_eq!(call_pay(&node, "bank"), (200, "paid".to_string()));
}

/// On etcd, records moved by the store writer, each refused by a fresh node
/// and counted: bank's sealed secret copied under evil's name (evil's
/// function never prints it); evil's host claim copied over bank's host, so
/// evil could deploy on it (evil's deploy on bank's host is refused, bank's
/// site keeps serving nothing of evil's); evil's deployment record copied
/// over bank's (bank's deployment is not read as evil's); and a dashboard
/// session record copied under a token the writer chose (the token opens
/// nothing, the operator's own session still does).
#[test]
fn moved_records_are_refused_on_etcd() {
    let etcd = EtcdProcess::start_plain();
    let first = node_on(&etcd);
    let bank = first.create_namespace("bank");
    let evil = first.create_namespace("evil");
    set_secret(&first, &bank, "DB_PASSWORD", PASSWORD);
    set_secret(&first, &evil, "DB_PASSWORD", "evil-own");
    deploy(&first, &evil, "env", crate::export::ENV_WAT.as_bytes(), &[]);
    deploy_site(&first, &bank, "www", "bank.records.test", b"bank's page");
    deploy_site(&first, &evil, "www", "evil.records.test", b"evil's page");
    let cookie = sign_in(&first);
    drop(first);

    // secret/: bank's sealed password under evil's name.
    let (_, bank_secret) = record(&etcd, "secret/bank/DB_PASSWORD");
    raw_put(&etcd, b"secret/evil/DB_PASSWORD", &bank_secret);
    // host/: evil's claim over bank's host.
    let (_, evil_claim) = record(&etcd, "host/evil.records.test");
    raw_put(&etcd, b"host/bank.records.test", &evil_claim);
    // dep/: evil's deployment record over bank's.
    let (_, evil_dep) = record(&etcd, "dep/evil/www");
    raw_put(&etcd, b"dep/bank/www", &evil_dep);
    // _admin/session/: the operator's session under a token of the writer's.
    let token = cookie.split_once('=').unwrap().1;
    let id = |t: &str| hex::encode(ring::digest::digest(&ring::digest::SHA256, t.as_bytes()));
    let (_, session) = record(&etcd, &format!("_admin/session/{}", id(token)));
    let chosen = "ab".repeat(32);
    raw_put(
        &etcd,
        format!("_admin/session/{}", id(&chosen)).as_bytes(),
        &session,
    );

    let node = node_on(&etcd);
    let auth = format!("Bearer {evil}");
    let (_, _, b) = http(
        "POST",
        &node.url("/v1/functions/env/invoke"),
        &[("authorization", &auth)],
        Some(b""),
    );
    let out = String::from_utf8_lossy(&b);
    assert!(
        !out.contains(PASSWORD),
        "bank's secret printed for evil: {out}"
    );

    let (s, b) = deploy_site_status(&node, &evil, "grab", "bank.records.test", b"evil's copy");
    assert_ne!(
        s, 201,
        "evil deployed on bank's host with a moved claim: {b}"
    );
    let (_, _, page) = http(
        "GET",
        &node.url("/"),
        &[("host", "bank.records.test")],
        None,
    );
    assert!(
        !String::from_utf8_lossy(&page).contains("evil"),
        "bank's host served evil's page"
    );

    let (s, b) = node.with_key(&bank, "GET", "/v1/deployments/www", None);
    assert!(
        !b.contains("\"evil\""),
        "bank's deployment read as evil's: {s} {b}"
    );
    assert_ne!(s, 200, "a moved deployment record was used: {b}");

    let (s, _, _) = http(
        "GET",
        &node.url("/__admin/api/snapshot"),
        &[("cookie", &format!("mg_admin={chosen}"))],
        None,
    );
    assert_eq!(s, 401, "a moved session record opened the dashboard");
    // Each of the four moved records refused at least once, and counted.
    let refused = node.metric_sum(REFUSED);
    assert!(refused >= 4.0, "{refused} refusals counted");
    for name in [
        "secret/evil/DB_PASSWORD".to_string(),
        "host/bank.records.test".into(),
        "dep/bank/www".into(),
        format!("_admin/session/{}", id(&chosen)),
    ] {
        wait_until(
            std::time::Duration::from_secs(10),
            &format!("a WARN naming {name}"),
            || {
                node.stderr.lock().unwrap().lines().any(|l| {
                    l.contains("WARN") && l.contains("Store record refused") && l.contains(&name)
                })
            },
        );
    }
    let (s, _, _) = http(
        "GET",
        &node.url("/__admin/api/snapshot"),
        &[("cookie", &cookie)],
        None,
    );
    assert_eq!(s, 200, "the operator's own session still opens it");
}

/// On etcd: the bytes of bank's module blob replaced in the store (under
/// its content hash key) by evil's module. A fresh node refuses the blob
/// when it loads it: bank's call never runs evil's module, the refusal is
/// counted; the blob put back, the call works.
#[test]
fn replaced_blob_is_refused_on_load() {
    let etcd = EtcdProcess::start_plain();
    let first = node_on(&etcd);
    let bank = first.create_namespace("bank");
    deploy(
        &first,
        &bank,
        "pay",
        PAY_WAT.as_bytes(),
        &[("is_public", "true")],
    );
    set_secret(&first, &bank, "DB_PASSWORD", PASSWORD);
    drop(first);
    let (blob_key, original) = record(&etcd, "blob/");
    let evil_module = wat::parse_str(crate::export::ENV_WAT).unwrap();
    raw_put(&etcd, &blob_key, &evil_module);
    let node = node_on(&etcd);
    let before = node.metric_sum(REFUSED);
    let (s, b) = call_pay(&node, "bank");
    assert!(!b.contains(PASSWORD), "a replaced blob ran: {b}");
    assert_eq!(s, 500, "{b}");
    assert!(node.metric_sum(REFUSED) > before, "not counted");
    raw_put(&etcd, &blob_key, &original);
    assert_eq!(raw_get(&etcd, &blob_key).unwrap(), original);
    let node = node_on(&etcd);
    assert_eq!(call_pay(&node, "bank"), (200, "paid".to_string()));
}

/// Signs in to the dashboard with the operator key; the cookie pair.
fn sign_in(n: &TestNode) -> String {
    let body = format!("key={OPERATOR_KEY}");
    let (s, h, _) = http(
        "POST",
        &n.url("/__admin/login"),
        &[("content-type", "application/x-www-form-urlencoded")],
        Some(body.as_bytes()),
    );
    assert_eq!(s, 303);
    header(&h, "set-cookie")
        .expect("a session cookie")
        .split(';')
        .next()
        .unwrap()
        .to_string()
}

fn deploy_site(node: &TestNode, key: &str, name: &str, host: &str, index: &[u8]) {
    let (s, b) = deploy_site_status(node, key, name, host, index);
    assert_eq!(s, 201, "{b}");
}

/// Deploys a static site of one `index.html` on `host`: status and body.
fn deploy_site_status(
    node: &TestNode,
    key: &str,
    name: &str,
    host: &str,
    index: &[u8],
) -> (u16, String) {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut t = tar::Builder::new(gz);
    let mut h = tar::Header::new_gnu();
    h.set_path("index.html").unwrap();
    h.set_mode(0o644);
    h.set_size(index.len() as u64);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    t.append(&h, index).unwrap();
    let tarball = t.into_inner().unwrap().finish().unwrap();
    let boundary = "mgrecordsboundary";
    let mut body = Vec::new();
    for (part, data) in [
        ("name", name.as_bytes().to_vec()),
        ("hosts", host.as_bytes().to_vec()),
        ("tarball", tarball),
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
    (s, String::from_utf8_lossy(&b).into_owned())
}
