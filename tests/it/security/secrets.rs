//! Secrets in the shared store (docs/cluster.md "Sealed secrets", "etcd TLS
//! and users"). The attack: a tenant who reached the node's etcd read
//! `_cluster/jwt_key` and `_cluster/server_secret`, signed a token for another
//! namespace, and the node accepted it. Now everything under `_cluster/` is
//! sealed under the cluster secret, and etcd can require TLS client
//! certificates and users.
#![cfg(feature = "cluster")]

use crate::common::*;
use crate::etcd_process::{EtcdProcess, TestPki};
use meshgate::auth::{Claims, JwtKeys, KeyKind};
use meshgate::storage::{MAC_OVERHEAD, RecordMac, SEAL_V1, SealKey};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub(super) const SECRET: &str = "secrets-test-cluster-secret";
/// The etcd layout of the store (src/storage/etcd_store.rs): records live
/// under `meshgate/d/`, an inline value behind a 0x00 byte.
pub(super) const DATA: &[u8] = b"meshgate/d/";
pub(super) const INLINE: u8 = 0;

pub(super) fn node_on(etcd: &EtcdProcess, secret: &str) -> TestNode {
    TestNode::start_with(opts_on(etcd, secret))
}

/// A node on `etcd` started with the operator's consent to MAC and seal an
/// older version's clear records (`[server] adopt_store_records`).
pub(super) fn node_adopting(etcd: &EtcdProcess, secret: &str) -> TestNode {
    let mut opts = opts_on(etcd, secret);
    opts.env
        .push(("MESHGATE_SERVER_ADOPT_STORE_RECORDS".into(), "true".into()));
    TestNode::start_with(opts)
}

/// Starts a node on `etcd` expecting it to refuse to start; its stderr.
pub(super) fn start_on_fails(etcd: &EtcdProcess, secret: &str) -> String {
    let config = format!("{TEST_CONFIG}[cluster]\n{}", etcd.cluster_toml());
    start_fails(&config, &[("MESHGATE_CLUSTER_SECRET", secret)])
}

fn opts_on(etcd: &EtcdProcess, secret: &str) -> NodeOpts {
    NodeOpts {
        config: format!("{TEST_CONFIG}[cluster]\n{}", etcd.cluster_toml()),
        env: vec![("MESHGATE_CLUSTER_SECRET".into(), secret.into())],
        ..Default::default()
    }
}

/// Runs `f` on an etcd client of its own (a thread with its own runtime, so
/// it works from any test).
pub(super) fn with_etcd<T: Send + 'static, F>(
    url: String,
    f: impl FnOnce(etcd_client::Client) -> F + Send + 'static,
) -> T
where
    F: std::future::Future<Output = T>,
{
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move {
                let c = etcd_client::Client::connect([url], None)
                    .await
                    .expect("connect etcd");
                f(c).await
            })
    })
    .join()
    .unwrap()
}

/// Every key and value in etcd, as a reader of etcd sees them.
pub(super) fn dump(etcd: &EtcdProcess) -> Vec<(Vec<u8>, Vec<u8>)> {
    with_etcd(etcd.url(), |mut c| async move {
        let r = c
            .get(
                vec![0u8],
                Some(etcd_client::GetOptions::new().with_from_key()),
            )
            .await
            .unwrap();
        r.kvs()
            .iter()
            .map(|kv| (kv.key().to_vec(), kv.value().to_vec()))
            .collect()
    })
}

/// The store's value of `key`, read straight from etcd.
pub(super) fn raw_get(etcd: &EtcdProcess, key: &[u8]) -> Option<Vec<u8>> {
    let k = [DATA, key].concat();
    with_etcd(etcd.url(), move |mut c| async move {
        let r = c.get(k, None).await.unwrap();
        r.kvs().first().map(|kv| {
            let v = kv.value();
            assert_eq!(v[0], INLINE, "a small record is inline");
            v[1..].to_vec()
        })
    })
}

/// Writes the store's value of `key` straight into etcd.
pub(super) fn raw_put(etcd: &EtcdProcess, key: &[u8], value: &[u8]) {
    let k = [DATA, key].concat();
    let mut v = vec![INLINE];
    v.extend_from_slice(value);
    with_etcd(etcd.url(), move |mut c| async move {
        c.put(k, v, None).await.unwrap();
    });
}

