//! Sign-In with Ethereum (EIP-4361) end to end, with signatures made by an
//! independent implementation: eth-account (Python), driven through
//! `eth_sign.py` beside this file. scripts/test.sh installs eth-account when
//! it is missing; without it these tests fail naming that step.
//!
//! The node builds the message, keeps it, and at verify checks it is the
//! one issued, byte for byte, unspent, unexpired, for its domain and chain,
//! signed (EIP-191, keccak-256, secp256k1 recovery) by its address. Each
//! way of getting that wrong has its own code; none signs in.

use crate::common::*;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// The domain the test nodes put in their messages.
const DOMAIN: &str = "gate.test";

/// eth-account in a Python process of its own, one request per line.
struct Signer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Signer {
    fn start() -> Signer {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/security/eth_sign.py");
        let mut child = Command::new("python3")
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 is missing: scripts/test.sh installs it (apt-get install python3)");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Signer {
            child,
            stdin,
            stdout,
        }
    }

    fn ask(&mut self, req: Value) -> Value {
        writeln!(self.stdin, "{req}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        if line.is_empty() {
            let status = self.child.wait().unwrap();
            panic!(
                "the eth-account signer exited ({status}): eth-account is missing? \
                 scripts/test.sh installs it (python3 -m pip install eth-account)"
            );
        }
        json(&line)
    }
}

impl Drop for Signer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An Ethereum account: a random private key, and its EIP-55 address as
/// eth-account derives it.
struct Account {
    key: String,
    address: String,
}

impl Account {
    fn new(signer: &mut Signer) -> Account {
        let mut k = [0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut k).unwrap();
        let key = format!("0x{}", hex::encode(k));
        let address = signer.ask(json!({"key": key}))["address"]
            .as_str()
            .unwrap()
            .to_string();
        Account { key, address }
    }

    /// `personal_sign` of `message` by eth-account: 65 bytes hex, v 27/28.
    fn sign(&self, signer: &mut Signer, message: &str) -> String {
        let a = signer.ask(json!({"key": self.key, "message": message}));
        assert_eq!(a["address"], self.address.as_str());
        a["signature"].as_str().unwrap().to_string()
    }

    fn lower(&self) -> String {
        self.address.to_ascii_lowercase()
    }
}

fn config(extra: &str) -> NodeOpts {
    NodeOpts {
        config: format!("{TEST_CONFIG}[server]\nbase_domain = \"{DOMAIN}\"\n{extra}"),
        ..Default::default()
    }
}

fn post(node: &TestNode, path: &str, body: &Value) -> (u16, Value) {
    let (s, _, b) = http(
        "POST",
        &node.url(path),
        &[("content-type", "application/json")],
        Some(body.to_string().as_bytes()),
    );
    (s, json(&String::from_utf8_lossy(&b)))
}

