//! The attack that opened issue #13, step by step, as the tenant ran it:
//! point a deployment at the node's own etcd, read `_cluster/jwt_key`
//! through the proxy with `POST /v3/kv/range`, sign a token for another
//! namespace with it, and read that namespace's KV. The first step is
//! refused by the egress policy; with that policy opened by a test-only
//! allow list naming etcd's exact address and `upstream_allow_own = true`,
//! the read goes through, and the second step fails: nothing read from etcd
//! signs a token the node accepts.
#![cfg(feature = "cluster")]

use crate::common::*;
use crate::etcd_process::EtcdProcess;
use base64::Engine as _;
use meshgate::auth::{Claims, JwtKeys};

const SECRET: &str = "attack-test-cluster-secret";
const HOST: &str = "etcd.attacker.test";

fn cluster_node(etcd: &EtcdProcess, deploy: &str) -> TestNode {
    TestNode::start_with(NodeOpts {
        config: format!(
            "{TEST_CONFIG}[cluster]\n{}[deploy]\n{deploy}",
            etcd.cluster_toml()
        ),
        env: vec![("MESHGATE_CLUSTER_SECRET".into(), SECRET.into())],
        ..Default::default()
    })
}

fn deployment_to(node: &TestNode, key: &str, instance: &str) -> (u16, String) {
    let body = serde_json::json!({
        "name": "loot",
        "hosts": [HOST],
        "upstream": {"instances": [instance]},
    });
    node.with_key(
        key,
        "POST",
        "/v1/deployments",
        Some(body.to_string().as_bytes()),
    )
}

/// Claims for `ns` with every grant, as the attacker writes them.
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

#[test]
fn tenant_cannot_reach_etcd_nor_mint_tokens_from_it() {
    let etcd = EtcdProcess::start_plain();
    let etcd_url = etcd.url();
    let (_, authority) = etcd_url.split_once("://").unwrap();
    let (etcd_ip, _) = authority.rsplit_once(':').unwrap();

    // Step 1 on a node with the default egress policy: refused, nothing stored.
    let node = cluster_node(&etcd, "");
    let victim = node.create_namespace("victim");
    let attacker = node.create_namespace("attacker");
    assert_eq!(
        node.with_key(&victim, "PUT", "/v1/kv/greeting", Some(b"hello"))
            .0,
        200
    );
    let (s, b) = deployment_to(&node, &attacker, &etcd_url);
    assert_eq!(s, 400, "{b}");
    assert_eq!(json(&b)["error"]["code"], "UPSTREAM_FORBIDDEN", "{b}");
    let (_, list) = node.with_key(&attacker, "GET", "/v1/deployments", None);
    assert_eq!(json(&list)["deployments"].as_array().map(Vec::len), Some(0));
    drop(node);

    // The same attacker on a node whose policy a test-only allow list opened
    // for etcd's exact address, with the node's own addresses opened too
    // (`upstream_allow_own`: an allow entry alone never opens them): the
    // deployment is made, etcd answers through it.
    let node = cluster_node(
        &etcd,
        &format!("upstream_allow = [\"{etcd_ip}/32\"]\nupstream_allow_own = true\n"),
    );
    let (s, b) = deployment_to(&node, &attacker, &etcd_url);
    assert_eq!(s, 201, "the allow list opens etcd: {b}");
    let all = base64::engine::general_purpose::STANDARD.encode([0u8]);
    let range = format!(r#"{{"key":"{all}","range_end":"{all}"}}"#);
    let (s, _, body) = http(
        "POST",
        &node.url("/v3/kv/range"),
        &[("host", HOST), ("content-type", "application/json")],
        Some(range.as_bytes()),
    );
    assert_eq!(
        s,
        200,
        "etcd answered through the proxy: {}",
        String::from_utf8_lossy(&body)
    );
    let dump = json(&String::from_utf8_lossy(&body));
    let decode = |v: &serde_json::Value| {
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap_or_default())
            .unwrap_or_default()
    };
    let kvs: Vec<(Vec<u8>, Vec<u8>)> = dump["kvs"]
        .as_array()
        .expect("etcd's key-values")
        .iter()
        .map(|kv| (decode(&kv["key"]), decode(&kv["value"])))
        .collect();
    let jwt_key = kvs
        .iter()
        .find(|(k, _)| String::from_utf8_lossy(k).ends_with("_cluster/jwt_key"))
        .expect("the attacker reads the record named _cluster/jwt_key");

    // Step 2: every value read (and each without the store's one-byte
    // prefix) as the Ed25519 signing key of a token for the victim.
    let read_victim = |token: &str| node.with_key(token, "GET", "/v1/kv/greeting", None);
    let mut tried = 0;
    for (_, v) in &kvs {
        for candidate in [&v[..], v.get(1..).unwrap_or_default()] {
            tried += 1;
            if let Ok(keys) = JwtKeys::from_pkcs8(candidate) {
                let (s, b) = read_victim(&keys.sign(&claims_for("victim")));
                assert_eq!(
                    s, 401,
                    "a token signed with a value from etcd was accepted: {b}"
                );
            }
        }
    }
    assert!(tried >= 10, "only {tried} values read");
    assert!(
        JwtKeys::from_pkcs8(&jwt_key.1).is_err()
            && JwtKeys::from_pkcs8(jwt_key.1.get(1..).unwrap_or_default()).is_err(),
        "the JWT key in etcd is sealed, not a PKCS#8 key"
    );
    // The victim's data is whole and answers only its own key.
    assert_eq!(read_victim(&victim), (200, "hello".to_string()));
}
