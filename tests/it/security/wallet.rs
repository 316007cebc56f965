//! Wallet sign-in is the namespace's choice (issue #39): with no credential at
//! all, anyone could make an Ed25519 key, ask `POST /v1/auth/challenge` for
//! namespace `bank`, sign it, `POST /v1/auth/verify` and get the runtime
//! role there (read and write bank's KV, subscribe to its topics, invoke its
//! functions). Now a namespace that never opted in refuses the challenge;
//! its owner enables sign-in with a role of its own, that role's grants
//! (`{sub}` is the wallet's address) and the wallets allowed, and a wallet
//! gets exactly those grants, rechecked at every verify and refresh.

use crate::common::*;
use ring::signature::{Ed25519KeyPair, KeyPair};
use serde_json::{Value, json};

/// A wallet: an Ed25519 key pair and its address (64 lower-case hex).
struct Wallet {
    pair: Ed25519KeyPair,
    addr: String,
}

impl Wallet {
    fn new() -> Wallet {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap();
        let addr = hex::encode(pair.public_key().as_ref());
        Wallet { pair, addr }
    }

    /// The signature of `message`, in hex.
    fn sign(&self, message: &str) -> String {
        hex::encode(self.pair.sign(message.as_bytes()).as_ref())
    }
}

/// A POST without a credential to `base` (a node's base URL).
fn post(base: &str, path: &str, body: &Value) -> (u16, String) {
    let (s, _, b) = http(
        "POST",
        &format!("{base}{path}"),
        &[("content-type", "application/json")],
        Some(body.to_string().as_bytes()),
    );
    (s, String::from_utf8_lossy(&b).into_owned())
}

/// A call with a credential to `base`.
fn call(base: &str, key: &str, method: &str, path: &str, body: Option<&[u8]>) -> (u16, String) {
    let auth = format!("Bearer {key}");
    let (s, _, b) = http(
        method,
        &format!("{base}{path}"),
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
        body,
    );
    (s, String::from_utf8_lossy(&b).into_owned())
}

