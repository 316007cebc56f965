//! Sessions bound to a device (docs/security.md, "Sessions"): every sign-in
//! opens a session (`sid`, kept across refreshes) and may name its device
//! (`did`); a subject lists its sessions and ends one, or all of one
//! device's. An ended session's refresh is refused at once on every node;
//! its access tokens on the node that ended it at once, on the others
//! within the revocation poll (2 s; the tests allow 15 s). The same test
//! runs on three nodes on etcd with `MESHGATE_TEST_CLUSTER=1`.

use crate::common::*;
use ring::signature::{Ed25519KeyPair, KeyPair};
use serde_json::{Value, json};
use std::time::Duration;

/// Longer than the documented bound (`REVOCATION_POLL`, 2 s, plus a store
/// read): the machine is shared and slow at times.
const BOUND: Duration = Duration::from_secs(15);

fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    let (s, _, b) = http(
        "POST",
        &format!("{base}{path}"),
        &[("content-type", "application/json")],
        Some(body.to_string().as_bytes()),
    );
    (s, json(&String::from_utf8_lossy(&b)))
}

fn call(base: &str, token: &str, method: &str, path: &str) -> (u16, Value) {
    let auth = format!("Bearer {token}");
    let (s, _, b) = http(
        method,
        &format!("{base}{path}"),
        &[("authorization", &auth)],
        None,
    );
    let b = String::from_utf8_lossy(&b).into_owned();
    (s, serde_json::from_str(&b).unwrap_or(Value::String(b)))
}

fn code(v: &Value) -> String {
    v["error"]["code"].as_str().unwrap_or("").to_string()
}

/// A token pair for `api_key` signed in from `device`.
fn token(base: &str, api_key: &str, device: Option<&str>) -> Value {
    let mut body = json!({"api_key": api_key});
    if let Some(d) = device {
        body["device_id"] = json!(d);
    }
    let (s, v) = post(base, "/v1/auth/token", &body);
    assert_eq!(s, 200, "token: {v}");
    v
}

fn sids(base: &str, token: &str) -> Vec<String> {
    let (s, v) = call(base, token, "GET", "/v1/auth/sessions");
    assert_eq!(s, 200, "list: {v}");
    let mut out: Vec<String> = v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["sid"].as_str().unwrap().to_string())
        .collect();
    out.sort();
    out
}

