//! The gateway chain and identity, driven from outside: order of the steps,
//! every bad credential, rate-limit keys, hops, and namespace isolation.

use crate::common::*;
use base64::Engine;
use meshgate::auth::{Claims, HopIdentity, HopKey, HopRequest, HopVersion, JwtKeys};
use std::time::{SystemTime, UNIX_EPOCH};

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn b64(v: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v)
}

fn code_of(body: &str) -> String {
    json(body)["error"]["code"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// An unauthenticated flood from one address is answered 429 (not 401) once its
/// bucket is empty: the client rate limit runs before authentication.
#[test]
fn flood_gets_429_before_401() {
    let node = TestNode::start_with(NodeOpts {
        config: "[rate_limit]\ngeneral_per_minute = 60\ngeneral_burst = 10\n".into(),
        ..Default::default()
    });
    let mut statuses = Vec::new();
    for _ in 0..15 {
        let (s, h, _) = http("GET", &node.url("/v1/kv/x"), &[], None);
        if s == 429 {
            assert!(header(&h, "retry-after").is_some(), "429 needs Retry-After");
        }
        statuses.push(s);
    }
    assert_eq!(&statuses[..10], &[401; 10], "{statuses:?}");
    assert_eq!(&statuses[10..], &[429; 5], "{statuses:?}");
    // Another client address has its own bucket.
    assert_eq!(
        http_from(Some("127.0.0.2"), "GET", &node.url("/v1/kv/x"), &[], None).0,
        401
    );
}

/// X-Forwarded-For from a peer that is not a trusted proxy does not change the
/// client's bucket; from a trusted proxy, two IPv6 addresses of one /64 share one.
#[test]
fn forwarded_for_and_ipv6_buckets() {
    let node = TestNode::start_with(NodeOpts {
        config: "[rate_limit]\ngeneral_per_minute = 60\ngeneral_burst = 3\ntrusted_proxies = [\"127.0.0.1\"]\n".into(),
        ..Default::default()
    });
    // 127.0.0.2 is not trusted: its XFF is ignored, all four share 127.0.0.2's bucket.
    let s: Vec<u16> = (0..4)
        .map(|i| {
            let xff = format!("198.51.100.{i}");
            http_from(
                Some("127.0.0.2"),
                "GET",
                &node.url("/v1/health"),
                &[("x-forwarded-for", &xff)],
                None,
            )
            .0
        })
        .collect();
    assert_eq!(s, [200, 200, 200, 429]);
    // From the trusted proxy: two addresses of one /64 share a bucket...
    let via = |xff: &str| {
        http(
            "GET",
            &node.url("/v1/health"),
            &[("x-forwarded-for", xff)],
            None,
        )
        .0
    };
    assert_eq!(via("2001:db8:0:1::a"), 200);
    assert_eq!(via("2001:db8:0:1::b"), 200);
    assert_eq!(via("10.0.0.1, 2001:db8:0:1:ffff::1"), 200);
    assert_eq!(via("2001:db8:0:1::c"), 429, "the /64 bucket is shared");
    // ...and another /64 has its own.
    assert_eq!(via("2001:db8:0:2::a"), 200);
}

fn hop_id(ns: &str) -> HopIdentity {
    HopIdentity {
        namespace: ns.into(),
        subject: "key:peer".into(),
        custom: String::new(),
        grants: vec!["*:*:*".into()],
        exp: None,
        iat: None,
        jti: None,
        device: None,
        session: None,
        operator: false,
    }
}

const EMPTY_BODY: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

fn hop_headers(id: &HopIdentity, mac: &str) -> Vec<(&'static str, String)> {
    meshgate::auth::hop_to_headers(id, HopVersion::V4, EMPTY_BODY, mac)
}

/// A bodiless GET of `path`, as a forwarder signs it.
fn get(path: &str) -> HopRequest<'_> {
    HopRequest {
        method: "GET",
        path,
        query: "",
        body_sha256: EMPTY_BODY,
    }
}

fn send_hop(node: &TestNode, path: &str, headers: Vec<(&'static str, String)>) -> (u16, String) {
    let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (s, _, b) = http("GET", &node.url(path), &h, None);
    (s, String::from_utf8_lossy(&b).into_owned())
}

/// A forged X-Internal-Auth identity without a MAC is anonymous; a valid MAC is
/// believed; a MAC older than 60 s, for another path, with a bad tag, or of a
/// version before v4 is refused.
#[test]
fn hop_mac_gate() {
    let secret = "cluster-secret-for-tests";
    let node = TestNode::start_with(NodeOpts {
        config: TEST_CONFIG.into(),
        env: vec![("MESHGATE_CLUSTER_SECRET".into(), secret.into())],
        ..Default::default()
    });
    node.create_namespace("hopns");
    let id = hop_id("hopns");
    let key = HopKey::from_secret(secret.as_bytes());
    let path = "/v1/auth/whoami";
    // No MAC at all: anonymous.
    let (s, b) = send_hop(
        &node,
        path,
        hop_headers(&id, "")
            .into_iter()
            .filter(|(k, _)| !k.ends_with("MAC"))
            .collect(),
    );
    assert_eq!(
        (s, code_of(&b).as_str()),
        (401, "MISSING_CREDENTIAL"),
        "{b}"
    );
    // Valid MAC: believed.
    let mac = key.sign(HopVersion::V4, &get(path), &id, now());
    let (s, b) = send_hop(&node, path, hop_headers(&id, &mac));
    assert_eq!(s, 200, "{b}");
    assert_eq!(json(&b)["kind"], "hop");
    // Older than 60 s.
    let old = key.sign(HopVersion::V4, &get(path), &id, now() - 120);
    assert_eq!(send_hop(&node, path, hop_headers(&id, &old)).0, 401);
    // Signed for another path.
    let other = key.sign(HopVersion::V4, &get("/v1/kv/x"), &id, now());
    assert_eq!(send_hop(&node, path, hop_headers(&id, &other)).0, 401);
    // Signed with another secret.
    let forged = HopKey::from_secret(b"wrong").sign(HopVersion::V4, &get(path), &id, now());
    assert_eq!(send_hop(&node, path, hop_headers(&id, &forged)).0, 401);
    // A well-made MAC of an older version (no query, no body digest).
    for v in [HopVersion::V1, HopVersion::V3] {
        let old = key.sign(v, &get(path), &id, now());
        let h = meshgate::auth::hop_to_headers(&id, v, EMPTY_BODY, &old);
        assert_eq!(send_hop(&node, path, h).0, 401, "{v}");
    }
    // A node without a cluster secret believes no hop, however well signed
    // (a cluster node always has one: single mode only).
    if !cluster_mode() {
        let plain = TestNode::start();
        plain.create_namespace("hopns");
        let mac = key.sign(HopVersion::V4, &get(path), &id, now());
        assert_eq!(send_hop(&plain, path, hop_headers(&id, &mac)).0, 401);
    }
}

fn token_for(node: &TestNode, api_key: &str) -> serde_json::Value {
    let body = format!("{{\"api_key\":\"{api_key}\"}}");
    let (s, b) = node.with_key("", "POST", "/v1/auth/token", Some(body.as_bytes()));
    assert_eq!(s, 200, "{b}");
    json(&b)
}

fn whoami(node: &TestNode, cred: &str) -> (u16, String) {
    node.with_key(cred, "GET", "/v1/auth/whoami", None)
}

/// Every malformed or forged JWT is refused with 401 and its own code; another
/// namespace's valid token is 403.
#[test]
fn bad_jwts_are_refused() {
    if single_node_only() {
        return;
    }
    let node = TestNode::start();
    let key_a = node.create_namespace("jwt-a");
    node.create_namespace("jwt-b");
    let tok = token_for(&node, &key_a)["access_token"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(whoami(&node, &tok).0, 200);
    let keys = JwtKeys::load_or_generate(&node.dir.join("jwt.key")).unwrap();
    let parts: Vec<&str> = tok.split('.').collect();
    let header: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(parts[0])
            .unwrap(),
    )
    .unwrap();
    let kid = header["kid"].as_str().unwrap().to_string();
    let claims = |ns: &str, iat: u64, nbf: u64, exp: u64| {
        let mut c = Claims::new(
            "meshgate",
            "meshgate",
            "key:test",
            ns,
            vec!["*:*:*".into()],
            iat,
        )
        .unwrap();
        c.nbf = nbf;
        c.exp = exp;
        c
    };
    let t = now();
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "two parts",
            format!("{}.{}", parts[0], parts[1]),
            "MALFORMED_TOKEN",
        ),
        (
            "bad base64 header",
            format!("!!!.{}.{}", parts[1], parts[2]),
            "TOKEN_BAD_ENCODING",
        ),
        (
            "bad json payload, validly signed",
            {
                let pair = ring::signature::Ed25519KeyPair::from_pkcs8(
                    &std::fs::read(node.dir.join("jwt.key")).unwrap(),
                )
                .unwrap();
                let input = format!("{}.{}", parts[0], b64(b"{nope"));
                format!("{input}.{}", b64(pair.sign(input.as_bytes()).as_ref()))
            },
            "TOKEN_BAD_JSON",
        ),
        (
            "bad json payload, unsigned",
            format!("{}.{}.{}", parts[0], b64(b"{nope"), parts[2]),
            "BAD_SIGNATURE",
        ),
        (
            "bad base64 signature",
            format!("{}.{}.@@@", parts[0], parts[1]),
            "TOKEN_BAD_ENCODING",
        ),
        (
            "alg none",
            format!(
                "{}.{}.",
                b64(format!(r#"{{"alg":"none","typ":"JWT","kid":"{kid}"}}"#).as_bytes()),
                parts[1]
            ),
            "UNSUPPORTED_ALG",
        ),
        (
            "hs256 with the public key",
            {
                let h = b64(format!(r#"{{"alg":"HS256","typ":"JWT","kid":"{kid}"}}"#).as_bytes());
                let input = format!("{h}.{}", parts[1]);
                let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, keys.public_key());
                format!(
                    "{input}.{}",
                    b64(ring::hmac::sign(&k, input.as_bytes()).as_ref())
                )
            },
            "UNSUPPORTED_ALG",
        ),
        (
            "missing kid",
            format!(
                "{}.{}.{}",
                b64(br#"{"alg":"EdDSA","typ":"JWT"}"#),
                parts[1],
                parts[2]
            ),
            "MISSING_KID",
        ),
        (
            "unknown kid",
            format!(
                "{}.{}.{}",
                b64(br#"{"alg":"EdDSA","typ":"JWT","kid":"ed_0000000000000000"}"#),
                parts[1],
                parts[2]
            ),
            "UNKNOWN_KID",
        ),
        (
            "tampered payload",
            {
                let mut c = claims("jwt-a", t, t, t + 600);
                c.grants = vec!["*:*:*".into(), "extra:*:*".into()];
                format!(
                    "{}.{}.{}",
                    parts[0],
                    b64(&serde_json::to_vec(&c).unwrap()),
                    parts[2]
                )
            },
            "BAD_SIGNATURE",
        ),
        (
            "expired",
            keys.sign(&claims("jwt-a", t - 3600, t - 3600, t - 600)),
            "TOKEN_EXPIRED",
        ),
        (
            "nbf in the future",
            keys.sign(&claims("jwt-a", t, t + 600, t + 1200)),
            "TOKEN_NOT_YET_VALID",
        ),
    ];
    for (name, token, code) in cases {
        let (s, b) = whoami(&node, &token);
        assert_eq!(s, 401, "{name}: {b}");
        assert_eq!(code_of(&b), code, "{name}: {b}");
    }
    // Within the ±60 s leeway is still fine.
    assert_eq!(
        whoami(
            &node,
            &keys.sign(&claims("jwt-a", t - 900, t - 900, t - 30))
        )
        .0,
        200
    );
    // A valid token of namespace A aimed at namespace B.
    let (s, b) = node.with_key(&tok, "GET", "/v1/kv/x?namespace=jwt-b", None);
    assert_eq!(
        (s, code_of(&b).as_str()),
        (403, "NAMESPACE_MISMATCH"),
        "{b}"
    );
}

/// API keys: a bad checksum is refused before any lookup, a revoked key on the
/// next request, an expired key always.
#[test]
fn bad_api_keys_are_refused() {
    let mut node = TestNode::start();
    let owner = node.create_namespace("keys");
    // Flip the body's last digit (`mg_sk_<33 digits>_<crc>`): the checksum
    // catches it. A digit near the front could push the value past 24 bytes,
    // which is refused earlier as malformed.
    let mut typo: Vec<char> = owner.chars().collect();
    let i = "mg_sk_".len() + 32;
    typo[i] = if typo[i] == 'a' { 'b' } else { 'a' };
    let typo: String = typo.into_iter().collect();
    let (s, b) = whoami(&node, &typo);
    assert_eq!((s, code_of(&b).as_str()), (401, "BAD_CHECKSUM"), "{b}");
    // Revocation takes effect on the next request.
    let (s, b) = node.with_key(
        &owner,
        "POST",
        "/v1/auth/api-keys",
        Some(br#"{"role":"reader","name":"r"}"#),
    );
    assert_eq!(s, 201, "{b}");
    let v = json(&b);
    let reader = v["api_key"].as_str().unwrap().to_string();
    let id = v["key"]["id"].as_str().unwrap().to_string();
    assert_eq!(whoami(&node, &reader).0, 200);
    let (s, b) = node.with_key(&owner, "GET", "/v1/auth/api-keys", None);
    assert_eq!(s, 200);
    assert!(!b.contains(&reader), "listing must never show a secret");
    assert_eq!(
        node.with_key(&owner, "DELETE", &format!("/v1/auth/api-keys/{id}"), None)
            .0,
        200
    );
    let (s, b) = whoami(&node, &reader);
    assert_eq!((s, code_of(&b).as_str()), (401, "API_KEY_REVOKED"), "{b}");
    // A reader cannot mint an owner key (no escalation).
    let (_, b) = node.with_key(
        &owner,
        "POST",
        "/v1/auth/api-keys",
        Some(br#"{"role":"reader"}"#),
    );
    let reader2 = json(&b)["api_key"].as_str().unwrap().to_string();
    let (s, _) = node.with_key(
        &reader2,
        "POST",
        "/v1/auth/api-keys",
        Some(br#"{"role":"owner"}"#),
    );
    assert_eq!(s, 403);
    // An expired key: written straight into the node's sled store with a
    // creation time in the past (a cluster's store is etcd; its key expiry is
    // the same code, checked here on one node).
    if single_node_only() {
        return;
    }
    let dir = node.dir.clone();
    node.signal(15);
    assert_eq!(node.wait_exit(std::time::Duration::from_secs(20)), Some(0));
    let expired = {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let store = meshgate::storage::Store::open_sled(&dir).unwrap();
            let secret = std::fs::read(dir.join("server.secret")).unwrap();
            // A single node MACs its key records under the server secret.
            store
                .adopt_record_macs(meshgate::storage::RecordMac::derive(&secret), true)
                .await
                .unwrap();
            let (k, _) = meshgate::identity::create_key(
                &store,
                &secret,
                meshgate::identity::NewKey {
                    namespace: "keys",
                    name: "old",
                    kind: meshgate::auth::KeyKind::Secret,
                    role: Some(meshgate::auth::Role::Reader),
                    grants: vec![],
                    expires_in_days: 1,
                },
                now() - 2 * 86_400,
            )
            .await
            .unwrap();
            // The folder is free for the node only once the store is closed.
            store.close();
            k
        })
    };
    let node2 = TestNode::start_with(NodeOpts {
        config: TEST_CONFIG.into(),
        data_dir: Some(dir),
        ..Default::default()
    });
    let (s, b) = whoami(&node2, &expired);
    assert_eq!((s, code_of(&b).as_str()), (401, "API_KEY_EXPIRED"), "{b}");
    drop(node);
}

/// Refresh tokens rotate; the previous one works once more within the grace
/// window; a further reuse revokes the whole family.
#[test]
fn refresh_rotation_and_reuse() {
    let node = TestNode::start();
    let key = node.create_namespace("refresh");
    let first = token_for(&node, &key)["refresh_token"]
        .as_str()
        .unwrap()
        .to_string();
    let refresh = |t: &str| {
        node.with_key(
            "",
            "POST",
            "/v1/auth/refresh",
            Some(format!("{{\"refresh_token\":\"{t}\"}}").as_bytes()),
        )
    };
    let (s, b) = refresh(&first);
    assert_eq!(s, 200, "{b}");
    let second = json(&b)["refresh_token"].as_str().unwrap().to_string();
    assert_ne!(first, second);
    // Retry of the first within 60 s (a lost answer): accepted once.
    let (s, b) = refresh(&first);
    assert_eq!(s, 200, "{b}");
    let third = json(&b)["refresh_token"].as_str().unwrap().to_string();
    // Any later reuse: refused and the family revoked, so even the newest fails.
    let (s, b) = refresh(&first);
    assert_eq!(
        (s, code_of(&b).as_str()),
        (401, "REFRESH_TOKEN_REUSED"),
        "{b}"
    );
    let (s, b) = refresh(&third);
    assert_eq!(
        (s, code_of(&b).as_str()),
        (401, "REFRESH_TOKEN_REVOKED"),
        "{b}"
    );
    assert_eq!(refresh("mgr_garbage").0, 401);
}

/// Wallet sign-in (enabled by the namespace's owner): a signed challenge
/// logs in once; replaying it is refused.
#[test]
fn wallet_sign_in_and_replay() {
    use ring::signature::{Ed25519KeyPair, KeyPair};
    let node = TestNode::start();
    let owner = node.create_namespace("wallets");
    let (s, b) = node.with_key(
        &owner,
        "PUT",
        "/v1/namespaces/wallets/wallet-sign-in",
        Some(br#"{"enabled":true,"allow":"any"}"#),
    );
    assert_eq!(s, 200, "{b}");
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
    let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap();
    let wallet = hex::encode(pair.public_key().as_ref());
    let body = format!(r#"{{"wallet":"{wallet}","namespace":"wallets"}}"#);
    let (s, b) = node.with_key("", "POST", "/v1/auth/challenge", Some(body.as_bytes()));
    assert_eq!(s, 200, "{b}");
    let message = json(&b)["message"].as_str().unwrap().to_string();
    let sig = hex::encode(pair.sign(message.as_bytes()).as_ref());
    let verify = serde_json::json!({"message": message, "signature": sig}).to_string();
    let (s, b) = node.with_key("", "POST", "/v1/auth/verify", Some(verify.as_bytes()));
    assert_eq!(s, 200, "{b}");
    let tok = json(&b)["access_token"].as_str().unwrap().to_string();
    let (s, b) = whoami(&node, &tok);
    assert_eq!(s, 200);
    assert_eq!(json(&b)["subject"], format!("wallet:{wallet}"));
    let (s, b) = node.with_key("", "POST", "/v1/auth/verify", Some(verify.as_bytes()));
    assert_eq!((s, code_of(&b).as_str()), (401, "NONCE_SPENT"), "{b}");
    // A signature by another key over the same message is refused.
    let other =
        Ed25519KeyPair::from_pkcs8(Ed25519KeyPair::generate_pkcs8(&rng).unwrap().as_ref()).unwrap();
    let (_, b) = node.with_key("", "POST", "/v1/auth/challenge", Some(body.as_bytes()));
    let m2 = json(&b)["message"].as_str().unwrap().to_string();
    let bad = serde_json::json!({"message": m2, "signature": hex::encode(other.sign(m2.as_bytes()).as_ref())}).to_string();
    assert_eq!(
        node.with_key("", "POST", "/v1/auth/verify", Some(bad.as_bytes()))
            .0,
        401
    );
}

/// Export then import round-trips a namespace's KV exactly and leaves its keys
/// and members alone; another namespace's key can neither read nor write it.
#[test]
fn export_import_and_isolation() {
    let node = TestNode::start();
    let a = node.create_namespace("iso-a");
    let b = node.create_namespace("iso-b");
    for (k, v) in [("x", &b"1"[..]), ("dir/y", b"\x00\xffbin"), ("z", b"")] {
        assert_eq!(
            node.with_key(&a, "PUT", &format!("/v1/kv/{k}"), Some(v)).0,
            200
        );
    }
    let (s, exported) = node.with_key(&a, "GET", "/v1/db/export", None);
    assert_eq!(s, 200, "{exported}");
    // Change the data, then import the export: back to exactly the exported state.
    assert_eq!(
        node.with_key(&a, "PUT", "/v1/kv/extra", Some(b"new")).0,
        200
    );
    assert_eq!(node.with_key(&a, "DELETE", "/v1/kv/x", None).0, 200);
    let (s, body) = node.with_key(&a, "PUT", "/v1/db/import", Some(exported.as_bytes()));
    assert_eq!(s, 200, "{body}");
    let (_, again) = node.with_key(&a, "GET", "/v1/db/export", None);
    assert_eq!(json(&again), json(&exported));
    assert_eq!(node.with_key(&a, "GET", "/v1/kv/extra", None).0, 404);
    assert_eq!(
        whoami(&node, &a).0,
        200,
        "the namespace's keys are untouched"
    );
    // A malformed import changes nothing.
    let (s, _) = node.with_key(
        &a,
        "PUT",
        "/v1/db/import",
        Some(br#"{"format":1,"kv":[{"key":"q","value_base64":"***"}]}"#),
    );
    assert_eq!(s, 400);
    let (_, after) = node.with_key(&a, "GET", "/v1/db/export", None);
    assert_eq!(json(&after), json(&exported));
    // Isolation: B's key against A's namespace, by header, query or host.
    let (s, body) = node.with_key(&b, "GET", "/v1/kv/x?namespace=iso-a", None);
    assert_eq!((s, code_of(&body).as_str()), (403, "NAMESPACE_MISMATCH"));
    let auth = format!("Bearer {b}");
    let (s, _, _) = http(
        "PUT",
        &node.url("/v1/kv/x"),
        &[("authorization", &auth), ("x-namespace", "iso-a")],
        Some(b"evil"),
    );
    assert_eq!(s, 403);
    let (s, _, _) = http(
        "GET",
        &node.url("/v1/kv/x"),
        &[("authorization", &auth), ("host", "ns-iso-a.localhost")],
        None,
    );
    assert_eq!(s, 403);
    // The same by `X-API-Key`, the header form of a key: B's key reaches
    // only B, A's own works, a forged one is 401.
    let (s, _, _) = http(
        "GET",
        &node.url("/v1/kv/x"),
        &[("x-api-key", &b), ("x-namespace", "iso-a")],
        None,
    );
    assert_eq!(s, 403);
    let (s, _, body) = http("GET", &node.url("/v1/kv/x"), &[("x-api-key", &a)], None);
    assert_eq!((s, body.as_slice()), (200, &b"1"[..]));
    // A's key with its last character changed fails the key's checksum.
    let mut forged = a.clone();
    let last = if forged.pop() == Some('0') { '1' } else { '0' };
    forged.push(last);
    let (s, _, body) = http(
        "GET",
        &node.url("/v1/kv/x"),
        &[("x-api-key", &forged)],
        None,
    );
    let body = String::from_utf8_lossy(&body);
    assert_eq!((s, code_of(&body).as_str()), (401, "BAD_CHECKSUM"));
    // B's own KV is separate.
    assert_eq!(node.with_key(&b, "GET", "/v1/kv/x", None).0, 404);
    assert_eq!(
        node.with_key(&a, "GET", "/v1/kv/x", None),
        (200, "1".into())
    );
}

/// Grants are enforced per route and per resource; the operator must name a namespace.
#[test]
fn grants_and_scopes() {
    let node = TestNode::start();
    let owner = node.create_namespace("scopes");
    let (_, b) = node.with_key(
        &owner,
        "POST",
        "/v1/auth/api-keys",
        Some(br#"{"grants":["kv:read:public/*"]}"#),
    );
    let narrow = json(&b)["api_key"].as_str().unwrap().to_string();
    assert_eq!(
        node.with_key(&owner, "PUT", "/v1/kv/public/a", Some(b"1"))
            .0,
        200
    );
    assert_eq!(
        node.with_key(&owner, "PUT", "/v1/kv/secret", Some(b"2")).0,
        200
    );
    assert_eq!(
        node.with_key(&narrow, "GET", "/v1/kv/public/a", None).0,
        200
    );
    let (s, b) = node.with_key(&narrow, "GET", "/v1/kv/secret", None);
    assert_eq!((s, code_of(&b).as_str()), (403, "MISSING_GRANT"));
    let (s, b) = node.with_key(&narrow, "PUT", "/v1/kv/public/a", Some(b"x"));
    assert_eq!(
        (s, code_of(&b).as_str()),
        (403, "MISSING_GRANT"),
        "scope gate: no kv:write at all"
    );
    // The operator acts on any namespace, but must say which.
    let (s, b) = node.op("GET", "/v1/kv/secret", None);
    assert_eq!((s, code_of(&b).as_str()), (400, "NAMESPACE_REQUIRED"));
    assert_eq!(
        node.op("GET", "/v1/kv/secret?namespace=scopes", None),
        (200, "2".into())
    );
    // A namespace key is not the operator.
    assert_eq!(node.with_key(&owner, "GET", "/v1/namespaces", None).0, 403);
    assert_eq!(http("GET", &node.url("/v1/namespaces"), &[], None).0, 401);
}

/// CORS: a preflight from an allowed origin is 204 with the allow headers; others 403.
#[test]
fn cors_preflight() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[cors]\nallowed_origins = [\"https://app.example\"]\n"),
        ..Default::default()
    });
    let pre = |origin: &str| {
        http(
            "OPTIONS",
            &node.url("/v1/kv/x"),
            &[("origin", origin), ("access-control-request-method", "GET")],
            None,
        )
    };
    let (s, h, _) = pre("https://app.example");
    assert_eq!(s, 204);
    assert_eq!(
        header(&h, "access-control-allow-origin"),
        Some("https://app.example")
    );
    assert_eq!(pre("https://evil.example").0, 403);
    let (_, h, _) = http(
        "GET",
        &node.url("/v1/health"),
        &[("origin", "https://app.example")],
        None,
    );
    assert_eq!(
        header(&h, "access-control-allow-origin"),
        Some("https://app.example")
    );
}

/// A namespace's own bucket (set at creation) refuses past its burst with 429
/// NAMESPACE_RATE_LIMITED, while another namespace is unaffected.
#[test]
fn namespace_rate_limit_per_namespace() {
    let node = TestNode::start();
    let slow = node.create_namespace_from(r#"{"name":"slow","rate_per_minute":60,"rate_burst":5}"#);
    let fast = node.create_namespace("fast");
    let codes: Vec<u16> = (0..7)
        .map(|_| node.with_key(&slow, "GET", "/v1/kv/x", None).0)
        .collect();
    assert_eq!(codes, [404, 404, 404, 404, 404, 429, 429]);
    let (_, b) = node.with_key(&slow, "GET", "/v1/kv/x", None);
    assert_eq!(code_of(&b), "NAMESPACE_RATE_LIMITED");
    assert_eq!(node.with_key(&fast, "GET", "/v1/kv/x", None).0, 404);
}

/// Near misses of the operator key, as someone guessing it would send them:
/// the same length with one byte changed, one byte shorter, one byte longer,
/// another case. Each is refused with 401 `INVALID_OPERATOR_KEY` on an
/// operator route and creates nothing; a string of the key's length without
/// the `mgop_` prefix is refused too; the key itself still works.
#[test]
fn near_miss_operator_keys_are_refused() {
    let node = TestNode::start();
    let key = node.operator_key.clone();
    assert!(key.starts_with("mgop_") && key.len() > 8, "{key}");
    let flip = |i: usize| {
        let mut b = key.clone().into_bytes();
        b[i] = if b[i] == b'a' { b'b' } else { b'a' };
        String::from_utf8(b).unwrap()
    };
    let near: Vec<(&str, String)> = vec![
        ("last byte changed", flip(key.len() - 1)),
        ("first byte after the prefix changed", flip(5)),
        ("one byte shorter", key[..key.len() - 1].to_string()),
        ("one byte longer", format!("{key}0")),
        (
            "upper case",
            key.to_uppercase().replacen("MGOP_", "mgop_", 1),
        ),
    ];
    for (i, (what, cred)) in near.iter().enumerate() {
        assert_ne!(cred, &key, "{what}");
        assert!(cred.len().abs_diff(key.len()) <= 1, "{what}");
        let name = format!("nearmiss-{i}");
        let body = format!("{{\"name\":\"{name}\"}}");
        let (s, b) = node.with_key(cred, "POST", "/v1/namespaces", Some(body.as_bytes()));
        assert_eq!(s, 401, "{what}: {b}");
        assert_eq!(
            json(&b)["error"]["code"],
            "INVALID_OPERATOR_KEY",
            "{what}: {b}"
        );
        let (s, b) = whoami(&node, cred);
        assert_eq!(
            (s, json(&b)["error"]["code"].as_str()),
            (401, Some("INVALID_OPERATOR_KEY")),
            "{what} on whoami: {b}"
        );
        // Nothing was created under the guessed key.
        let (s, b) = node.op("GET", &format!("/v1/namespaces/{name}"), None);
        assert_eq!(s, 404, "{what} created {name}: {b}");
    }
    // The key's length without its prefix is no operator credential either.
    let unprefixed = format!("xxxx_{}", &key[5..]);
    assert_eq!(unprefixed.len(), key.len());
    let (s, b) = node.with_key(
        &unprefixed,
        "POST",
        "/v1/namespaces",
        Some(b"{\"name\":\"nearmiss-x\"}"),
    );
    assert_eq!(s, 401, "{b}");
    assert_ne!(json(&b)["error"]["code"], "INVALID_OPERATOR_KEY", "{b}");
    let (s, b) = node.op("GET", "/v1/namespaces/nearmiss-x", None);
    assert_eq!(s, 404, "the unprefixed key created nearmiss-x: {b}");
    // And the key itself is still the operator's.
    node.create_namespace("nearmiss-ok");
}

/// A request's headers, owned.
type Headers = Vec<(&'static str, String)>;

/// The whole order of the chain's refusing steps (docs/design.md §2):
/// client rate limit (5), CORS (6), domain routing (7), authentication (8),
/// authorization (9), scope gate (10), namespace rate limit (11), handler
/// (12). Each request below fails at two or more of them; the answer is
/// always the earliest one's. Every request comes from an address of its
/// own (`127.0.0.x`), so only the row meant to meet an empty client bucket
/// meets one; the buckets refill once a minute, so none refills meanwhile.
#[test]
fn the_first_failing_step_in_the_chain_answers() {
    let node = TestNode::start_with(NodeOpts {
        config: "[rate_limit]\ngeneral_per_minute = 1\ngeneral_burst = 40\n\
                 credential_per_minute = 100000\ncredential_burst = 10000\n\
                 namespace_per_minute = 1000000\nnamespace_burst = 100000\n\
                 anonymous_per_minute = 1000000\nanonymous_burst = 100000\n\
                 [cors]\nallowed_origins = [\"https://app.example\"]\n"
            .into(),
        ..Default::default()
    });
    let members = match node.member_of_namespaces() {
        Some(m) => format!(",\"members\":[\"{m}\"]"),
        None => String::new(),
    };
    // `slow`: its namespace bucket holds one request a minute.
    let slow = node.create_namespace_from(&format!(
        "{{\"name\":\"slow\",\"rate_per_minute\":1,\"rate_burst\":1{members}}}"
    ));
    let other = node.create_namespace("other");
    let narrow = |owner: &str| {
        let (s, b) = node.with_key(
            owner,
            "POST",
            "/v1/auth/api-keys",
            Some(br#"{"grants":["kv:read:*"],"name":"narrow"}"#),
        );
        assert_eq!(s, 201, "{b}");
        json(&b)["api_key"].as_str().unwrap().to_string()
    };
    let slow_reader = narrow(&slow);
    let other_reader = narrow(&other);
    // Empty slow's bucket: its one request, then its refusal.
    let mut spent = Vec::new();
    for _ in 0..5 {
        let (s, b) = node.with_key(&slow, "GET", "/v1/kv/x", None);
        spent.push((s, code_of(&b)));
        if s == 429 {
            break;
        }
    }
    assert_eq!(
        spent.last(),
        Some(&(429, "NAMESPACE_RATE_LIMITED".to_string())),
        "{spent:?}"
    );
    // Empty the client bucket of 127.0.0.9.
    let flooded = "127.0.0.9";
    let mut flood = 0;
    while http_from(Some(flooded), "GET", &node.url("/v1/health"), &[], None).0 != 429 {
        flood += 1;
        assert!(flood < 100, "the client bucket never emptied");
    }
    let malformed = "Bearer mg_sk_notakey";
    let bearer = |k: &str| format!("Bearer {k}");
    let host_of_other = format!(
        "ns-other.localhost:{}",
        node.addr.rsplit(':').next().unwrap()
    );
    // (what fails, from, method, path, headers, status, code)
    let rows: Vec<(&str, &str, &str, &str, Headers, u16, &str)> = vec![
        (
            "client rate limit (5), authentication (8), namespace rate limit (11)",
            flooded,
            "GET",
            "/v1/kv/x",
            vec![("authorization", malformed.into())],
            429,
            "RATE_LIMITED",
        ),
        (
            "client rate limit (5), CORS (6)",
            flooded,
            "OPTIONS",
            "/v1/kv/x",
            vec![
                ("origin", "https://evil.example".into()),
                ("access-control-request-method", "GET".into()),
            ],
            429,
            "RATE_LIMITED",
        ),
        (
            "CORS preflight (6), authentication (8)",
            "127.0.0.11",
            "OPTIONS",
            "/v1/kv/x",
            vec![
                ("authorization", malformed.into()),
                ("origin", "https://evil.example".into()),
                ("access-control-request-method", "GET".into()),
            ],
            403,
            "CORS_ORIGIN_DENIED",
        ),
        (
            "authentication (8), authorization (9), namespace rate limit (11)",
            "127.0.0.12",
            "PUT",
            "/v1/kv/x",
            vec![
                ("authorization", malformed.into()),
                ("x-namespace", "slow".into()),
            ],
            401,
            "MALFORMED_API_KEY",
        ),
        (
            "domain routing's target (7) refused by authorization (9), namespace rate limit (11)",
            "127.0.0.13",
            "GET",
            "/v1/kv/x",
            vec![
                ("authorization", bearer(&slow)),
                ("host", host_of_other.clone()),
            ],
            403,
            "NAMESPACE_MISMATCH",
        ),
        (
            "authorization (9), scope gate (10), namespace rate limit (11)",
            "127.0.0.14",
            "PUT",
            "/v1/kv/x",
            vec![
                ("authorization", bearer(&other_reader)),
                ("x-namespace", "slow".into()),
            ],
            403,
            "NAMESPACE_MISMATCH",
        ),
        (
            "scope gate (10), namespace rate limit (11), handler (12: no such key)",
            "127.0.0.15",
            "DELETE",
            "/v1/kv/nothing-here",
            vec![("authorization", bearer(&slow_reader))],
            403,
            "MISSING_GRANT",
        ),
        (
            "namespace rate limit (11), handler (12: no such key)",
            "127.0.0.16",
            "GET",
            "/v1/kv/nothing-here",
            vec![("authorization", bearer(&slow))],
            429,
            "NAMESPACE_RATE_LIMITED",
        ),
    ];
    for (what, from, method, path, headers, status, code) in &rows {
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (s, _, b) = http_from(Some(*from), method, &node.url(path), &h, None);
        let b = String::from_utf8_lossy(&b);
        assert_eq!((s, code_of(&b).as_str()), (*status, *code), "{what}: {b}");
    }
    // Each later step does refuse on its own: the rows' expectations are
    // not the only answer these requests could get.
    let alone: [(&str, &str, &str, Headers, u16, &str); 3] = [
        (
            "127.0.0.17",
            "GET",
            "/v1/kv/nothing-here",
            vec![("authorization", bearer(&other))],
            404,
            "KEY_NOT_FOUND",
        ),
        (
            "127.0.0.18",
            "DELETE",
            "/v1/kv/nothing-here",
            vec![("authorization", bearer(&other_reader))],
            403,
            "MISSING_GRANT",
        ),
        (
            "127.0.0.19",
            "GET",
            "/v1/kv/x",
            vec![("origin", "https://evil.example".into())],
            401,
            "MISSING_CREDENTIAL",
        ),
    ];
    for (from, method, path, headers, status, code) in &alone {
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (s, _, b) = http_from(Some(*from), method, &node.url(path), &h, None);
        let b = String::from_utf8_lossy(&b);
        assert_eq!(
            (s, code_of(&b).as_str()),
            (*status, *code),
            "{method} {path}: {b}"
        );
    }
}