fn code_of(body: &str) -> String {
    json(body)["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Asks for a challenge for `w` in `ns` through `base`: the message, or the refusal.
fn challenge(base: &str, w: &Wallet, ns: &str) -> Result<String, (u16, String)> {
    let (s, b) = post(
        base,
        "/v1/auth/challenge",
        &json!({"wallet": w.addr, "namespace": ns}),
    );
    if s != 200 {
        return Err((s, code_of(&b)));
    }
    Ok(json(&b)["message"].as_str().unwrap().to_string())
}

/// Sends `w`'s signature of `message` to verify through `base`.
fn verify(base: &str, w: &Wallet, message: &str) -> (u16, String) {
    post(
        base,
        "/v1/auth/verify",
        &json!({"message": message, "signature": w.sign(message)}),
    )
}

/// Challenge, sign and verify through `base`: the token answer.
fn sign_in(base: &str, w: &Wallet, ns: &str) -> Value {
    let message = challenge(base, w, ns).unwrap_or_else(|e| panic!("challenge: {e:?}"));
    let (s, b) = verify(base, w, &message);
    assert_eq!(s, 200, "verify: {b}");
    json(&b)
}

/// Sets `ns`'s wallet sign-in through `base` with `key`.
fn set(base: &str, key: &str, ns: &str, body: &Value) -> (u16, String) {
    call(
        base,
        key,
        "PUT",
        &format!("/v1/namespaces/{ns}/wallet-sign-in"),
        Some(body.to_string().as_bytes()),
    )
}

/// `ns`'s wallet sign-in as GET shows it through `base`.
fn get(base: &str, key: &str, ns: &str) -> Value {
    let (s, b) = call(
        base,
        key,
        "GET",
        &format!("/v1/namespaces/{ns}/wallet-sign-in"),
        None,
    );
    assert_eq!(s, 200, "{b}");
    json(&b)["wallet_sign_in"].clone()
}

fn refresh(base: &str, token: &Value) -> (u16, String) {
    post(
        base,
        "/v1/auth/refresh",
        &json!({"refresh_token": token["refresh_token"]}),
    )
}

fn access(token: &Value) -> String {
    token["access_token"].as_str().unwrap().to_string()
}

/// The grants whoami lists for `token`.
fn grants_of(base: &str, token: &str) -> Vec<String> {
    let (s, b) = call(base, token, "GET", "/v1/auth/whoami", None);
    assert_eq!(s, 200, "{b}");
    let mut g: Vec<String> = json(&b)["grants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    g.sort();
    g
}

/// The attack exactly as found: a fresh key and no credential at all, on a
/// namespace whose owner never opted in. The challenge is 403
/// `WALLET_SIGN_IN_DISABLED`; a message built in the challenge's own format
/// and signed is refused by verify (no nonce was issued); no token comes
/// out, and bank's KV stays unread. GET shows the setting off.
#[test]
fn the_attack_is_refused_on_a_namespace_that_never_opted_in() {
    let node = TestNode::start();
    let owner = node.create_namespace("bank");
    assert_eq!(
        node.with_key(&owner, "PUT", "/v1/kv/vault", Some(b"gold"))
            .0,
        200
    );
    let attacker = Wallet::new();
    assert_eq!(
        challenge(&node.base, &attacker, "bank"),
        Err((403, "WALLET_SIGN_IN_DISABLED".into()))
    );
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let forged =
        meshgate::auth::challenge_message(&attacker.addr, "bank", &"ab".repeat(32), t, t + 300);
    let (s, b) = verify(&node.base, &attacker, &forged);
    assert_eq!((s, code_of(&b).as_str()), (401, "NONCE_SPENT"), "{b}");
    assert!(!b.contains("access_token"), "{b}");
    // Without a token there is no way in: anonymous reads are refused.
    let (s, _, _) = http(
        "GET",
        &node.url("/v1/kv/vault"),
        &[("x-namespace", "bank")],
        None,
    );
    assert_eq!(s, 401);
    let shown = get(&node.base, &owner, "bank");
    assert_eq!(shown["enabled"], false, "{shown}");
}

/// An owner that enables sign-in without naming a role gives wallets the
/// default `wallet` role: no grants at all, so no KV read, no subscribe,
/// no invoke, whatever the signature.
#[test]
fn the_default_wallet_role_holds_no_grants() {
    let node = TestNode::start();
    let owner = node.create_namespace("bank");
    assert_eq!(
        node.with_key(&owner, "PUT", "/v1/kv/vault", Some(b"gold"))
            .0,
        200
    );
    let (s, b) = set(
        &node.base,
        &owner,
        "bank",
        &json!({"enabled": true, "allow": "any"}),
    );
    assert_eq!(s, 200, "{b}");
    let tok = sign_in(&node.base, &Wallet::new(), "bank");
    assert_eq!(tok["role"], "wallet", "{tok}");
    let t = access(&tok);
    assert!(grants_of(&node.base, &t).is_empty());
    for (method, path) in [
        ("GET", "/v1/kv/vault"),
        ("PUT", "/v1/kv/vault"),
        ("POST", "/v1/functions/payout/invoke"),
        ("GET", "/v1/auth/api-keys"),
    ] {
        let (s, b) = node.with_key(&t, method, path, Some(b"x"));
        assert_eq!(
            (s, code_of(&b).as_str()),
            (403, "MISSING_GRANT"),
            "{method} {path}: {b}"
        );
    }
    let (s, b) = node.with_key(&owner, "GET", "/v1/kv/vault", None);
    assert_eq!((s, b.as_str()), (200, "gold"));
}

/// An allowed wallet gets exactly its role's grants, `{sub}` replaced by its
/// address: whoami lists them; it reads its own corner of the KV and not
/// another wallet's nor `vault`; it cannot write; over the socket it
/// subscribes to its own `user.<addr>.*` topic and gets what is published
/// there, and another wallet's topic is refused (on `/v1/pubsub/ws` and on
/// `/v1/ws`, where publishing and invoking are refused too). The role's
/// name is in the answer and in the token's `role` claim.
#[actix_rt::test]
async fn an_allowed_wallet_gets_exactly_the_roles_grants() {
    use futures_util::StreamExt as _;
    let node = TestNode::start();
    let owner = node.create_namespace("bank");
    let (me, other) = (Wallet::new(), Wallet::new());
    for (k, v) in [
        (format!("users/{}/profile", me.addr), "mine"),
        (format!("users/{}/profile", other.addr), "theirs"),
        ("vault".to_string(), "gold"),
    ] {
        let (s, b) = node.with_key(&owner, "PUT", &format!("/v1/kv/{k}"), Some(v.as_bytes()));
        assert_eq!(s, 200, "{b}");
    }
    let (s, b) = set(
        &node.base,
        &owner,
        "bank",
        &json!({"enabled": true, "role": "member", "allow": "any",
                "grants": ["kv:read:users/{sub}/*", "pubsub:subscribe:user.{sub}.*"]}),
    );
    assert_eq!(s, 200, "{b}");
    let tok = sign_in(&node.base, &me, "bank");
    assert_eq!(tok["role"], "member", "{tok}");
    let t = access(&tok);
    use base64::Engine as _;
    let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(t.split('.').nth(1).unwrap())
        .unwrap();
    let claims: Value = serde_json::from_slice(&payload).unwrap();
    assert_eq!(claims["role"], "member");
    assert_eq!(claims["sub"], format!("wallet:{}", me.addr));
    assert_eq!(
        grants_of(&node.base, &t),
        vec![
            format!("kv:read:users/{}/*", me.addr),
            format!("pubsub:subscribe:user.{}.*", me.addr),
        ]
    );
    let mine = format!("/v1/kv/users/{}/profile", me.addr);
    assert_eq!(
        node.with_key(&t, "GET", &mine, None),
        (200, "mine".to_string())
    );
    for path in [
        format!("/v1/kv/users/{}/profile", other.addr),
        "/v1/kv/vault".to_string(),
    ] {
        let (s, b) = node.with_key(&t, "GET", &path, None);
        assert_eq!(
            (s, code_of(&b).as_str()),
            (403, "MISSING_GRANT"),
            "{path}: {b}"
        );
    }
    let (s, b) = node.with_key(&t, "PUT", &mine, Some(b"changed"));
    assert_eq!((s, code_of(&b).as_str()), (403, "MISSING_GRANT"), "{b}");
    let (s, b) = node.with_key(&t, "POST", "/v1/functions/payout/invoke", Some(b"{}"));
    assert_eq!((s, code_of(&b).as_str()), (403, "MISSING_GRANT"), "{b}");

    // Its own topic over the socket: live, and it receives what is published.
    let own_topic = format!("user.{}.inbox", me.addr);
    let client = awc::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .finish();
    let (resp, mut sock) = client
        .ws(format!(
            "ws://{}/v1/pubsub/ws?topic={own_topic}&token={t}",
            node.addr
        ))
        .connect()
        .await
        .expect("own topic");
    assert_eq!(resp.status(), 101);
    let body = json!({"topic": own_topic, "data_base64": "aGk="}).to_string();
    let (s, b) = node.with_key(&owner, "POST", "/v1/pubsub/publish", Some(body.as_bytes()));
    assert_eq!(s, 200, "{b}");
    let got = loop {
        let frame = tokio::time::timeout(std::time::Duration::from_secs(10), sock.next())
            .await
            .expect("a message on the wallet's own topic")
            .expect("socket open")
            .unwrap();
        if let awc::ws::Frame::Text(b) = frame {
            break serde_json::from_slice::<Value>(&b).unwrap();
        }
    };
    assert_eq!(got["data_base64"], "aGk=", "{got}");
    // Another wallet's topic: refused before any upgrade.
    let theirs = format!("user.{}.inbox", other.addr);
    let (s, _, b) = http(
        "GET",
        &node.url(&format!("/v1/pubsub/ws?topic={theirs}")),
        &[
            ("authorization", &format!("Bearer {t}")),
            ("connection", "upgrade"),
            ("upgrade", "websocket"),
            ("sec-websocket-version", "13"),
            ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ],
        None,
    );
    let b = String::from_utf8_lossy(&b).into_owned();
    assert_eq!((s, code_of(&b).as_str()), (403, "MISSING_GRANT"), "{b}");
    // The full socket: its own topic yes; another's, publishing, invoking no.
    use futures_util::SinkExt as _;
    let (resp, mut full) = client
        .ws(format!("ws://{}/v1/ws?token={t}", node.addr))
        .connect()
        .await
        .expect("/v1/ws");
    assert_eq!(resp.status(), 101);
    for (id, frame, want) in [
        (1, json!({"type": "subscribe", "topic": own_topic}), None),
        (
            2,
            json!({"type": "subscribe", "topic": theirs}),
            Some("MISSING_GRANT"),
        ),
        (
            3,
            json!({"type": "publish", "topic": own_topic, "data_base64": "aGk="}),
            Some("MISSING_GRANT"),
        ),
        (
            4,
            json!({"type": "invoke", "function": "payout", "input_base64": ""}),
            Some("MISSING_GRANT"),
        ),
    ] {
        let mut frame = frame;
        frame["id"] = json!(id);
        full.send(awc::ws::Message::Text(frame.to_string().into()))
            .await
            .unwrap();
        let answer = loop {
            let f = tokio::time::timeout(std::time::Duration::from_secs(10), full.next())
                .await
                .expect("an answer")
                .expect("socket open")
                .unwrap();
            if let awc::ws::Frame::Text(b) = f {
                let v: Value = serde_json::from_slice(&b).unwrap();
                if v["id"] == id {
                    break v;
                }
            }
        };
        match want {
            None => assert_eq!(answer["ok"], true, "{frame}: {answer}"),
            Some(code) => assert_eq!(answer["error"]["code"], code, "{frame}: {answer}"),
        }
    }
}

/// With an allow list only the listed wallets sign in; the setting is read
/// again at verify and at refresh: a wallet taken off the list between its
/// challenge and its verify is refused, as is its refresh; a refresh
/// carries the role's grants as they are now; disabling stops new sign-ins
/// and every refresh.
#[test]
fn the_allow_list_and_disabling_hold_at_verify_and_refresh() {
    let node = TestNode::start();
    let owner = node.create_namespace("bank");
    let (listed, stranger) = (Wallet::new(), Wallet::new());
    let only = |w: &Wallet, grants: &[&str]| json!({"enabled": true, "role": "member", "grants": grants, "allow": [w.addr.to_uppercase()]});
    let (s, b) = set(
        &node.base,
        &owner,
        "bank",
        &only(&listed, &["kv:read:users/{sub}/*"]),
    );
    assert_eq!(s, 200, "{b}");
    assert_eq!(
        json(&b)["wallet_sign_in"]["allow"],
        json!([listed.addr]),
        "stored normalized"
    );
    assert_eq!(
        challenge(&node.base, &stranger, "bank"),
        Err((403, "WALLET_NOT_ALLOWED".into()))
    );
    let tok = sign_in(&node.base, &listed, "bank");
    // The grants change: the refresh carries the new ones.
    let (s, b) = set(
        &node.base,
        &owner,
        "bank",
        &only(&listed, &["kv:read:shared/*"]),
    );
    assert_eq!(s, 200, "{b}");
    let (s, b) = refresh(&node.base, &tok);
    assert_eq!(s, 200, "{b}");
    let tok = json(&b);
    assert_eq!(
        grants_of(&node.base, &access(&tok)),
        vec!["kv:read:shared/*"]
    );
    // A challenge open, then the wallet is taken off the list.
    let open = challenge(&node.base, &listed, "bank").unwrap();
    let (s, b) = set(&node.base, &owner, "bank", &only(&stranger, &[]));
    assert_eq!(s, 200, "{b}");
    let (s, b) = verify(&node.base, &listed, &open);
    assert_eq!(
        (s, code_of(&b).as_str()),
        (403, "WALLET_NOT_ALLOWED"),
        "{b}"
    );
    let (s, b) = refresh(&node.base, &tok);
    assert_eq!(
        (s, code_of(&b).as_str()),
        (403, "WALLET_NOT_ALLOWED"),
        "{b}"
    );
    // Back on the list, signed in again; then sign-in is disabled.
    let (s, _) = set(&node.base, &owner, "bank", &only(&listed, &[]));
    assert_eq!(s, 200);
    let tok = sign_in(&node.base, &listed, "bank");
    let (s, b) = set(&node.base, &owner, "bank", &json!({"enabled": false}));
    assert_eq!(s, 200, "{b}");
    assert_eq!(
        challenge(&node.base, &listed, "bank"),
        Err((403, "WALLET_SIGN_IN_DISABLED".into()))
    );
    let (s, b) = refresh(&node.base, &tok);
    assert_eq!(
        (s, code_of(&b).as_str()),
        (403, "WALLET_SIGN_IN_DISABLED"),
        "{b}"
    );
    assert_eq!(get(&node.base, &owner, "bank")["enabled"], false);
}

/// Only the namespace's own credential holding `namespace:admin` (or the
/// operator) sets it: another namespace's owner key is refused (403, bank
/// unchanged), a bank key without `namespace:admin` too, and a bank key
/// with only `namespace:admin` cannot give wallets KV grants it lacks.
#[test]
fn only_the_namespaces_admin_sets_its_wallet_sign_in() {
    let node = TestNode::start();
    let owner = node.create_namespace("bank");
    let evil = node.create_namespace("evil");
    let open_door = json!({"enabled": true, "grants": ["kv:read:*"], "allow": "any"});
    for method in ["PUT", "GET"] {
        let (s, b) = call(
            &node.base,
            &evil,
            method,
            "/v1/namespaces/bank/wallet-sign-in",
            Some(open_door.to_string().as_bytes()),
        );
        assert_eq!(
            (s, code_of(&b).as_str()),
            (403, "NAMESPACE_MISMATCH"),
            "{method}: {b}"
        );
    }
    let key = |body: Value| {
        let (s, b) = node.with_key(
            &owner,
            "POST",
            "/v1/auth/api-keys",
            Some(body.to_string().as_bytes()),
        );
        assert_eq!(s, 201, "{b}");
        json(&b)["api_key"].as_str().unwrap().to_string()
    };
    let admin = key(json!({"role": "admin"}));
    let (s, b) = set(&node.base, &admin, "bank", &open_door);
    assert_eq!((s, code_of(&b).as_str()), (403, "MISSING_GRANT"), "{b}");
    let settings_only = key(json!({"grants": ["namespace:admin:*"]}));
    let (s, b) = set(&node.base, &settings_only, "bank", &open_door);
    assert_eq!((s, code_of(&b).as_str()), (403, "GRANT_ESCALATION"), "{b}");
    assert_eq!(get(&node.base, &owner, "bank")["enabled"], false);
    assert_eq!(
        challenge(&node.base, &Wallet::new(), "bank"),
        Err((403, "WALLET_SIGN_IN_DISABLED".into()))
    );
    // It may open sign-in with the (empty) default role; the operator may set any.
    let (s, b) = set(
        &node.base,
        &settings_only,
        "bank",
        &json!({"enabled": true, "allow": "any"}),
    );
    assert_eq!(s, 200, "{b}");
    let (s, b) = node.op(
        "PUT",
        "/v1/namespaces/bank/wallet-sign-in",
        Some(&open_door.to_string()),
    );
    assert_eq!(s, 200, "{b}");
    assert_eq!(
        get(&node.base, &owner, "bank")["grants"],
        json!(["kv:read:*"])
    );
}

/// Bad settings are 400 with their code and store nothing: an unknown
/// field, a built-in role name, a bad grant, a grant on the namespace's
/// keys, a bad address, too many addresses, enabled without `allow`, an
/// `allow` word other than `any`. GET still shows the setting before.
#[test]
fn bad_settings_are_refused_and_nothing_is_stored() {
    let node = TestNode::start();
    let owner = node.create_namespace("bank");
    let w = Wallet::new();
    let good = json!({"enabled": true, "role": "member", "grants": ["kv:read:users/{sub}/*"], "allow": [w.addr]});
    let (s, b) = set(&node.base, &owner, "bank", &good);
    assert_eq!(s, 200, "{b}");
    let before = get(&node.base, &owner, "bank");
    let too_many: Vec<String> = (0..1001).map(|i| format!("{i:064x}")).collect();
    for (body, code) in [
        (
            json!({"enabled": true, "allow": "any", "admin": true}),
            "MALFORMED_JSON",
        ),
        (
            json!({"enabled": true, "allow": "any", "role": "runtime"}),
            "INVALID_WALLET_SIGN_IN",
        ),
        (
            json!({"enabled": true, "allow": "any", "role": "owner"}),
            "INVALID_WALLET_SIGN_IN",
        ),
        (
            json!({"enabled": true, "allow": "any", "role": "Bad Name"}),
            "INVALID_WALLET_SIGN_IN",
        ),
        (
            json!({"enabled": true, "allow": "any", "grants": ["kv:read"]}),
            "INVALID_GRANT",
        ),
        (
            json!({"enabled": true, "allow": "any", "grants": ["keys:write:*"]}),
            "INVALID_GRANT",
        ),
        (
            json!({"enabled": true, "allow": "any", "grants": ["kv:read:{user}"]}),
            "INVALID_GRANT",
        ),
        (
            json!({"enabled": true, "allow": ["not-a-wallet"]}),
            "INVALID_WALLET",
        ),
        (
            json!({"enabled": true, "allow": too_many}),
            "INVALID_WALLET_SIGN_IN",
        ),
        (json!({"enabled": true}), "INVALID_WALLET_SIGN_IN"),
        (json!({"enabled": true, "allow": "all"}), "MALFORMED_JSON"),
    ] {
        let (s, b) = set(&node.base, &owner, "bank", &body);
        assert_eq!((s, code_of(&b).as_str()), (400, code), "{body}: {b}");
        assert_eq!(get(&node.base, &owner, "bank"), before, "after {body}");
    }
    // The good setting still works.
    let tok = sign_in(&node.base, &w, "bank");
    assert_eq!(tok["role"], "member");
}

/// The challenge has a bucket per wallet (`wallet_per_minute`/`wallet_burst`,
/// here 1/2), whatever address asks: two challenges for one wallet from
/// two addresses are answered, the third, from a third address, is 429
/// `WALLET_RATE_LIMITED` with `Retry-After`; that address still gets a
/// challenge for another wallet (its own credential bucket is not empty).
#[test]
fn the_challenge_is_rate_limited_per_wallet_from_any_address() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}wallet_per_minute = 1\nwallet_burst = 2\n"),
        ..Default::default()
    });
    let owner = node.create_namespace("bank");
    let (s, b) = set(
        &node.base,
        &owner,
        "bank",
        &json!({"enabled": true, "allow": "any"}),
    );
    assert_eq!(s, 200, "{b}");
    let (flooded, other) = (Wallet::new(), Wallet::new());
    let ask = |from: &str, w: &Wallet| {
        let (s, h, b) = http_from(
            Some(from),
            "POST",
            &node.url("/v1/auth/challenge"),
            &[("content-type", "application/json")],
            Some(
                json!({"wallet": w.addr, "namespace": "bank"})
                    .to_string()
                    .as_bytes(),
            ),
        );
        let b = String::from_utf8_lossy(&b).into_owned();
        (s, header(&h, "retry-after").map(str::to_string), b)
    };
    for from in ["127.0.0.2", "127.0.0.3"] {
        let (s, _, b) = ask(from, &flooded);
        assert_eq!(s, 200, "from {from}: {b}");
        assert!(json(&b)["message"].is_string(), "{b}");
    }
    let (s, after, b) = ask("127.0.0.4", &flooded);
    assert_eq!(
        (s, code_of(&b).as_str()),
        (429, "WALLET_RATE_LIMITED"),
        "{b}"
    );
    assert!(
        after
            .and_then(|a| a.parse::<u64>().ok())
            .is_some_and(|a| a >= 1),
        "429 with Retry-After"
    );
    let (s, _, b) = ask("127.0.0.4", &other);
    assert_eq!(s, 200, "another wallet from the same address: {b}");
}

