//! Seals bound to their owner (issue #39; docs/security.md "Tenant → tenant"
//! and "Node → etcd"). The attacks: whoever could write etcd edited a key
//! record to move a key into another namespace, and a leaked export's sealed
//! secrets imported into any namespace (the seal was bound to the secret's
//! name only). Now the records that confer authority carry a MAC under the
//! cluster secret, and an export's secrets are sealed to their namespace.

use crate::common::*;
use crate::functions::{deploy, invoke};
use serde_json::{Value, json};

/// Functions with two workers, for the secret-printing function.
const FUNCTIONS: &str = "[functions]\nworkers = 2\n";

/// The function's output (its environment, secrets included).
fn env_of(node: &TestNode, key: &str) -> String {
    let (s, _, b) = invoke(node, key, "env", b"");
    let out = String::from_utf8_lossy(&b).into_owned();
    assert_eq!(s, 200, "{out}");
    out
}

fn set_secret(node: &TestNode, key: &str, value: &str) {
    let body = json!({"key": "API_TOKEN", "value": value}).to_string();
    let (s, b) = node.with_key(key, "PUT", "/v1/functions/secrets", Some(body.as_bytes()));
    assert_eq!(s, 200, "{b}");
}

fn import(node: &TestNode, key: &str, query: &str, body: &[u8]) -> (u16, Value) {
    let (s, b) = node.with_key(key, "PUT", &format!("/v1/db/import{query}"), Some(body));
    (s, serde_json::from_str(&b).unwrap_or(Value::String(b)))
}

fn export(node: &TestNode, key: &str) -> String {
    let (s, b) = node.with_key(key, "GET", "/v1/db/export", None);
    assert_eq!(s, 200, "{b}");
    b
}

/// A namespace's export without the secrets' ciphertext (fresh every time).
fn contents(node: &TestNode, key: &str) -> Value {
    let mut e = json(&export(node, key));
    let names: Vec<Value> = e["secrets"]["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].clone())
        .collect();
    e["secrets"] = json!(names);
    e
}

/// mallory exports her namespace (a function and secret API_TOKEN); the
/// export leaks. Imported into bank with bank's own owner key: 403
/// `SECRETS_BOUND_ELSEWHERE` naming mallory, and bank is unchanged; the
/// export's `namespace` field edited to say bank: the seal does not open
/// (400 `INVALID_EXPORT`), bank unchanged; bank's owner asking to re-seal:
/// 403 `OPERATOR_ONLY`. Imported back into mallory: the secret is restored
/// (her function sees it again). The operator re-sealing it for bank: bank's
/// function sees the value.
#[test]
fn leaked_export_secrets_refused_in_another_namespace() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}{FUNCTIONS}"),
        ..Default::default()
    });
    let mallory = node.create_namespace("mallory");
    let bank = node.create_namespace("bank");
    for key in [&mallory, &bank] {
        deploy(&node, key, "env", crate::export::ENV_WAT.as_bytes(), &[]);
    }
    set_secret(&node, &mallory, "hunter2");
    set_secret(&node, &bank, "bank-own");
    let leaked = export(&node, &mallory);
    assert!(!leaked.contains("hunter2"));

    let before = contents(&node, &bank);
    let (s, v) = import(&node, &bank, "", leaked.as_bytes());
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (403, Some("SECRETS_BOUND_ELSEWHERE")),
        "{v}"
    );
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("\"mallory\""), "{message}");
    assert_eq!(
        contents(&node, &bank),
        before,
        "a refused import stores nothing"
    );
    assert_eq!(json(&leaked)["secrets"]["seal"], 2);

    let mut relabelled = json(&leaked);
    relabelled["namespace"] = json!("bank");
    let (s, v) = import(&node, &bank, "", relabelled.to_string().as_bytes());
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (400, Some("INVALID_EXPORT")),
        "{v}"
    );
    let (s, v) = import(&node, &bank, "?secrets=reseal", leaked.as_bytes());
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (403, Some("OPERATOR_ONLY")),
        "{v}"
    );
    assert_eq!(
        contents(&node, &bank),
        before,
        "a refused import stores nothing"
    );
    assert!(env_of(&node, &bank).contains("API_TOKEN=bank-own"));

    set_secret(&node, &mallory, "changed");
    let (s, v) = import(&node, &mallory, "", leaked.as_bytes());
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["counts"]["secrets"], 1);
    assert!(env_of(&node, &mallory).contains("API_TOKEN=hunter2"));

    // In cluster mode through a non-member: the hop keeps the operator's
    // status (X-Internal-Auth-Operator, in its MAC).
    let (s, v) = import(
        &node,
        OPERATOR_KEY,
        "?secrets=reseal&namespace=bank",
        leaked.as_bytes(),
    );
    assert_eq!(s, 200, "{v}");
    assert!(env_of(&node, &bank).contains("API_TOKEN=hunter2"));
}