/// Two devices of one subject (the same API key) sign in; the list shows
/// both; ending the phone's session refuses its refresh at once on every
/// node and its access token at once on the node that ended it and within
/// the bound on every other; the laptop's token and refresh keep working;
/// the list shows the laptop's alone. A refresh keeps the sid and device.
#[test]
fn ending_one_device_leaves_the_other() {
    let node = TestNode::start();
    let key = node.create_namespace("sess");
    let a = node.base.clone();
    let phone = token(&a, &key, Some("phone-1"));
    let laptop = token(&a, &key, Some("laptop:work.2"));
    let (p_sid, l_sid) = (
        phone["session_id"].as_str().unwrap().to_string(),
        laptop["session_id"].as_str().unwrap().to_string(),
    );
    assert_ne!(p_sid, l_sid);
    assert_eq!(phone["device_id"], "phone-1");
    let p_tok = phone["access_token"].as_str().unwrap().to_string();
    let l_tok = laptop["access_token"].as_str().unwrap().to_string();

    // The token carries its session and device (whoami reads the claims,
    // or in cluster mode the hop that carried them to the member).
    for base in node.every_base() {
        let (s, v) = call(&base, &p_tok, "GET", "/v1/auth/whoami");
        assert_eq!(s, 200, "{base}: {v}");
        assert_eq!(
            (v["session_id"].as_str(), v["device_id"].as_str()),
            (Some(p_sid.as_str()), Some("phone-1")),
            "{base}: {v}"
        );
    }

    // A refresh keeps the session and its device; the list notes it.
    let (s, r) = post(
        &a,
        "/v1/auth/refresh",
        &json!({"refresh_token": laptop["refresh_token"]}),
    );
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["session_id"].as_str(), Some(l_sid.as_str()));
    assert_eq!(r["device_id"], "laptop:work.2");
    let l_tok2 = r["access_token"].as_str().unwrap().to_string();
    let l_refresh = r["refresh_token"].as_str().unwrap().to_string();
    let mut both = vec![p_sid.clone(), l_sid.clone()];
    both.sort();
    assert_eq!(sids(&a, &p_tok), both);
    let (_, v) = call(&a, &l_tok2, "GET", "/v1/auth/sessions");
    let l_row = v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["sid"] == l_sid.as_str())
        .unwrap()
        .clone();
    assert!(l_row["last_refresh_at"].is_u64(), "{v}");
    assert_eq!(l_row["current"], true);
    assert_eq!(l_row["device_id"], "laptop:work.2");

    // The phone's session is ended from the laptop.
    let (s, v) = call(&a, &l_tok2, "DELETE", &format!("/v1/auth/sessions/{p_sid}"));
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["ended"], json!([p_sid]));

    // Its refresh: refused at once, on every node.
    for base in node.every_base() {
        let (s, v) = post(
            &base,
            "/v1/auth/refresh",
            &json!({"refresh_token": phone["refresh_token"]}),
        );
        assert_eq!(
            (s, code(&v).as_str()),
            (401, "REFRESH_TOKEN_REVOKED"),
            "{base}: {v}"
        );
    }
    // Its access token: at once where it was ended.
    let (s, v) = call(&a, &p_tok, "GET", "/v1/auth/whoami");
    assert_eq!((s, code(&v).as_str()), (401, "SESSION_REVOKED"), "{v}");
    // Within the bound on every other node.
    for base in node.every_base() {
        wait_until(
            BOUND,
            &format!("the ended session's token refused on {base}"),
            || {
                let (s, v) = call(&base, &p_tok, "GET", "/v1/auth/whoami");
                s == 401 && code(&v) == "SESSION_REVOKED"
            },
        );
    }
    // The laptop is unaffected, everywhere: both of its tokens, its refresh.
    for base in node.every_base() {
        for t in [&l_tok, &l_tok2] {
            let (s, v) = call(&base, t, "GET", "/v1/auth/whoami");
            assert_eq!(s, 200, "{base}: {v}");
        }
    }
    let (s, r) = post(&a, "/v1/auth/refresh", &json!({"refresh_token": l_refresh}));
    assert_eq!(s, 200, "{r}");
    assert_eq!(sids(&a, &l_tok2), vec![l_sid.clone()]);
    // Ending it again: no such session.
    let (s, v) = call(&a, &l_tok2, "DELETE", &format!("/v1/auth/sessions/{p_sid}"));
    assert_eq!((s, code(&v).as_str()), (404, "SESSION_NOT_FOUND"), "{v}");
}

