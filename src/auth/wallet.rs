//! The pure parts of wallet sign-in.
//!
//! `POST /v1/auth/challenge {wallet, namespace}` answers a
//! [`challenge_message`] holding a fresh [`new_nonce`]; the client signs
//! the exact message bytes with the wallet's Ed25519 key and sends
//! `POST /v1/auth/verify {message, signature}`. The node parses the
//! message back ([`parse_challenge`]), checks expiry with its clock,
//! [`verify_signature`], and spends the nonce with a compare-and-swap.

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
use ring::rand::{SecureRandom, SystemRandom};
use ring::signature::{ED25519, UnparsedPublicKey};

use super::error::{AuthError, Result};

/// How long a challenge (and its nonce) stays valid, in seconds.
pub const NONCE_TTL: u64 = 5 * 60;
/// Most open (unspent, unexpired) challenges per wallet.
pub const MAX_OPEN_NONCES: usize = 10;
/// Longest namespace name a challenge accepts, in bytes.
const MAX_NAMESPACE_LEN: usize = 128;

const TITLE: &str = "meshgate sign-in";
const INTRO: &str = "Sign this message to prove that you control the wallet below. \
It signs you in to one namespace, once, and asks for no payment.";

/// What a challenge message says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// The wallet: the signer's Ed25519 public key, 64 lower-case hex.
    pub wallet: String,
    /// The namespace to sign in to.
    pub namespace: String,
    /// 64 lower-case hex characters.
    pub nonce: String,
    /// Unix seconds.
    pub issued_at: u64,
    /// Unix seconds.
    pub expires_at: u64,
}

impl Challenge {
    /// Whether the challenge can no longer be used at `now`.
    pub fn is_expired(&self, now: u64) -> bool {
        now >= self.expires_at
    }
}

/// 32 random bytes as lower-case hex.
pub fn new_nonce() -> Result<String> {
    let mut b = [0u8; 32];
    SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| AuthError::Random)?;
    Ok(hex::encode(b))
}

/// A wallet as the node stores it: 64 lower-case hex characters (an
/// optional `0x` prefix and upper case are accepted on input).
pub fn normalize_wallet(wallet: &str) -> Result<String> {
    let w = wallet.trim();
    let w = w.strip_prefix("0x").unwrap_or(w);
    if w.len() != 64 || !w.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(AuthError::InvalidWallet(
            "expected 64 hex characters (an Ed25519 public key)",
        ));
    }
    Ok(w.to_ascii_lowercase())
}

/// The message the wallet signs. Every field is on its own line; the
/// times are shown in UTC and as unix seconds.
pub fn challenge_message(
    wallet_hex: &str,
    namespace: &str,
    nonce_hex: &str,
    issued_at: u64,
    expires_at: u64,
) -> String {
    format!(
        "{TITLE}\n\n{INTRO}\n\nWallet: {wallet_hex}\nNamespace: {namespace}\nNonce: {nonce_hex}\n\
         Issued At: {} ({issued_at})\nExpires At: {} ({expires_at})",
        utc(issued_at),
        utc(expires_at),
    )
}