/// Deletes `key`'s record straight from etcd.
pub(super) fn raw_delete(etcd: &EtcdProcess, key: &[u8]) {
    let k = [DATA, key].concat();
    with_etcd(etcd.url(), move |mut c| async move {
        c.delete(k, None).await.unwrap();
    });
}

/// Puts the store of stopped nodes back the way a version before record
/// MACs kept it: every record's MAC stripped, the marker gone, the nodes'
/// registrations (leased; an older node's would have lapsed too) deleted.
/// The records it stripped, by store key, with their values.
pub(super) fn as_before_record_macs(etcd: &EtcdProcess) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mac = RecordMac::derive(SECRET.as_bytes());
    let mut clear = Vec::new();
    for (k, v) in dump(etcd) {
        let Some(k) = k.strip_prefix(DATA).map(<[u8]>::to_vec) else {
            continue;
        };
        if k.starts_with(b"_nodes/") || k.starts_with(b"_pubsub_mesh_peers/") {
            raw_delete(etcd, &k);
        } else if RecordMac::covers(&k) {
            let plain = mac.open(&k, &v[1..]).unwrap().to_vec();
            raw_put(etcd, &k, &plain);
            clear.push((k, plain));
        }
    }
    raw_delete(etcd, meshgate::storage::MAC_MARKER);
    clear
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Starts the binary expecting it to fail; returns its stderr. A node that
/// starts anyway (binds its listener) fails the test.
fn start_fails(config: &str, env: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, config).unwrap();
    let mut cmd = Command::new(bin());
    cmd.arg("serve")
        .arg("--config")
        .arg(&cfg)
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env("MESHGATE_OPERATOR_KEY", OPERATOR_KEY)
        .env_remove("MESHGATE_CLUSTER_SECRET")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            assert!(!status.success(), "the node exited 0: {err}");
            return err;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the node did not fail to start within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// (a) After a cluster node starts, every value under `_cluster/` read
/// straight from etcd is a sealed record: the server secret and the JWT
/// key's PKCS#8 bytes appear nowhere in etcd; opened with the cluster
/// secret, the records are exactly those.
#[test]
fn cluster_secrets_are_ciphertext_in_etcd() {
    let etcd = EtcdProcess::start_plain();
    let node = node_on(&etcd, SECRET);
    node.create_namespace("tenant");
    // The first node's own secrets became the cluster's.
    let server_secret = std::fs::read(node.dir.join("server.secret")).unwrap();
    let jwt_pkcs8 = std::fs::read(node.dir.join("jwt.key")).unwrap();
    assert_eq!(server_secret.len(), 32);
    let all = dump(&etcd);
    let cluster: Vec<_> = all
        .iter()
        .filter(|(k, _)| k.starts_with(b"meshgate/d/_cluster/"))
        .collect();
    let names: Vec<String> = cluster
        .iter()
        .map(|(k, _)| String::from_utf8_lossy(k).into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "meshgate/d/_cluster/jwt_key",
            "meshgate/d/_cluster/server_secret"
        ]
    );
    for (k, v) in &all {
        let name = String::from_utf8_lossy(k);
        assert!(
            !contains(v, &server_secret),
            "{name} holds the server secret"
        );
        assert!(!contains(v, &jwt_pkcs8), "{name} holds the JWT key");
        // Nor the Ed25519 seed alone (the last 32 bytes of ring's PKCS#8 v2
        // are the public key; the seed sits before it).
        assert!(
            !contains(v, &jwt_pkcs8[16..48]),
            "{name} holds the JWT seed"
        );
    }
    let seal = SealKey::derive(SECRET.as_bytes());
    for ((k, v), want) in cluster.iter().zip([&jwt_pkcs8, &server_secret]) {
        let store_key = &k[DATA.len()..];
        assert_eq!(v[0], INLINE);
        assert_eq!(v[1], SEAL_V1, "{}", String::from_utf8_lossy(k));
        assert_eq!(&seal.open(store_key, &v[1..]).unwrap(), want);
    }
}

/// Claims for `ns` with every grant, as an attacker would write them.
fn claims_for(ns: &str) -> Claims {
    Claims::new(
        "meshgate",
        "meshgate",
        "key:attacker",
        ns,
        vec!["*:*:*".into()],
        meshgate::http::now(),
    )
    .unwrap()
}