/// `DELETE /v1/auth/sessions?device_id=` ends every session of that device
/// (two sign-ins from the tablet), not the other device's.
#[test]
fn ending_a_device_ends_its_sessions() {
    let node = TestNode::start();
    let key = node.create_namespace("sessdev");
    let a = node.base.clone();
    let t1 = token(&a, &key, Some("tablet"));
    let t2 = token(&a, &key, Some("tablet"));
    let other = token(&a, &key, Some("desk"));
    let o_tok = other["access_token"].as_str().unwrap().to_string();
    let (s, v) = call(&a, &o_tok, "DELETE", "/v1/auth/sessions?device_id=tablet");
    assert_eq!(s, 200, "{v}");
    let mut ended: Vec<String> = v["ended"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    ended.sort();
    let mut want = vec![
        t1["session_id"].as_str().unwrap().to_string(),
        t2["session_id"].as_str().unwrap().to_string(),
    ];
    want.sort();
    assert_eq!(ended, want);
    for t in [&t1, &t2] {
        let (s, v) = post(
            &a,
            "/v1/auth/refresh",
            &json!({"refresh_token": t["refresh_token"]}),
        );
        assert_eq!(
            (s, code(&v).as_str()),
            (401, "REFRESH_TOKEN_REVOKED"),
            "{v}"
        );
        let (s, v) = call(
            &a,
            t["access_token"].as_str().unwrap(),
            "GET",
            "/v1/auth/whoami",
        );
        assert_eq!((s, code(&v).as_str()), (401, "SESSION_REVOKED"), "{v}");
    }
    assert_eq!(
        sids(&a, &o_tok),
        vec![other["session_id"].as_str().unwrap().to_string()]
    );
    let (s, v) = call(&a, &o_tok, "GET", "/v1/auth/whoami");
    assert_eq!(s, 200, "{v}");
}

/// Bad input, each with the envelope, and nothing changed: a device id
/// with a space or of 200 characters (token exchange and the device end),
/// none at all on the device end, a sid that does not exist, another
/// subject's session (404 as for none: a sid does not leak), a bad limit.
/// The listing pages with `limit` and `cursor`.
#[test]
fn bad_session_input() {
    let node = TestNode::start();
    let key = node.create_namespace("sessbad");
    let a = node.base.clone();
    let long = "d".repeat(200);
    for bad in ["my phone", long.as_str(), ""] {
        let (s, v) = post(
            &a,
            "/v1/auth/token",
            &json!({"api_key": key, "device_id": bad}),
        );
        assert_eq!(
            (s, code(&v).as_str()),
            (400, "INVALID_DEVICE_ID"),
            "{bad:?}: {v}"
        );
        assert_eq!(v["ok"], false);
    }
    let mine = token(&a, &key, Some("phone"));
    let m_tok = mine["access_token"].as_str().unwrap().to_string();
    assert_eq!(
        sids(&a, &m_tok).len(),
        1,
        "a refused sign-in opened no session"
    );
    for q in ["?device_id=my%20phone", &format!("?device_id={long}")] {
        let (s, v) = call(&a, &m_tok, "DELETE", &format!("/v1/auth/sessions{q}"));
        assert_eq!(
            (s, code(&v).as_str()),
            (400, "INVALID_DEVICE_ID"),
            "{q}: {v}"
        );
    }
    let (s, v) = call(&a, &m_tok, "DELETE", "/v1/auth/sessions");
    assert_eq!((s, code(&v).as_str()), (400, "BAD_REQUEST"), "{v}");
    for sid in ["s_00000000000000000000000000000000", "nope", "s_%2E%2E"] {
        let (s, v) = call(&a, &m_tok, "DELETE", &format!("/v1/auth/sessions/{sid}"));
        assert_eq!(
            (s, code(&v).as_str()),
            (404, "SESSION_NOT_FOUND"),
            "{sid}: {v}"
        );
    }
    // Another subject: a second key of the same namespace, and a key of
    // another namespace. Neither sees nor ends this session.
    let (s, b) = node.with_key(
        &key,
        "POST",
        "/v1/auth/api-keys",
        Some(br#"{"role":"reader"}"#),
    );
    assert_eq!(s, 201, "{b}");
    let reader = json(&b)["api_key"].as_str().unwrap().to_string();
    let other_ns = node.create_namespace("sessother");
    let m_sid = mine["session_id"].as_str().unwrap().to_string();
    for k in [&reader, &other_ns] {
        let t = token(&a, k, None);
        let t = t["access_token"].as_str().unwrap();
        assert!(!sids(&a, t).contains(&m_sid));
        let (s, v) = call(&a, t, "DELETE", &format!("/v1/auth/sessions/{m_sid}"));
        assert_eq!((s, code(&v).as_str()), (404, "SESSION_NOT_FOUND"), "{v}");
        let (s, v) = call(&a, t, "DELETE", "/v1/auth/sessions?device_id=phone");
        assert_eq!((s, v["ended"].clone()), (200, json!([])), "{v}");
    }
    let (s, v) = call(&a, &m_tok, "GET", "/v1/auth/whoami");
    assert_eq!(s, 200, "still signed in: {v}");
    // Paging: two more sessions, pages of one.
    token(&a, &key, None);
    token(&a, &key, Some("x"));
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let q = match &cursor {
            Some(c) => format!("/v1/auth/sessions?limit=1&cursor={c}"),
            None => "/v1/auth/sessions?limit=1".into(),
        };
        let (s, v) = call(&a, &m_tok, "GET", &q);
        assert_eq!(s, 200, "{v}");
        let page = v["sessions"].as_array().unwrap();
        assert!(page.len() <= 1);
        seen.extend(page.iter().map(|s| s["sid"].as_str().unwrap().to_string()));
        match v["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!((seen.len(), sorted.len()), (3, 3), "{seen:?}");
    let (s, v) = call(&a, &m_tok, "GET", "/v1/auth/sessions?limit=0");
    assert_eq!((s, code(&v).as_str()), (400, "INVALID_LIMIT"), "{v}");
}

/// An Ed25519 wallet.
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
}

fn challenge_from(base: &str, from: &str, body: &Value) -> (u16, Value) {
    let (s, _, b) = http_from(
        Some(from),
        "POST",
        &format!("{base}/v1/auth/challenge"),
        &[("content-type", "application/json")],
        Some(body.to_string().as_bytes()),
    );
    (s, json(&String::from_utf8_lossy(&b)))
}

fn enable_wallets(node: &TestNode, key: &str, ns: &str) {
    let (s, b) = node.with_key(
        key,
        "PUT",
        &format!("/v1/namespaces/{ns}/wallet-sign-in"),
        Some(
            json!({"enabled": true, "allow": "any"})
                .to_string()
                .as_bytes(),
        ),
    );
    assert_eq!(s, 200, "{b}");
}

/// A wallet sign-in takes a device id too (checked before the nonce is
/// spent: a bad one costs no challenge), and its token is bound to it.
#[test]
fn wallet_sign_in_binds_a_device() {
    let node = TestNode::start();
    let key = node.create_namespace("sesswallet");
    enable_wallets(&node, &key, "sesswallet");
    let a = node.base.clone();
    let w = Wallet::new();
    let (s, v) = challenge_from(
        &a,
        "127.0.0.1",
        &json!({"wallet": w.addr, "namespace": "sesswallet"}),
    );
    assert_eq!(s, 200, "{v}");
    let message = v["message"].as_str().unwrap().to_string();
    let signature = hex::encode(w.pair.sign(message.as_bytes()).as_ref());
    let (s, v) = post(
        &a,
        "/v1/auth/verify",
        &json!({"message": message, "signature": signature, "device_id": "a b"}),
    );
    assert_eq!((s, code(&v).as_str()), (400, "INVALID_DEVICE_ID"), "{v}");
    let (s, v) = post(
        &a,
        "/v1/auth/verify",
        &json!({"message": message, "signature": signature, "device_id": "hw-wallet"}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["device_id"], "hw-wallet");
    let t = v["access_token"].as_str().unwrap();
    let (s, who) = call(&a, t, "GET", "/v1/auth/whoami");
    assert_eq!(s, 200, "{who}");
    assert_eq!(who["device_id"], "hw-wallet");
    assert_eq!(who["session_id"], v["session_id"]);
    let (s, l) = call(&a, t, "GET", "/v1/auth/sessions");
    assert_eq!(s, 200, "{l}");
    assert_eq!(l["subject"], format!("wallet:{}", w.addr));
    assert_eq!(l["sessions"][0]["device_id"], "hw-wallet");
}

/// The open-challenge cap (10) is kept per wallet and client network: a
/// client (127.0.0.2) that opens 10 challenges for someone else's wallet
/// (Ed25519, and an EVM address) fills its own cap only; the owner, from
/// another address (127.0.0.3), still gets a challenge and signs in.
#[test]
fn another_client_cannot_fill_a_wallets_challenge_cap() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}wallet_per_minute = 1000\nwallet_burst = 1000\n"),
        ..Default::default()
    });
    let key = node.create_namespace("sesscap");
    enable_wallets(&node, &key, "sesscap");
    let a = node.base.clone();
    let victim = Wallet::new();
    let ed = json!({"wallet": victim.addr, "namespace": "sesscap"});
    let evm = json!({"chain": "evm", "address": "0x52908400098527886e0f7030069857d2e4169ee7", "chain_id": 1, "namespace": "sesscap"});
    for body in [&ed, &evm] {
        for i in 0..10 {
            let (s, v) = challenge_from(&a, "127.0.0.2", body);
            assert_eq!(s, 200, "attacker's challenge {i}: {v}");
        }
        let (s, v) = challenge_from(&a, "127.0.0.2", body);
        assert_eq!((s, code(&v).as_str()), (429, "TOO_MANY_CHALLENGES"), "{v}");
        let (s, v) = challenge_from(&a, "127.0.0.3", body);
        assert_eq!(s, 200, "the wallet's owner still gets a challenge: {v}");
    }
    let (_, v) = challenge_from(&a, "127.0.0.3", &ed);
    let message = v["message"].as_str().unwrap().to_string();
    let signature = hex::encode(victim.pair.sign(message.as_bytes()).as_ref());
    let (s, v) = post(
        &a,
        "/v1/auth/verify",
        &json!({"message": message, "signature": signature}),
    );
    assert_eq!(s, 200, "{v}");
}