/// Reads a message produced by [`challenge_message`]; anything else,
/// even with the same fields, is refused (the message is rebuilt from the
/// parsed fields and must be byte-identical).
pub fn parse_challenge(message: &str) -> Result<Challenge> {
    let bad = AuthError::MalformedChallenge;
    if message.len() > 2048 {
        return Err(bad("too long"));
    }
    let lines: Vec<&str> = message.split('\n').collect();
    let [
        title,
        "",
        intro,
        "",
        wallet,
        namespace,
        nonce,
        issued,
        expires,
    ] = lines[..]
    else {
        return Err(bad("wrong number of lines"));
    };
    if title != TITLE || intro != INTRO {
        return Err(bad("not a meshgate challenge"));
    }
    let field = |line: &'static str, value: &str| -> Result<String> {
        value
            .strip_prefix(line)
            .map(str::to_owned)
            .ok_or(AuthError::MalformedChallenge("missing field"))
    };
    let wallet = field("Wallet: ", wallet)?;
    if wallet.len() != 64
        || !wallet
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    {
        return Err(bad("wallet is not 64 lower-case hex characters"));
    }
    let namespace = field("Namespace: ", namespace)?;
    if namespace.is_empty()
        || namespace.len() > MAX_NAMESPACE_LEN
        || namespace.chars().any(char::is_control)
    {
        return Err(bad("bad namespace"));
    }
    let nonce = field("Nonce: ", nonce)?;
    if nonce.len() != 64
        || !nonce
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    {
        return Err(bad("nonce is not 64 lower-case hex characters"));
    }
    let time = |s: String| -> Result<u64> {
        let inner = s
            .rsplit_once(" (")
            .and_then(|(_, t)| t.strip_suffix(')'))
            .ok_or(AuthError::MalformedChallenge("bad time"))?;
        inner
            .parse()
            .map_err(|_| AuthError::MalformedChallenge("bad time"))
    };
    let issued_at = time(field("Issued At: ", issued)?)?;
    let expires_at = time(field("Expires At: ", expires)?)?;
    if expires_at <= issued_at {
        return Err(bad("expires before it is issued"));
    }
    if challenge_message(&wallet, &namespace, &nonce, issued_at, expires_at) != message {
        return Err(bad("not in canonical form"));
    }
    Ok(Challenge {
        wallet,
        namespace,
        nonce,
        issued_at,
        expires_at,
    })
}

/// Checks an Ed25519 `signature` (128 hex characters, or base64 /
/// base64url with or without padding, of 64 bytes) over `message` by
/// the wallet's public key (64 hex characters).
pub fn verify_signature(wallet_hex_pubkey: &str, message: &[u8], signature: &str) -> Result<()> {
    let wallet = normalize_wallet(wallet_hex_pubkey)?;
    let public = hex::decode(wallet).map_err(|_| AuthError::InvalidWallet("not hex"))?;
    let sig = decode_signature(signature.trim()).ok_or(AuthError::MalformedSignature)?;
    UnparsedPublicKey::new(&ED25519, &public)
        .verify(message, &sig)
        .map_err(|_| AuthError::BadWalletSignature)
}

fn decode_signature(s: &str) -> Option<Vec<u8>> {
    if s.len() == 128 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return hex::decode(s).ok();
    }
    if s.len() > 100 {
        return None;
    }
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|e| e.decode(s).ok())
        .filter(|b| b.len() == 64)
}