fn b64(b: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

/// (b) The attack's second step: read everything from etcd, try every value
/// (raw and without the store's inline byte) as an Ed25519 PKCS#8 signing key,
/// as an HS256 key, and as the server secret an API key is HMAC'd with (a
/// forged `keys/` record for the victim's namespace); present each credential
/// for the victim's KV: 401 every time. Control: the same forgeries with the
/// records opened under the right cluster secret (and the forged key record
/// MAC'd under it) are accepted (200), so the seal is what stops them.
#[test]
fn etcd_reader_cannot_mint_a_credential() {
    let etcd = EtcdProcess::start_plain();
    let node = node_on(&etcd, SECRET);
    let victim_key = node.create_namespace("victim");
    node.create_namespace("attacker");
    let (s, b) = node.with_key(&victim_key, "PUT", "/v1/kv/greeting", Some(b"hello"));
    assert_eq!(s, 200, "{b}");
    let kid = {
        let (_, _, jwks) = http("GET", &node.url("/v1/auth/jwks"), &[], None);
        json(&String::from_utf8_lossy(&jwks))["keys"][0]["kid"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let all = dump(&etcd);
    // The victim's key record (MAC'd, `record_mac.rs`), to copy under a key
    // the attacker chose; and its JSON, for the control.
    let (victim_record, victim_json) = all
        .iter()
        .filter(|(k, _)| k.starts_with(b"meshgate/d/keys/"))
        .map(|(_, v)| (v[1..].to_vec(), v[1 + MAC_OVERHEAD..].to_vec()))
        .find(|(_, v)| {
            serde_json::from_slice::<serde_json::Value>(v).is_ok_and(|r| r["namespace"] == "victim")
        })
        .expect("the victim's key record");
    let mut candidates: Vec<Vec<u8>> = Vec::new();
    for (_, v) in &all {
        candidates.push(v.clone());
        if v.len() > 1 {
            candidates.push(v[1..].to_vec());
        }
    }
    let read = |cred: &str| node.with_key(cred, "GET", "/v1/kv/greeting", None);
    // An API key whose HMAC under `secret` names a copy of the victim's
    // record: the stored bytes as they are, or (the control) the record
    // MAC'd afresh for its new key.
    let forge_with = |secret: &[u8], mac: Option<&RecordMac>| {
        let key = meshgate::auth::generate_api_key(KeyKind::Secret).unwrap();
        let hash = meshgate::auth::hash_api_key(secret, &key);
        let store_key = format!("keys/{}", hex::encode(hash));
        let record = match mac {
            Some(m) => m.wrap(store_key.as_bytes(), &victim_json),
            None => victim_record.clone(),
        };
        raw_put(&etcd, store_key.as_bytes(), &record);
        key
    };
    let forge_api_key = |secret: &[u8]| forge_with(secret, None);
    let (mut as_ed25519, mut tried) = (0, 0);
    for c in &candidates {
        if let Ok(keys) = JwtKeys::from_pkcs8(c) {
            as_ed25519 += 1;
            let (s, b) = read(&keys.sign(&claims_for("victim")));
            assert_eq!(
                s, 401,
                "a token signed with an etcd value was accepted: {b}"
            );
        }
        let header = b64(format!(r#"{{"alg":"HS256","typ":"JWT","kid":"{kid}"}}"#).as_bytes());
        let input = format!(
            "{header}.{}",
            b64(&serde_json::to_vec(&claims_for("victim")).unwrap())
        );
        let mac = ring::hmac::sign(
            &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, c),
            input.as_bytes(),
        );
        let (s, b) = read(&format!("{input}.{}", b64(mac.as_ref())));
        assert_eq!(
            s, 401,
            "an HS256 token keyed with an etcd value was accepted: {b}"
        );
        let (s, b) = read(&forge_api_key(c));
        assert_eq!(
            s, 401,
            "an API key HMAC'd with an etcd value was accepted: {b}"
        );
        tried += 1;
    }
    assert!(tried >= 10, "only {tried} values in etcd");
    assert_eq!(as_ed25519, 0, "a value in etcd parses as an Ed25519 key");

    // Control: the records opened with the cluster secret do mint credentials.
    let seal = SealKey::derive(SECRET.as_bytes());
    let open = |k: &[u8]| seal.open(k, &raw_get(&etcd, k).unwrap()).unwrap();
    let jwt = JwtKeys::from_pkcs8(&open(b"_cluster/jwt_key")).unwrap();
    assert_eq!(
        read(&jwt.sign(&claims_for("victim"))),
        (200, "hello".to_string())
    );
    let server_secret = open(b"_cluster/server_secret");
    let forged = forge_with(&server_secret, Some(&RecordMac::derive(SECRET.as_bytes())));
    assert_eq!(read(&forged), (200, "hello".to_string()));
}

/// (c) Records an older version wrote in the clear (the raw server secret,
/// the PKCS#8 key) are sealed by the nodes that start next; two nodes
/// starting at once agree; an API key and a token issued before the
/// migration still work on them.
#[test]
fn clear_records_are_sealed_on_start() {
    let etcd = EtcdProcess::start_plain();
    let mut old = node_on(&etcd, SECRET);
    let api_key = old.create_namespace("legacy");
    let (s, b) = old.with_key(&api_key, "PUT", "/v1/kv/greeting", Some(b"hello"));
    assert_eq!(s, 200, "{b}");
    let body = format!("{{\"api_key\":\"{api_key}\"}}");
    let (s, b) = old.with_key("", "POST", "/v1/auth/token", Some(body.as_bytes()));
    assert_eq!(s, 200, "{b}");
    let token = json(&b)["access_token"].as_str().unwrap().to_string();
    old.kill9();
    // Put the records back the way the older version stored them: in the clear.
    as_before_record_macs(&etcd);
    let seal = SealKey::derive(SECRET.as_bytes());
    let mut clear = Vec::new();
    for key in [&b"_cluster/server_secret"[..], b"_cluster/jwt_key"] {
        let plain = seal.open(key, &raw_get(&etcd, key).unwrap()).unwrap();
        raw_put(&etcd, key, &plain);
        assert_eq!(raw_get(&etcd, key).unwrap(), plain);
        clear.push((key, plain));
    }
    assert_eq!(clear[0].1.len(), 32);
    assert_eq!(clear[1].1[0], 0x30, "PKCS#8 DER");

    let (b, c) = std::thread::scope(|s| {
        let b = s.spawn(|| node_adopting(&etcd, SECRET));
        let c = s.spawn(|| node_adopting(&etcd, SECRET));
        (b.join().unwrap(), c.join().unwrap())
    });
    for (key, plain) in &clear {
        let raw = raw_get(&etcd, key).unwrap();
        assert_eq!(
            raw[0],
            SEAL_V1,
            "{} is not sealed",
            String::from_utf8_lossy(key)
        );
        assert!(!contains(&raw, plain));
        assert_eq!(&seal.open(key, &raw).unwrap(), plain);
    }
    for n in [&b, &c] {
        assert_eq!(
            n.with_key(&api_key, "GET", "/v1/kv/greeting", None),
            (200, "hello".to_string())
        );
        assert_eq!(
            n.with_key(&token, "GET", "/v1/kv/greeting", None),
            (200, "hello".to_string())
        );
    }
}

/// The store writer strips every record's MAC, deletes the marker (the
/// store now looks like an older version's), moves evil's key record into
/// bank and puts a signing key of its own under `_cluster/jwt_key` in the
/// clear. A node started without the operator's consent
/// (`[server] adopt_store_records`) refuses to start, naming the setting,
/// and adopts nothing: evil's record stays in the clear, the writer's key
/// unsealed. (Adopting would have MAC'd the forgery: evil's key then read
/// bank's KV on every node.)
#[test]
fn a_stripped_store_is_not_adopted_without_consent() {
    let etcd = EtcdProcess::start_plain();
    let mut first = node_on(&etcd, SECRET);
    let bank = first.create_namespace("bank");
    let evil = first.create_namespace("evil");
    let (s, b) = first.with_key(&bank, "PUT", "/v1/kv/vault", Some(b"bank-secret"));
    assert_eq!(s, 200, "{b}");
    first.kill9();
    as_before_record_macs(&etcd);
    let (evil_key, record) = dump(&etcd)
        .into_iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(DATA)?.to_vec(), v[1..].to_vec())))
        .find(|(k, v)| k.starts_with(b"keys/") && contains(v, b"\"namespace\":\"evil\""))
        .expect("evil's key record");
    let mut forged: serde_json::Value = serde_json::from_slice(&record).unwrap();
    forged["namespace"] = "bank".into();
    let forged = serde_json::to_vec(&forged).unwrap();
    raw_put(&etcd, &evil_key, &forged);
    let dir = tempfile::tempdir().unwrap();
    JwtKeys::load_or_generate(&dir.path().join("jwt.key")).unwrap();
    let writers_key = std::fs::read(dir.path().join("jwt.key")).unwrap();
    raw_put(&etcd, b"_cluster/jwt_key", &writers_key);

    let err = start_on_fails(&etcd, SECRET);
    assert!(err.contains("adopt_store_records"), "{err}");
    assert_eq!(raw_get(&etcd, &evil_key).unwrap(), forged, "nothing MAC'd");
    assert_eq!(raw_get(&etcd, b"_cluster/jwt_key").unwrap(), writers_key);
    assert!(raw_get(&etcd, meshgate::storage::MAC_MARKER).is_none());
    let _ = evil;
}

/// In a store whose records carry MACs, the store writer replaces
/// `_cluster/jwt_key` with a signing key of its own in the clear (as an
/// older version kept it): the next node refuses to start rather than
/// adopt it (it would sign and accept the writer's tokens), and the record
/// is left as it is; the sealed key put back, nodes start again.
#[test]
fn clear_signing_key_refused_after_migration() {
    let etcd = EtcdProcess::start_plain();
    let first = node_on(&etcd, SECRET);
    first.create_namespace("victim");
    drop(first);
    let sealed = raw_get(&etcd, b"_cluster/jwt_key").unwrap();
    let dir = tempfile::tempdir().unwrap();
    JwtKeys::load_or_generate(&dir.path().join("jwt.key")).unwrap();
    let pkcs8 = std::fs::read(dir.path().join("jwt.key")).unwrap();
    assert_eq!(pkcs8[0], 0x30, "PKCS#8 DER, as an older version stored it");
    raw_put(&etcd, b"_cluster/jwt_key", &pkcs8);
    let config = format!("{TEST_CONFIG}[cluster]\n{}", etcd.cluster_toml());
    let err = start_fails(&config, &[("MESHGATE_CLUSTER_SECRET", SECRET)]);
    assert!(
        err.contains("cannot open _cluster/jwt_key: it is neither sealed nor a clear value"),
        "{err}"
    );
    assert_eq!(raw_get(&etcd, b"_cluster/jwt_key").unwrap(), pkcs8);
    raw_put(&etcd, b"_cluster/jwt_key", &sealed);
    let again = node_on(&etcd, SECRET);
    again.create_namespace("after");
}

/// (d) A node with another cluster secret refuses to start, saying why,
/// and leaves the records alone; a cluster node without any cluster secret
/// refuses to start and writes nothing under `_cluster/`.
#[test]
fn other_cluster_secret_refuses_to_start() {
    let etcd = EtcdProcess::start_plain();
    let first = node_on(&etcd, SECRET);
    let before = raw_get(&etcd, b"_cluster/server_secret").unwrap();
    let config = format!("{TEST_CONFIG}[cluster]\n{}", etcd.cluster_toml());
    let err = start_fails(&config, &[("MESHGATE_CLUSTER_SECRET", "another-secret")]);
    assert!(
        err.contains("cannot open _cluster/server_secret: sealed under a different cluster secret; every node needs the same MESHGATE_CLUSTER_SECRET / cluster.secret_file"),
        "{err}"
    );
    assert_eq!(raw_get(&etcd, b"_cluster/server_secret").unwrap(), before);
    // The same secret from cluster.secret_file: starts.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.secret");
    std::fs::write(&file, SECRET).unwrap();
    let second = TestNode::start_with(NodeOpts {
        config: format!("{config}secret_file = \"{}\"\n", file.display()),
        ..Default::default()
    });
    let key = first.create_namespace("shared");
    assert_eq!(second.with_key(&key, "GET", "/v1/kv/none", None).0, 404);

    let fresh = EtcdProcess::start_plain();
    let err = start_fails(
        &format!("{TEST_CONFIG}[cluster]\n{}", fresh.cluster_toml()),
        &[],
    );
    assert!(
        err.contains("cluster mode ([cluster] etcd) needs the shared cluster secret"),
        "{err}"
    );
    assert!(
        !dump(&fresh)
            .iter()
            .any(|(k, _)| k.starts_with(b"meshgate/d/_cluster/")),
        "a node without a cluster secret wrote under _cluster/"
    );
}

/// (e) Three nodes on an etcd that requires TLS client certificates: the
/// forwarding-and-breakers scenario of the cluster suite passes unchanged.
#[test]
fn cluster_on_tls_etcd_forwards() {
    crate::cluster::forwarding_and_breakers_on(&EtcdProcess::start_tls());
}

/// (e) Three nodes on an etcd that requires TLS client certificates: the
/// mesh scenario of the cluster suite (1,000 messages, every node, in order)
/// passes unchanged.
#[actix_rt::test]
async fn cluster_on_tls_etcd_mesh() {
    crate::cluster::thousand_messages_on(&EtcdProcess::start_tls()).await;
}

/// (e) On an etcd that requires TLS client certificates, a node whose client
/// certificate comes from another CA, whose certificate file is missing, or
/// is not PEM, fails start-up naming the file and the reason.
#[test]
fn tls_etcd_refuses_a_wrong_or_missing_certificate() {
    let etcd = EtcdProcess::start_tls();
    let pki = etcd.pki().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let other = TestPki::generate(dir.path(), "other");
    let config = |cert: &std::path::Path, key: &std::path::Path| {
        format!(
            "{TEST_CONFIG}[cluster]\netcd = [\"{}\"]\netcd_ca_file = \"{}\"\netcd_cert_file = \"{}\"\netcd_key_file = \"{}\"\n",
            etcd.url(),
            pki.ca.display(),
            cert.display(),
            key.display()
        )
    };
    let env = [("MESHGATE_CLUSTER_SECRET", SECRET)];
    let err = start_fails(&config(&other.client_cert, &other.client_key), &env);
    assert!(
        err.contains(&format!(
            "etcd at {} refused the TLS handshake with cluster.etcd_cert_file {}",
            etcd.url(),
            other.client_cert.display()
        )),
        "{err}"
    );
    let missing = dir.path().join("missing.pem");
    let err = start_fails(&config(&missing, &pki.client_key), &env);
    assert!(
        err.contains(&format!(
            "cluster.etcd_cert_file {}: no such file",
            missing.display()
        )),
        "{err}"
    );
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    let err = start_fails(&config(&garbage, &pki.client_key), &env);
    assert!(
        err.contains(&format!(
            "cluster.etcd_cert_file {}: not PEM",
            garbage.display()
        )),
        "{err}"
    );
    // The right certificate, through the environment overrides: starts.
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[cluster]\netcd = [\"{}\"]\n", etcd.url()),
        env: vec![
            ("MESHGATE_CLUSTER_SECRET".into(), SECRET.into()),
            (
                "MESHGATE_CLUSTER_ETCD_CA_FILE".into(),
                pki.ca.display().to_string(),
            ),
            (
                "MESHGATE_CLUSTER_ETCD_CERT_FILE".into(),
                pki.client_cert.display().to_string(),
            ),
            (
                "MESHGATE_CLUSTER_ETCD_KEY_FILE".into(),
                pki.client_key.display().to_string(),
            ),
        ],
        ..Default::default()
    });
    let key = node.create_namespace("over-tls");
    assert_eq!(node.with_key(&key, "PUT", "/v1/kv/k", Some(b"v")).0, 200);
}