/// The challenge does not tell whether a namespace exists: one that does
/// not answers exactly as one whose wallet sign-in is off (403
/// `WALLET_SIGN_IN_DISABLED`, the same message), for both kinds of wallet.
#[test]
fn the_challenge_does_not_reveal_namespaces() {
    let node = TestNode::start();
    node.create_namespace("sessoff");
    let a = node.base.clone();
    let w = Wallet::new();
    for kind in [
        json!({"wallet": w.addr}),
        json!({"chain": "evm", "address": "0x52908400098527886e0f7030069857d2e4169ee7", "chain_id": 1}),
    ] {
        let mut answers = Vec::new();
        for ns in ["sessoff", "no-such-namespace"] {
            let mut body = kind.clone();
            body["namespace"] = json!(ns);
            let (s, v) = challenge_from(&a, "127.0.0.1", &body);
            answers.push((s, v["error"].clone()));
        }
        assert_eq!(answers[0].0, 403, "{answers:?}");
        assert_eq!(answers[0].1["code"], "WALLET_SIGN_IN_DISABLED");
        assert_eq!(answers[0], answers[1]);
    }
}

/// `meshgate sessions` lists the key's own sessions, `--device` ends a
/// device's, `--end` one; the ended tokens are refused.
#[test]
fn the_cli_lists_and_ends_sessions() {
    let node = TestNode::start();
    let key = node.create_namespace("sesscli");
    let a = node.base.clone();
    let one = token(&a, &key, Some("cli-phone"));
    let two = token(&a, &key, Some("cli-laptop"));
    let listed = json(&crate::cli::cli(&a, &["sessions", "--key", &key]));
    let mut got: Vec<&str> = listed["sessions"]
        .as_array()
        .unwrap_or_else(|| panic!("{listed}"))
        .iter()
        .map(|s| s["device_id"].as_str().unwrap())
        .collect();
    got.sort();
    assert_eq!(got, ["cli-laptop", "cli-phone"]);
    let ended = json(&crate::cli::cli(
        &a,
        &["sessions", "--key", &key, "--device", "cli-phone"],
    ));
    assert_eq!(ended["ended"], json!([one["session_id"]]), "{ended}");
    let sid = two["session_id"].as_str().unwrap();
    let ended = json(&crate::cli::cli(
        &a,
        &["sessions", "--key", &key, "--end", sid],
    ));
    assert_eq!(ended["ended"], json!([sid]), "{ended}");
    for t in [&one, &two] {
        let (s, v) = call(
            &a,
            t["access_token"].as_str().unwrap(),
            "GET",
            "/v1/auth/whoami",
        );
        assert_eq!((s, code(&v).as_str()), (401, "SESSION_REVOKED"), "{v}");
    }
    let listed = json(&crate::cli::cli(&a, &["sessions", "--key", &key]));
    assert_eq!(listed["sessions"], json!([]), "{listed}");
}