/// On one sled node: namespace bank's record edited in the node's store
/// while it is stopped (its MAC kept, its rate limit changed): after the
/// restart the record is refused, not trusted (bank's requests get the
/// 500 `INTERNAL` envelope, never served under the edited record) and the
/// node logs the refused record; namespace other is served as before.
#[test]
fn edited_namespace_record_is_refused() {
    use meshgate::storage::{MAC_OVERHEAD, OrderedKv};
    if single_node_only() {
        return;
    }
    let mut node = TestNode::start();
    let bank = node.create_namespace("bank");
    let other = node.create_namespace("other");
    let (s, b) = node.with_key(&bank, "PUT", "/v1/kv/vault", Some(b"gold"));
    assert_eq!(s, 200, "{b}");
    let dir = node.dir.clone();
    node.signal(15);
    assert_eq!(node.wait_exit(std::time::Duration::from_secs(20)), Some(0));
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let store = meshgate::storage::Store::open_sled(&dir).unwrap();
            let sled = store.as_sled().unwrap();
            let raw = sled.get(b"ns/bank").await.unwrap().unwrap();
            let at = if raw.first() == Some(&b'{') {
                0
            } else {
                MAC_OVERHEAD
            };
            let mut rec: Value = serde_json::from_slice(&raw[at..]).unwrap();
            rec["rate_per_minute"] = json!(1);
            rec["rate_burst"] = json!(1);
            let mut edited = raw[..at].to_vec();
            edited.extend_from_slice(&serde_json::to_vec(&rec).unwrap());
            sled.put(b"ns/bank", &edited).await.unwrap();
            // The folder is free for the node only once the store is closed.
            store.close();
        });
    let node2 = TestNode::start_with(NodeOpts {
        config: TEST_CONFIG.into(),
        data_dir: Some(dir),
        ..Default::default()
    });
    let (s, b) = node2.with_key(&bank, "GET", "/v1/kv/vault", None);
    assert_eq!(s, 500, "an edited namespace record was trusted: {b}");
    assert_eq!(json(&b)["error"]["code"], "INTERNAL", "{b}");
    assert_eq!(node2.with_key(&other, "GET", "/v1/kv/vault", None).0, 404);
    wait_until(
        std::time::Duration::from_secs(10),
        "a WARN naming ns/bank",
        || {
            node2.stderr.lock().unwrap().lines().any(|l| {
                l.contains("WARN") && l.contains("Store record refused") && l.contains("ns/bank")
            })
        },
    );
    drop(node);
}

#[cfg(feature = "cluster")]
mod on_etcd {
    use super::super::secrets::{
        DATA, SECRET, as_before_record_macs, dump, node_adopting, node_on, raw_delete, raw_get,
        raw_put, start_on_fails,
    };
    use crate::common::*;
    use crate::etcd_process::EtcdProcess;
    use meshgate::storage::{MAC_MARKER, MAC_OVERHEAD, MAC_V1, RecordMac};
    use serde_json::Value;

    /// A key record's JSON, past its MAC if it has one.
    fn json_of(record: &[u8]) -> &[u8] {
        match record.first() {
            Some(&MAC_V1) => &record[MAC_OVERHEAD..],
            _ => record,
        }
    }

    /// The store key and stored record of the key record of `namespace`.
    fn key_record_of(etcd: &EtcdProcess, namespace: &str) -> (Vec<u8>, Vec<u8>) {
        dump(etcd)
            .into_iter()
            .filter(|(k, _)| k.starts_with(b"meshgate/d/keys/"))
            .map(|(k, v)| (k[DATA.len()..].to_vec(), v[1..].to_vec()))
            .find(|(_, v)| {
                serde_json::from_slice::<Value>(json_of(v))
                    .is_ok_and(|r| r["namespace"] == namespace)
            })
            .expect("the key record")
    }