fn call(
    node: &TestNode,
    key: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> (u16, String) {
    let auth = format!("Bearer {key}");
    let (s, _, b) = http(
        method,
        &node.url(path),
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
        body,
    );
    (s, String::from_utf8_lossy(&b).into_owned())
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or_default()
}

/// Sets `ns`'s wallet sign-in with its owner key.
fn set_policy(node: &TestNode, owner: &str, ns: &str, body: Value) {
    let (s, b) = call(
        node,
        owner,
        "PUT",
        &format!("/v1/namespaces/{ns}/wallet-sign-in"),
        Some(body.to_string().as_bytes()),
    );
    assert_eq!(s, 200, "{b}");
}

/// A node with namespace `bank` letting any wallet sign in as `member`,
/// reading its own corner of the KV.
fn bank(extra: &str) -> (TestNode, String) {
    let node = TestNode::start_with(config(extra));
    let owner = node.create_namespace("bank");
    set_policy(
        &node,
        &owner,
        "bank",
        json!({"enabled": true, "role": "member", "grants": ["kv:read:users/{sub}/*"], "allow": "any"}),
    );
    (node, owner)
}

/// The EVM challenge for `address` on `chain_id`: its answer, or the refusal.
fn challenge(node: &TestNode, address: &str, chain_id: u64, ns: &str) -> (u16, Value) {
    post(
        node,
        "/v1/auth/challenge",
        &json!({"chain": "evm", "address": address, "chain_id": chain_id, "namespace": ns}),
    )
}

fn message_of(node: &TestNode, a: &Account, ns: &str) -> String {
    let (s, v) = challenge(node, &a.address, 1, ns);
    assert_eq!(s, 200, "{v}");
    v["message"].as_str().unwrap().to_string()
}

fn verify(node: &TestNode, message: &str, signature: &str) -> (u16, Value) {
    post(
        node,
        "/v1/auth/verify",
        &json!({"message": message, "signature": signature}),
    )
}

/// A good eth-account signature of the node's message signs in: the
/// message is EIP-4361 (the node's domain, the checksummed address, URI,
/// Version 1, Chain ID, a nonce of 8+ alphanumerics, Issued At, an
/// Expiration Time within the challenge TTL, the namespace as a resource);
/// the token's subject is `wallet:<address>` with the role's grants, which
/// read the wallet's own KV corner and not another's. Asked with the
/// address in lower case and signed with v as 0/1, it signs in too.
#[test]
fn an_eth_account_signature_signs_in() {
    let (node, owner) = bank("");
    let mut signer = Signer::start();
    let a = Account::new(&mut signer);
    let own = format!("/v1/kv/users/{}/profile", a.lower());
    assert_eq!(call(&node, &owner, "PUT", &own, Some(b"mine")).0, 200);
    assert_eq!(
        call(&node, &owner, "PUT", "/v1/kv/vault", Some(b"gold")).0,
        200
    );

    let (s, ch) = challenge(&node, &a.address, 10, "bank");
    assert_eq!(s, 200, "{ch}");
    assert_eq!(ch["address"], a.address.as_str());
    let message = ch["message"].as_str().unwrap().to_string();
    let lines: Vec<&str> = message.split('\n').collect();
    assert_eq!(
        lines[0],
        format!("{DOMAIN} wants you to sign in with your Ethereum account:")
    );
    assert_eq!(lines[1], a.address);
    let field = |name: &str| -> String {
        lines
            .iter()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .unwrap_or_else(|| panic!("{name} in {message}"))
            .to_string()
    };
    assert!(field("URI").contains("://"), "{message}");
    assert_eq!(field("Version"), "1");
    assert_eq!(field("Chain ID"), "10");
    let nonce = field("Nonce");
    assert!(nonce.len() >= 8 && nonce.bytes().all(|b| b.is_ascii_alphanumeric()));
    let issued = chrono::DateTime::parse_from_rfc3339(&field("Issued At")).unwrap();
    let expires = chrono::DateTime::parse_from_rfc3339(&field("Expiration Time")).unwrap();
    let ttl = (expires - issued).num_seconds();
    assert!(ttl > 0 && ttl <= 300, "{ttl}");
    assert!((issued.timestamp() - chrono::Utc::now().timestamp()).abs() < 120);
    assert!(message.ends_with("\nResources:\n- urn:meshgate:namespace:bank"));

    let (s, tok) = verify(&node, &message, &a.sign(&mut signer, &message));
    assert_eq!(s, 200, "{tok}");
    assert_eq!(tok["role"], "member");
    let t = tok["access_token"].as_str().unwrap();
    let (s, b) = call(&node, t, "GET", "/v1/auth/whoami", None);
    assert_eq!(s, 200, "{b}");
    assert_eq!(json(&b)["subject"], format!("wallet:{}", a.lower()));
    assert_eq!(
        json(&b)["grants"],
        json!([format!("kv:read:users/{}/*", a.lower())])
    );
    assert_eq!(call(&node, t, "GET", &own, None), (200, "mine".into()));
    let (s, b) = call(&node, t, "GET", "/v1/kv/vault", None);
    assert_eq!((s, code(&json(&b))), (403, "MISSING_GRANT"), "{b}");
    // The refresh token works as for an Ed25519 wallet.
    let (s, r) = post(
        &node,
        "/v1/auth/refresh",
        &json!({"refresh_token": tok["refresh_token"]}),
    );
    assert_eq!(s, 200, "{r}");

    // Lower-case address in, v as 0/1 out: the same account signs in.
    let (s, ch) = challenge(&node, &a.lower(), 1, "bank");
    assert_eq!(s, 200, "{ch}");
    assert_eq!(ch["address"], a.address.as_str(), "answered checksummed");
    let message = ch["message"].as_str().unwrap();
    let sig = a.sign(&mut signer, message);
    let v = u8::from_str_radix(&sig[128..], 16).unwrap() - 27;
    let (s, tok) = verify(&node, message, &format!("0x{}{v:02x}", &sig[..128]));
    assert_eq!(s, 200, "{tok}");
}

/// s' = n - s (secp256k1's order): the same signature's other, high-s form.
fn high_s(sig: &str) -> String {
    let n =
        hex::decode("fffffffffffffffffffffffffffffffebaaedce6af48a03bbfd25e8cd0364141").unwrap();
    let s = hex::decode(&sig[64..128]).unwrap();
    let mut out = [0u8; 32];
    let mut borrow = 0i16;
    for i in (0..32).rev() {
        let d = n[i] as i16 - s[i] as i16 - borrow;
        out[i] = d.rem_euclid(256) as u8;
        borrow = (d < 0) as i16;
    }
    let v = if &sig[128..] == "1b" { "1c" } else { "1b" };
    format!("{}{}{v}", &sig[..64], hex::encode(out))
}

/// Every way of getting the message or signature wrong is refused with its
/// own code and signs nobody in, and leaves the challenge as it was: a
/// message altered in each field (the statement, URI, Version, Issued At,
/// Expiration Time, the resource, the address: SIWE_MESSAGE_ALTERED),
/// another domain (SIWE_DOMAIN_MISMATCH), another chain id
/// (SIWE_CHAIN_MISMATCH), another nonce (UNKNOWN_CHALLENGE), each signed by
/// the right key; a signature by another key (BAD_WALLET_SIGNATURE); a
/// signature of the wrong length (MALFORMED_SIGNATURE), in its high-s form
/// (SIGNATURE_HIGH_S), with v out of range (BAD_RECOVERY_ID). Then the
/// genuine signature signs in once, and its reuse is NONCE_SPENT.
#[test]
fn each_wrong_message_or_signature_is_refused_with_its_own_code() {
    let (node, _) = bank("");
    let mut signer = Signer::start();
    let (a, other) = (Account::new(&mut signer), Account::new(&mut signer));
    let message = message_of(&node, &a, "bank");
    let line = |prefix: &str| -> String {
        message
            .split('\n')
            .find(|l| l.starts_with(prefix))
            .unwrap()
            .to_string()
    };
    let statement = message.split('\n').nth(3).unwrap().to_string();
    let altered: Vec<(String, &str)> = vec![
        (
            message.replace(&statement, "Sign in and pay 1 ETH."),
            "SIWE_MESSAGE_ALTERED",
        ),
        (
            message.replace(&line("URI: "), "URI: https://evil.example"),
            "SIWE_MESSAGE_ALTERED",
        ),
        (
            message.replace("Version: 1", "Version: 2"),
            "SIWE_MESSAGE_ALTERED",
        ),
        (
            message.replace(&line("Issued At: "), "Issued At: 2020-01-01T00:00:00Z"),
            "SIWE_MESSAGE_ALTERED",
        ),
        (
            message.replace(
                &line("Expiration Time: "),
                "Expiration Time: 2099-01-01T00:00:00Z",
            ),
            "SIWE_MESSAGE_ALTERED",
        ),
        (
            message.replace("namespace:bank", "namespace:vault"),
            "SIWE_MESSAGE_ALTERED",
        ),
        (
            message.replace(&a.address, &other.address),
            "SIWE_MESSAGE_ALTERED",
        ),
        (
            message.replacen(DOMAIN, "evil.example", 1),
            "SIWE_DOMAIN_MISMATCH",
        ),
        (
            message.replace("Chain ID: 1", "Chain ID: 137"),
            "SIWE_CHAIN_MISMATCH",
        ),
        (
            message.replace(&line("Nonce: "), "Nonce: 0123456789abcdef0123456789abcdef"),
            "UNKNOWN_CHALLENGE",
        ),
    ];
    for (m, want) in &altered {
        assert_ne!(m, &message);
        // Signed by the address the altered message names (the attacker's
        // own key for the address swap), so only the alteration is wrong.
        let by = if m.contains(&other.address) {
            &other
        } else {
            &a
        };
        let (s, v) = verify(&node, m, &by.sign(&mut signer, m));
        assert_eq!((s, code(&v)), (401, *want), "{m}\n{v}");
    }
    let good = a.sign(&mut signer, &message);
    let cases: Vec<(String, u16, &str)> = vec![
        (
            other.sign(&mut signer, &message),
            401,
            "BAD_WALLET_SIGNATURE",
        ),
        (good[..128].to_string(), 400, "MALFORMED_SIGNATURE"),
        (format!("{good}00"), 400, "MALFORMED_SIGNATURE"),
        (high_s(&good), 400, "SIGNATURE_HIGH_S"),
        (format!("{}1d", &good[..128]), 400, "BAD_RECOVERY_ID"),
        (format!("{}02", &good[..128]), 400, "BAD_RECOVERY_ID"),
    ];
    for (sig, status, want) in &cases {
        let (s, v) = verify(&node, &message, sig);
        assert_eq!((s, code(&v)), (*status, *want), "{sig}\n{v}");
        assert!(v["error"]["message"].is_string());
    }
    let (s, tok) = verify(&node, &message, &good);
    assert_eq!(s, 200, "the challenge was left as issued: {tok}");
    assert!(tok["access_token"].is_string());
    let (s, v) = verify(&node, &message, &good);
    assert_eq!((s, code(&v)), (401, "NONCE_SPENT"), "{v}");
}

/// A message signed after its Expiration Time (here `challenge_seconds =
/// 1`) is CHALLENGE_EXPIRED, and signs nobody in.
#[test]
fn an_expired_message_is_refused() {
    let (node, _) = bank("[auth]\nchallenge_seconds = 1\n");
    let mut signer = Signer::start();
    let a = Account::new(&mut signer);
    let message = message_of(&node, &a, "bank");
    let sig = a.sign(&mut signer, &message);
    std::thread::sleep(std::time::Duration::from_millis(2500));
    let (s, v) = verify(&node, &message, &sig);
    assert_eq!((s, code(&v)), (401, "CHALLENGE_EXPIRED"), "{v}");
}

/// Bad input to the challenge is 400 with its code and stores nothing: an
/// address that is not 0x and 20 bytes of hex (short, long, no 0x, not
/// hex), a mixed-case address whose EIP-55 checksum does not match, no
/// chain id, chain id 0, an unknown chain, Ed25519's `wallet` field with
/// `evm`, an unknown field. The same account still gets a challenge.
#[test]
fn bad_addresses_and_challenge_requests_are_400() {
    let (node, _) = bank("");
    let mut signer = Signer::start();
    let a = Account::new(&mut signer);
    let flip = |addr: &str| -> String {
        // Flip the case of the first letter: the checksum no longer matches.
        let i = addr[2..].find(|c: char| c.is_ascii_alphabetic()).unwrap() + 2;
        let c = addr.as_bytes()[i] as char;
        let f = if c.is_ascii_uppercase() {
            c.to_ascii_lowercase()
        } else {
            c.to_ascii_uppercase()
        };
        format!("{}{f}{}", &addr[..i], &addr[i + 1..])
    };
    let ns = "bank";
    let bad: Vec<(Value, &str)> = vec![
        (
            json!({"chain": "evm", "address": &a.address[..40], "chain_id": 1, "namespace": ns}),
            "INVALID_WALLET",
        ),
        (
            json!({"chain": "evm", "address": format!("{}00", a.address), "chain_id": 1, "namespace": ns}),
            "INVALID_WALLET",
        ),
        (
            json!({"chain": "evm", "address": &a.address[2..], "chain_id": 1, "namespace": ns}),
            "INVALID_WALLET",
        ),
        (
            json!({"chain": "evm", "address": format!("0x{}", "g".repeat(40)), "chain_id": 1, "namespace": ns}),
            "INVALID_WALLET",
        ),
        (
            json!({"chain": "evm", "address": flip(&a.address), "chain_id": 1, "namespace": ns}),
            "ADDRESS_CHECKSUM_MISMATCH",
        ),
        (
            json!({"chain": "evm", "address": a.address, "namespace": ns}),
            "BAD_REQUEST",
        ),
        (
            json!({"chain": "evm", "address": a.address, "chain_id": 0, "namespace": ns}),
            "BAD_REQUEST",
        ),
        (
            json!({"chain": "solana", "address": a.address, "chain_id": 1, "namespace": ns}),
            "BAD_REQUEST",
        ),
        (
            json!({"chain": "evm", "wallet": a.address, "chain_id": 1, "namespace": ns}),
            "BAD_REQUEST",
        ),
        (
            json!({"chain": "evm", "address": a.address, "chain_id": 1, "namespace": ns, "x": 1}),
            "MALFORMED_JSON",
        ),
    ];
    for (body, want) in &bad {
        let (s, v) = post(&node, "/v1/auth/challenge", body);
        assert_eq!((s, code(&v)), (400, *want), "{body}\n{v}");
        assert_eq!(v["ok"], false);
    }
    let (s, v) = challenge(&node, &a.address, 1, ns);
    assert_eq!(s, 200, "{v}");
}

/// EVM wallets obey the namespace's wallet sign-in policy as Ed25519 ones
/// do: off by default (WALLET_SIGN_IN_DISABLED); an allow list naming the
/// account (checksummed) admits it and not another (WALLET_NOT_ALLOWED);
/// a list entry with a bad checksum is refused (400); taken off the list
/// after its challenge, the account's verify is refused.
#[test]
fn evm_wallets_obey_the_namespace_policy() {
    let node = TestNode::start_with(config(""));
    let owner = node.create_namespace("shop");
    let mut signer = Signer::start();
    let (listed, stranger) = (Account::new(&mut signer), Account::new(&mut signer));
    let (s, v) = challenge(&node, &listed.address, 1, "shop");
    assert_eq!((s, code(&v)), (403, "WALLET_SIGN_IN_DISABLED"), "{v}");
    let upper = format!("0x{}", listed.address[2..].to_ascii_uppercase());
    let (s, b) = call(
        &node,
        &owner,
        "PUT",
        "/v1/namespaces/shop/wallet-sign-in",
        Some(
            json!({"enabled": true, "allow": [listed.address.replacen("0x", "0X", 1)]})
                .to_string()
                .as_bytes(),
        ),
    );
    assert_eq!((s, code(&json(&b))), (400, "INVALID_WALLET"), "{b}");
    set_policy(
        &node,
        &owner,
        "shop",
        json!({"enabled": true, "allow": [upper]}),
    );
    let (s, v) = challenge(&node, &stranger.address, 1, "shop");
    assert_eq!((s, code(&v)), (403, "WALLET_NOT_ALLOWED"), "{v}");
    let message = message_of(&node, &listed, "shop");
    let (s, tok) = verify(&node, &message, &listed.sign(&mut signer, &message));
    assert_eq!(s, 200, "{tok}");
    assert_eq!(tok["role"], "wallet");
    // Taken off the list between challenge and verify.
    let message = message_of(&node, &listed, "shop");
    set_policy(
        &node,
        &owner,
        "shop",
        json!({"enabled": true, "allow": [stranger.address]}),
    );
    let (s, v) = verify(&node, &message, &listed.sign(&mut signer, &message));
    assert_eq!((s, code(&v)), (403, "WALLET_NOT_ALLOWED"), "{v}");
}

/// With the real default limits, on a node of its own: 31 challenges for
/// one account in a row, each from another client address, and the 31st
/// is refused by the per-wallet bucket (WALLET_RATE_LIMITED, Retry-After),
/// after at least its burst was answered; 31 challenges from one address,
/// each for another account, and the 31st is refused by that address's
/// credential bucket (RATE_LIMITED).
#[test]
fn the_wallet_and_credential_buckets_refuse_the_31st_attempt() {
    let node = TestNode::start_with(NodeOpts {
        config: format!("[server]\nbase_domain = \"{DOMAIN}\"\n"),
        ..Default::default()
    });
    let owner = node.create_namespace("bank");
    set_policy(
        &node,
        &owner,
        "bank",
        json!({"enabled": true, "allow": "any"}),
    );
    let mut signer = Signer::start();
    let a = Account::new(&mut signer);
    let ask = |from: &str, address: &str| {
        let (s, h, b) = http_from(
            Some(from),
            "POST",
            &node.url("/v1/auth/challenge"),
            &[("content-type", "application/json")],
            Some(
                json!({"chain": "evm", "address": address, "chain_id": 1, "namespace": "bank"})
                    .to_string()
                    .as_bytes(),
            ),
        );
        let retry = header(&h, "retry-after").map(str::to_string);
        (s, retry, json(&String::from_utf8_lossy(&b)))
    };
    let mut answered = 0;
    let mut last = (0, None, Value::Null);
    for i in 0..31 {
        last = ask(&format!("127.0.1.{}", i + 1), &a.address);
        if last.0 == 200 {
            answered += 1;
        }
    }
    assert_eq!(
        (last.0, code(&last.2)),
        (429, "WALLET_RATE_LIMITED"),
        "{:?}",
        last
    );
    assert!(last.1.is_some(), "Retry-After");
    // Default wallet_burst 5, wallet_per_minute 10: the burst, and at most
    // what refills in the seconds the 31 took.
    assert!((5..=15).contains(&answered), "{answered} answered");

    let mut answered = 0;
    for i in 0..31 {
        let mut k = [0u8; 20];
        k[0] = 0x42;
        k[19] = i as u8;
        last = ask("127.0.2.1", &format!("0x{}", hex::encode(k)));
        if last.0 == 200 {
            answered += 1;
        }
    }
    assert_eq!((last.0, code(&last.2)), (429, "RATE_LIMITED"), "{:?}", last);
    assert!(last.1.is_some(), "Retry-After");
    // Default credential_burst 10, credential_per_minute 30.
    assert!((10..=40).contains(&answered), "{answered} answered");
}