/// (f) etcd with auth on: a node with the user and its password file serves
/// (namespaces, KV); the wrong password fails start-up naming the user and
/// the password file.
#[test]
fn etcd_user_and_password() {
    let mut etcd = EtcdProcess::start_plain();
    etcd.enable_auth("meshgate", "the-right-password");
    let node = node_on(&etcd, SECRET);
    let key = node.create_namespace("with-user");
    assert_eq!(node.with_key(&key, "PUT", "/v1/kv/k", Some(b"v")).0, 200);
    assert_eq!(
        node.with_key(&key, "GET", "/v1/kv/k", None),
        (200, "v".to_string())
    );
    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("wrong.password");
    std::fs::write(&wrong, "not-the-password\n").unwrap();
    let err = start_fails(
        &format!(
            "{TEST_CONFIG}[cluster]\netcd = [\"{}\"]\netcd_user = \"meshgate\"\netcd_password_file = \"{}\"\n",
            etcd.url(),
            wrong.display()
        ),
        &[("MESHGATE_CLUSTER_SECRET", SECRET)],
    );
    assert!(
        err.contains(&format!(
            "etcd at {} refused user meshgate with the password in cluster.etcd_password_file {}",
            etcd.url(),
            wrong.display()
        )),
        "{err}"
    );
}