    /// On etcd: mallory's key record edited straight in etcd to act in bank
    /// with every grant (its MAC kept; or as the clear JSON an older version
    /// wrote; or bank's own record copied over it): each time mallory's key
    /// gets 401 `INVALID_API_KEY` and bank's data stays unread, and the node
    /// logs the refused record by its store key. bank's own key still works;
    /// the record put back as it was, mallory's key works again.
    #[test]
    fn edited_key_record_is_refused() {
        let etcd = EtcdProcess::start_plain();
        let node = node_on(&etcd, SECRET);
        let bank = node.create_namespace("bank");
        let mallory = node.create_namespace("mallory");
        let (s, b) = node.with_key(&bank, "PUT", "/v1/kv/vault", Some(b"gold"));
        assert_eq!(s, 200, "{b}");
        let (store_key, original) = key_record_of(&etcd, "mallory");
        let (_, bank_record) = key_record_of(&etcd, "bank");
        let mut moved: Value = serde_json::from_slice(json_of(&original)).unwrap();
        moved["namespace"] = "bank".into();
        moved["grants"] = serde_json::json!(["*:*:*"]);
        let moved = serde_json::to_vec(&moved).unwrap();
        let mut mac_kept = original[..MAC_OVERHEAD.min(original.len())].to_vec();
        mac_kept.extend_from_slice(&moved);
        for forged in [moved, mac_kept, bank_record] {
            raw_put(&etcd, &store_key, &forged);
            let (s, b) = node.with_key(&mallory, "GET", "/v1/kv/vault", None);
            assert_eq!(s, 401, "an edited key record was trusted: {b}");
            assert_eq!(json(&b)["error"]["code"], "INVALID_API_KEY", "{b}");
        }
        // The log writer flushes in the background: wait for the line.
        let key_text = String::from_utf8_lossy(&store_key).into_owned();
        wait_until(
            std::time::Duration::from_secs(10),
            "a WARN naming the refused record",
            || {
                node.stderr.lock().unwrap().lines().any(|l| {
                    l.contains("WARN")
                        && l.contains("Store record refused")
                        && l.contains(&key_text)
                })
            },
        );
        assert_eq!(original[0], MAC_V1, "the stored record carries a MAC");
        assert_eq!(
            node.with_key(&bank, "GET", "/v1/kv/vault", None),
            (200, "gold".to_string())
        );
        raw_put(&etcd, &store_key, &original);
        assert_eq!(node.with_key(&mallory, "GET", "/v1/kv/vault", None).0, 404);
    }

    /// On etcd, a store an older version wrote (key and namespace records in
    /// the clear, no marker): two nodes starting at once MAC every record in
    /// place, values unchanged, and the key issued before works on both. A
    /// record edited in the clear after that, even with the marker deleted,
    /// is not adopted by the next start: its key gets 401.
    #[test]
    fn clear_records_are_macd_on_start_once() {
        let etcd = EtcdProcess::start_plain();
        let mut old = node_on(&etcd, SECRET);
        let key = old.create_namespace("legacy");
        let other = old.create_namespace("other");
        let (s, b) = old.with_key(&key, "PUT", "/v1/kv/greeting", Some(b"hello"));
        assert_eq!(s, 200, "{b}");
        old.kill9();
        // Put the store back the way an older version kept it.
        let mac = RecordMac::derive(SECRET.as_bytes());
        let clear = as_before_record_macs(&etcd);
        assert!(
            clear
                .iter()
                .filter(|(k, _)| k.starts_with(b"keys/") || k.starts_with(b"ns/"))
                .count()
                >= 4,
            "{} records",
            clear.len()
        );

        // Without the operator's consent nothing is adopted: the start stops.
        let err = start_on_fails(&etcd, SECRET);
        assert!(err.contains("adopt_store_records"), "{err}");
        let (k0, plain0) = &clear[0];
        assert_eq!(&raw_get(&etcd, k0).unwrap(), plain0, "nothing MAC'd");
        let (b, c) = std::thread::scope(|s| {
            let b = s.spawn(|| node_adopting(&etcd, SECRET));
            let c = s.spawn(|| node_adopting(&etcd, SECRET));
            (b.join().unwrap(), c.join().unwrap())
        });
        for (k, plain) in &clear {
            let raw = raw_get(&etcd, k).unwrap();
            assert_eq!(
                mac.open(k, &raw),
                Ok(&plain[..]),
                "{}",
                String::from_utf8_lossy(k)
            );
        }
        assert!(raw_get(&etcd, MAC_MARKER).is_some());
        for n in [&b, &c] {
            assert_eq!(
                n.with_key(&key, "GET", "/v1/kv/greeting", None),
                (200, "hello".to_string())
            );
        }

        // After the migration: `other`'s key record moved to `legacy` in the
        // clear, the marker deleted, a node restarted: still refused.
        let (store_key, record) = key_record_of(&etcd, "other");
        let mut moved: Value = serde_json::from_slice(&record[MAC_OVERHEAD..]).unwrap();
        moved["namespace"] = "legacy".into();
        raw_put(&etcd, &store_key, &serde_json::to_vec(&moved).unwrap());
        raw_delete(&etcd, MAC_MARKER);
        drop(b);
        let d = node_on(&etcd, SECRET);
        let (s, body) = d.with_key(&other, "GET", "/v1/kv/greeting", None);
        assert_eq!(
            s, 401,
            "a clear record was adopted after the migration: {body}"
        );
        assert_eq!(
            d.with_key(&key, "GET", "/v1/kv/greeting", None),
            (200, "hello".to_string())
        );
    }
}