/// A socket opened with a session's token ends with it (close 4001): one
/// that sends nothing within the check period, one that sends a frame at
/// that frame; a socket of the subject's other device stays open and keeps
/// receiving.
#[actix_rt::test]
async fn open_sockets_end_with_their_session() {
    use crate::pubsub::{close_code, connect, next_json, send_json, ws_url};
    let node = TestNode::start();
    let key = node.create_namespace("sessws");
    let a = node.base.clone();
    let phone = token(&a, &key, Some("phone"));
    let laptop = token(&a, &key, Some("laptop"));
    let p_tok = phone["access_token"].as_str().unwrap().to_string();
    let l_tok = laptop["access_token"].as_str().unwrap().to_string();
    let mut quiet = connect(&ws_url(&node, "/v1/ws", &p_tok)).await;
    let mut talker = connect(&ws_url(&node, "/v1/ws", &p_tok)).await;
    let mut other = connect(&ws_url(&node, "/v1/ws", &l_tok)).await;
    for s in [&mut quiet, &mut talker, &mut other] {
        send_json(s, json!({"id": 1, "type": "subscribe", "topic": "news"})).await;
        assert_eq!(next_json(s).await["ok"], true);
    }
    let sid = phone["session_id"].as_str().unwrap();
    let (s, v) = call(&a, &p_tok, "DELETE", &format!("/v1/auth/sessions/{sid}"));
    assert_eq!(s, 200, "{v}");
    // A frame after the end: the socket closes instead of answering it.
    send_json(
        &mut talker,
        json!({"id": 2, "type": "subscribe", "topic": "more"}),
    )
    .await;
    assert_eq!(close_code(&mut talker).await, 4001);
    // A socket that sends nothing: closed within the check period.
    let t = std::time::Instant::now();
    assert_eq!(close_code(&mut quiet).await, 4001);
    assert!(t.elapsed() < BOUND, "closed after {:?}", t.elapsed());
    // The laptop's socket is open and still receives.
    send_json(
        &mut other,
        json!({"id": 2, "type": "publish", "topic": "news", "data_base64": "c3RpbGwgaGVyZQ=="}),
    )
    .await;
    let mut got = Vec::new();
    for _ in 0..2 {
        got.push(next_json(&mut other).await);
    }
    assert!(
        got.iter().any(|f| f["data_base64"] == "c3RpbGwgaGVyZQ=="),
        "{got:?}"
    );
}