/// `YYYY-MM-DDTHH:MM:SSZ` for unix seconds (proleptic Gregorian).
pub(crate) fn utc(secs: u64) -> String {
    let rem = secs % 86_400;
    let (y, m, d) = crate::util::civil_from_days((secs / 86_400) as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use ring::signature::{Ed25519KeyPair, KeyPair};

    const NOW: u64 = 1_700_000_000;

    fn wallet() -> (Ed25519KeyPair, String) {
        let der = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).unwrap();
        let kp = Ed25519KeyPair::from_pkcs8(der.as_ref()).unwrap();
        let hex = hex::encode(kp.public_key().as_ref());
        (kp, hex)
    }

    fn message(w: &str) -> String {
        challenge_message(w, "acme", &new_nonce().unwrap(), NOW, NOW + NONCE_TTL)
    }

    /// The message shows every field and parses back to them.
    #[test]
    fn message_round_trip() {
        let (_, w) = wallet();
        let nonce = new_nonce().unwrap();
        let m = challenge_message(&w, "acme", &nonce, NOW, NOW + NONCE_TTL);
        for part in [
            w.as_str(),
            "acme",
            nonce.as_str(),
            "1700000000",
            "2023-11-14T22:13:20Z",
        ] {
            assert!(m.contains(part), "{part}");
        }
        let c = parse_challenge(&m).unwrap();
        assert_eq!(
            c,
            Challenge {
                wallet: w,
                namespace: "acme".into(),
                nonce,
                issued_at: NOW,
                expires_at: NOW + NONCE_TTL
            }
        );
        assert!(!c.is_expired(NOW + NONCE_TTL - 1));
        assert!(c.is_expired(NOW + NONCE_TTL));
    }

    /// Edited or foreign messages are refused.
    #[test]
    fn parse_rejects() {
        let (_, w) = wallet();
        let m = message(&w);
        let cases = [
            String::new(),
            "hello".into(),
            m.replace("acme", "acme\nx"),
            m.replace("Nonce: ", "Nonce: 0"),
            m.replace("(1700000000)", "(1700000001)"),
            m.replace("(1700000000)", "(x)"),
            m.replace(&w, &w.to_ascii_uppercase()),
            m.replace("meshgate sign-in", "other sign-in"),
            format!("{m}\n"),
            m.replace("Namespace: acme", "Namespace: "),
            challenge_message(&w, "acme", &"0".repeat(64), NOW, NOW),
        ];
        for c in cases {
            assert!(
                matches!(parse_challenge(&c), Err(AuthError::MalformedChallenge(_))),
                "{c:?}"
            );
        }
    }

    /// A good signature in hex and in base64 verifies.
    #[test]
    fn good_signature() {
        let (kp, w) = wallet();
        let m = message(&w);
        let sig = kp.sign(m.as_bytes());
        verify_signature(&w, m.as_bytes(), &hex::encode(sig.as_ref())).unwrap();
        verify_signature(&w, m.as_bytes(), &STANDARD.encode(sig.as_ref())).unwrap();
        verify_signature(&w, m.as_bytes(), &URL_SAFE_NO_PAD.encode(sig.as_ref())).unwrap();
        verify_signature(
            &format!("0x{}", w.to_uppercase()),
            m.as_bytes(),
            &hex::encode(sig.as_ref()),
        )
        .unwrap();
    }

    /// A signature by another wallet, over another message, or garbage.
    #[test]
    fn bad_signatures() {
        let (kp, w) = wallet();
        let (other, _) = wallet();
        let m = message(&w);
        let by_other = hex::encode(other.sign(m.as_bytes()).as_ref());
        assert!(matches!(
            verify_signature(&w, m.as_bytes(), &by_other),
            Err(AuthError::BadWalletSignature)
        ));
        let other_msg = hex::encode(kp.sign(message(&w).as_bytes()).as_ref());
        assert!(matches!(
            verify_signature(&w, m.as_bytes(), &other_msg),
            Err(AuthError::BadWalletSignature)
        ));
        let mut flipped = kp.sign(m.as_bytes()).as_ref().to_vec();
        flipped[0] ^= 1;
        assert!(matches!(
            verify_signature(&w, m.as_bytes(), &hex::encode(flipped)),
            Err(AuthError::BadWalletSignature)
        ));
        for junk in ["", "zz", &"0".repeat(126), &STANDARD.encode([0u8; 63])] {
            assert!(
                matches!(
                    verify_signature(&w, m.as_bytes(), junk),
                    Err(AuthError::MalformedSignature)
                ),
                "{junk}"
            );
        }
        assert!(matches!(
            verify_signature("abc", m.as_bytes(), &by_other),
            Err(AuthError::InvalidWallet(_))
        ));
    }

    /// Nonces are 64 lower-case hex and distinct.
    #[test]
    fn nonces() {
        let a = new_nonce().unwrap();
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
        assert_ne!(a, new_nonce().unwrap());
    }

    /// UTC formatting on known dates.
    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(NOW), "2023-11-14T22:13:20Z");
    }

    proptest! {
        // Parsers of untrusted bytes: thousands of generated inputs each.
        #![proptest_config(ProptestConfig::with_cases(3000))]
        /// `parse_challenge` never panics on arbitrary input.
        #[test]
        fn parse_never_panics(s in ".{0,400}") {
            let _ = parse_challenge(&s);
        }

        /// Nor on near-messages, and what it accepts round-trips.
        #[test]
        fn parse_near_messages(ns in ".{0,20}", a in any::<u64>(), b in any::<u64>()) {
            let m = challenge_message(&"a".repeat(64), &ns, &"b".repeat(64), a, b);
            if let Ok(c) = parse_challenge(&m) {
                prop_assert_eq!(c.namespace, ns);
            }
        }

        /// `verify_signature` never panics.
        #[test]
        fn verify_never_panics(w in ".{0,70}", s in ".{0,130}") {
            let _ = verify_signature(&w, b"m", &s);
        }
    }
}