/// Three nodes on etcd, bank's only member "b": through "a", which is not
/// bank's member, the attack is refused; the owner's setting (sent through
/// "a", kept by "b") lets the listed wallet sign in through "a" and read
/// its own corner there (forwarded to "b" with exactly its grants), and
/// not `vault`; an unlisted wallet is refused; disabled through "c", the
/// wallet's refresh through "a" is refused at once.
#[cfg(feature = "cluster")]
#[test]
fn wallet_sign_in_across_three_nodes_on_etcd() {
    let etcd = crate::etcd_process::EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let nodes: Vec<TestNode> = ["a", "b", "c"]
        .iter()
        .map(|id| {
            TestNode::start_with(crate::cluster::member_opts(
                &etcd,
                id,
                free_port(),
                tmp.path(),
            ))
        })
        .collect();
    let (a, c) = (&nodes[0], &nodes[2]);
    let (s, b) = a.op(
        "POST",
        "/v1/namespaces",
        Some(r#"{"name":"bank","members":["b"]}"#),
    );
    assert_eq!(s, 201, "{b}");
    let owner = json(&b)["api_key"].as_str().unwrap().to_string();
    let (listed, attacker) = (Wallet::new(), Wallet::new());
    let vault = call(&a.base, &owner, "PUT", "/v1/kv/vault", Some(b"gold"));
    assert_eq!(vault.0, 200, "{}", vault.1);
    let own = format!("/v1/kv/users/{}/profile", listed.addr);
    assert_eq!(call(&a.base, &owner, "PUT", &own, Some(b"mine")).0, 200);

    // The attack, through a node that is not bank's member.
    assert_eq!(
        challenge(&a.base, &attacker, "bank"),
        Err((403, "WALLET_SIGN_IN_DISABLED".into()))
    );
    let (s, b) = set(
        &a.base,
        &owner,
        "bank",
        &json!({"enabled": true, "role": "member", "grants": ["kv:read:users/{sub}/*"],
                "allow": [listed.addr]}),
    );
    assert_eq!(s, 200, "{b}");
    assert_eq!(get(&c.base, &owner, "bank")["role"], "member");
    assert_eq!(
        challenge(&a.base, &attacker, "bank"),
        Err((403, "WALLET_NOT_ALLOWED".into()))
    );
    let tok = sign_in(&a.base, &listed, "bank");
    let t = access(&tok);
    let auth = format!("Bearer {t}");
    let (s, h, body) = http("GET", &a.url(&own), &[("authorization", &auth)], None);
    assert_eq!(
        (s, header(&h, "x-meshgate-member"), body.as_slice()),
        (200, Some("b"), &b"mine"[..])
    );
    let (s, b) = call(&a.base, &t, "GET", "/v1/kv/vault", None);
    assert_eq!((s, code_of(&b).as_str()), (403, "MISSING_GRANT"), "{b}");
    assert_eq!(
        grants_of(&a.base, &t),
        vec![format!("kv:read:users/{}/*", listed.addr)]
    );
    // Disabled through c: a's next refresh of the wallet's session is refused.
    let (s, b) = set(&c.base, &owner, "bank", &json!({"enabled": false}));
    assert_eq!(s, 200, "{b}");
    let (s, b) = refresh(&a.base, &tok);
    assert_eq!(
        (s, code_of(&b).as_str()),
        (403, "WALLET_SIGN_IN_DISABLED"),
        "{b}"
    );
    assert_eq!(
        challenge(&a.base, &listed, "bank"),
        Err((403, "WALLET_SIGN_IN_DISABLED".into()))
    );
}