/// A socket outlives no token: opened with a 2 s token, it is closed (4001)
/// once the token is past its expiry and the clock-skew leeway (60 s).
#[actix_rt::test]
async fn open_sockets_end_when_their_token_expires() {
    use crate::pubsub::{connect, next_json, send_json, ws_url};
    let node = TestNode::start_with(NodeOpts {
        config: format!("{TEST_CONFIG}[auth]\naccess_token_seconds = 2\n"),
        ..Default::default()
    });
    let key = node.create_namespace("sessexp");
    let tok = token(&node.base, &key, None)["access_token"]
        .as_str()
        .unwrap()
        .to_string();
    let mut s = connect(&ws_url(&node, "/v1/ws", &tok)).await;
    send_json(&mut s, json!({"id": 1, "type": "subscribe", "topic": "t"})).await;
    assert_eq!(next_json(&mut s).await["ok"], true);
    let t = std::time::Instant::now();
    // Pings come first (answered, so the socket is not idle): wait for the close.
    let code = loop {
        use futures_util::{SinkExt as _, StreamExt as _};
        let f = tokio::time::timeout(Duration::from_secs(120), s.next())
            .await
            .expect("closed within 120 s");
        match f {
            Some(Ok(awc::ws::Frame::Close(r))) => {
                break r.map(|r| u16::from(r.code)).unwrap_or(1005);
            }
            Some(Ok(awc::ws::Frame::Ping(p))) => {
                let _ = s.send(awc::ws::Message::Pong(p)).await;
            }
            Some(Ok(_)) => {}
            other => panic!("no close frame: {other:?}"),
        }
    };
    assert_eq!(code, 4001);
    assert!(
        t.elapsed() >= Duration::from_secs(50),
        "closed early: {:?}",
        t.elapsed()
    );
}

/// One subject holds at most 100 sessions in a namespace: the 101st sign-in
/// ends the oldest (its refresh refused, its sid off the list), the newest
/// hundred stay.
#[test]
fn a_subject_holds_at_most_a_hundred_sessions() {
    let node = TestNode::start();
    let key = node.create_namespace("sesscap");
    let a = node.base.clone();
    let first = token(&a, &key, Some("old"));
    // Sessions are ordered by their second of sign-in: the first is older.
    std::thread::sleep(Duration::from_millis(1100));
    let mut last = first.clone();
    for _ in 0..100 {
        last = token(&a, &key, Some("new"));
    }
    let tok = last["access_token"].as_str().unwrap();
    let (s, v) = call(&a, tok, "GET", "/v1/auth/sessions?limit=1000");
    assert_eq!(s, 200, "{v}");
    let listed = v["sessions"].as_array().unwrap();
    assert_eq!(listed.len(), 100, "{v}");
    let first_sid = first["session_id"].as_str().unwrap();
    assert!(
        listed.iter().all(|r| r["sid"] != first_sid),
        "the oldest session is still listed"
    );
    let (s, r) = post(
        &a,
        "/v1/auth/refresh",
        &json!({"refresh_token": first["refresh_token"]}),
    );
    assert_eq!(s, 401, "{r}");
    let (s, r) = post(
        &a,
        "/v1/auth/refresh",
        &json!({"refresh_token": last["refresh_token"]}),
    );
    assert_eq!(s, 200, "{r}");
}
