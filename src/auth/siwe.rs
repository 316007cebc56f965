//! The pure parts of Sign-In with Ethereum (EIP-4361).
//!
//! `POST /v1/auth/challenge {"chain":"evm", address, chain_id, namespace}`
//! answers a [`SiweMessage`] built by the node ([`SiweMessage::render`]):
//! its `base_domain` as the domain, a fresh [`new_siwe_nonce`], `Issued At`
//! and `Expiration Time`, and the namespace as a resource. The wallet signs
//! it with `personal_sign` (EIP-191); `POST /v1/auth/verify` parses it back
//! ([`parse_siwe`]) to find the challenge the node kept, compares the bytes,
//! and [`recover_address`] gives the signer, compared with the address.
//!
//! The curve and the hash are kept crates: `k256` (ECDSA public key
//! recovery) and `sha3` (keccak-256). Nothing cryptographic is written here.

use k256::ecdsa::{RecoveryId, Signature, VerifyingKey};
use ring::rand::{SecureRandom, SystemRandom};
use sha3::{Digest, Keccak256};

use super::error::{AuthError, Result};

/// The end of an EIP-4361 message's first line, after the domain.
pub const SIWE_PREAMBLE: &str = " wants you to sign in with your Ethereum account:";
/// The `Version` field of every message the node builds.
const SIWE_VERSION: &str = "1";
/// Longest message `parse_siwe` reads, in bytes.
const MAX_SIWE_LEN: usize = 4096;
/// A namespace as an EIP-4361 resource (a URN).
const NAMESPACE_RESOURCE: &str = "urn:meshgate:namespace:";

/// An EIP-4361 message: the fields the node writes (and the optional ones
/// a parsed message may carry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SiweMessage {
    /// The RFC 3986 authority asking for the sign-in: the node's `base_domain`.
    pub domain: String,
    /// The signer's address, EIP-55 checksummed (`0x` and 40 hex).
    pub address: String,
    /// A human-readable line; never empty in the node's messages.
    pub statement: Option<String>,
    /// The URI the sign-in is for (the node's public URL).
    pub uri: String,
    /// Always `1`.
    pub version: String,
    /// The EIP-155 chain the wallet signs for.
    pub chain_id: u64,
    /// At least 8 alphanumerics; the node's are 32 lower-case hex.
    pub nonce: String,
    /// RFC 3339, UTC.
    pub issued_at: String,
    /// RFC 3339, UTC; always present in the node's messages.
    pub expiration_time: Option<String>,
    /// RFC 3339, UTC.
    pub not_before: Option<String>,
    /// A request identifier.
    pub request_id: Option<String>,
    /// URIs; the node's hold the namespace as `urn:meshgate:namespace:<ns>`.
    pub resources: Vec<String>,
}

impl SiweMessage {
    /// The message the node issues for `address` (checksummed) to sign in
    /// to `namespace`.
    #[allow(clippy::too_many_arguments)]
    pub fn for_namespace(
        domain: &str,
        uri: &str,
        address: &str,
        chain_id: u64,
        namespace: &str,
        nonce: &str,
        issued_at: u64,
        expires_at: u64,
    ) -> SiweMessage {
        SiweMessage {
            domain: domain.to_string(),
            address: address.to_string(),
            statement: Some(format!(
                "Sign in to namespace {namespace} of this meshgate node. It signs you in once and asks for no payment."
            )),
            uri: uri.to_string(),
            version: SIWE_VERSION.to_string(),
            chain_id,
            nonce: nonce.to_string(),
            issued_at: super::wallet::utc(issued_at),
            expiration_time: Some(super::wallet::utc(expires_at)),
            not_before: None,
            request_id: None,
            resources: vec![format!("{NAMESPACE_RESOURCE}{namespace}")],
        }
    }

    /// The namespace named by the message's resources, if any.
    pub fn namespace(&self) -> Option<&str> {
        self.resources
            .iter()
            .find_map(|r| r.strip_prefix(NAMESPACE_RESOURCE))
    }

    /// The message text in EIP-4361's layout (lines joined by `\n`).
    pub fn render(&self) -> String {
        let mut s = format!("{}{SIWE_PREAMBLE}\n{}\n", self.domain, self.address);
        if let Some(st) = &self.statement {
            s.push('\n');
            s.push_str(st);
            s.push('\n');
        }
        s.push_str(&format!(
            "\nURI: {}\nVersion: {}\nChain ID: {}\nNonce: {}\nIssued At: {}",
            self.uri, self.version, self.chain_id, self.nonce, self.issued_at
        ));
        for (name, v) in [
            ("Expiration Time", &self.expiration_time),
            ("Not Before", &self.not_before),
            ("Request ID", &self.request_id),
        ] {
            if let Some(v) = v {
                s.push_str(&format!("\n{name}: {v}"));
            }
        }
        if !self.resources.is_empty() {
            s.push_str("\nResources:");
            for r in &self.resources {
                s.push_str("\n- ");
                s.push_str(r);
            }
        }
        s
    }
}

/// A fresh nonce: 16 random bytes as 32 lower-case hex (EIP-4361 asks for
/// at least 8 alphanumerics).
pub fn new_siwe_nonce() -> Result<String> {
    let mut b = [0u8; 16];
    SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| AuthError::Random)?;
    Ok(hex::encode(b))
}

/// Reads an EIP-4361 message: the layout [`SiweMessage::render`] writes,
/// with the optional statement and fields. Anything else is
/// `MALFORMED_CHALLENGE`. The caller compares the bytes with the message
/// it issued; this only finds the fields.
pub fn parse_siwe(message: &str) -> Result<SiweMessage> {
    let bad = AuthError::MalformedChallenge;
    if message.len() > MAX_SIWE_LEN {
        return Err(bad("too long"));
    }
    let mut lines = message.split('\n').peekable();
    let domain = lines
        .next()
        .and_then(|l| l.strip_suffix(SIWE_PREAMBLE))
        .filter(|d| !d.is_empty() && !d.contains(char::is_whitespace))
        .ok_or(bad("not a Sign-In with Ethereum message"))?
        .to_string();
    let address = lines.next().ok_or(bad("no address"))?.to_string();
    if lines.next() != Some("") {
        return Err(bad("no blank line after the address"));
    }
    let mut statement = None;
    if lines.peek().is_some_and(|l| !l.starts_with("URI: ")) {
        let st = lines.next().unwrap_or_default();
        if st.is_empty() || lines.next() != Some("") {
            return Err(bad("bad statement"));
        }
        statement = Some(st.to_string());
    }
    let mut field = |name: &'static str| -> Result<String> {
        lines
            .next()
            .and_then(|l| l.strip_prefix(name))
            .and_then(|l| l.strip_prefix(": "))
            .map(str::to_string)
            .ok_or(AuthError::MalformedChallenge("missing field"))
    };
    let uri = field("URI")?;
    let version = field("Version")?;
    let chain_id = field("Chain ID")?;
    let nonce = field("Nonce")?;
    let issued_at = field("Issued At")?;
    let chain_id = (!chain_id.starts_with('0') || chain_id == "0")
        .then(|| chain_id.parse::<u64>().ok())
        .flatten()
        .ok_or(bad("bad chain id"))?;
    if nonce.len() < 8 || !nonce.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(bad("the nonce is not 8 or more alphanumerics"));
    }
    let mut optional = |name: &str| -> Option<String> {
        let v = lines
            .peek()
            .and_then(|l| l.strip_prefix(name))
            .and_then(|l| l.strip_prefix(": "))
            .map(str::to_string);
        if v.is_some() {
            lines.next();
        }
        v
    };
    let expiration_time = optional("Expiration Time");
    let not_before = optional("Not Before");
    let request_id = optional("Request ID");
    let mut resources = Vec::new();
    if let Some(l) = lines.next() {
        if l != "Resources:" {
            return Err(bad("unexpected line"));
        }
        for r in lines {
            let r = r.strip_prefix("- ").ok_or(bad("bad resource"))?;
            resources.push(r.to_string());
        }
        if resources.is_empty() {
            return Err(bad("no resources after Resources:"));
        }
    }
    Ok(SiweMessage {
        domain,
        address,
        statement,
        uri,
        version,
        chain_id,
        nonce,
        issued_at,
        expiration_time,
        not_before,
        request_id,
        resources,
    })
}

/// An EVM address checked and normalized: `0x` and 40 hex digits (20
/// bytes); all lower case, all upper case, or mixed case matching its
/// EIP-55 checksum. Answers the address in lower case (how the node keys
/// and compares it).
pub fn normalize_evm_address(address: &str) -> Result<String> {
    let hexpart = address
        .strip_prefix("0x")
        .filter(|h| h.len() == 40 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or(AuthError::InvalidWallet(
            "an EVM address is 0x and 40 hex digits (20 bytes)",
        ))?;
    let lower = hexpart.to_ascii_lowercase();
    let mixed = hexpart.bytes().any(|b| b.is_ascii_lowercase())
        && hexpart.bytes().any(|b| b.is_ascii_uppercase());
    if mixed && checksum_address(&lower) != address {
        return Err(AuthError::AddressChecksum);
    }
    Ok(format!("0x{lower}"))
}

/// The EIP-55 form of a 40-hex address (given in lower case, without `0x`
/// or with it): a letter is upper case where the keccak-256 of the
/// lower-case hex has a nibble of 8 or more.
pub fn checksum_address(lower_hex: &str) -> String {
    let lower = lower_hex
        .strip_prefix("0x")
        .unwrap_or(lower_hex)
        .to_ascii_lowercase();
    let hash = Keccak256::digest(lower.as_bytes());
    let mut out = String::with_capacity(42);
    out.push_str("0x");
    for (i, c) in lower.chars().enumerate() {
        let nibble = (hash[i / 2] >> if i % 2 == 0 { 4 } else { 0 }) & 0x0f;
        out.push(if nibble >= 8 {
            c.to_ascii_uppercase()
        } else {
            c
        });
    }
    out
}

/// The EIP-191 digest `personal_sign` signs: keccak-256 of
/// `"\x19Ethereum Signed Message:\n" + len + message`.
pub fn eip191_digest(message: &[u8]) -> [u8; 32] {
    let mut h = Keccak256::new();
    h.update(b"\x19Ethereum Signed Message:\n");
    h.update(message.len().to_string().as_bytes());
    h.update(message);
    h.finalize().into()
}

/// The address (lower case, `0x`) that signed `message` with
/// `personal_sign`: `signature` is 65 bytes as hex (`0x` optional), `r ‖ s ‖
/// v` with `v` 27/28 or 0/1. A signature of another length or not hex is
/// `MALFORMED_SIGNATURE`, a `v` out of range `BAD_RECOVERY_ID`, an `s` in
/// the upper half of the curve order `SIGNATURE_HIGH_S` (EIP-2: every
/// signature has one canonical form), and one from which no key can be
/// recovered `BAD_WALLET_SIGNATURE`.
pub fn recover_address(message: &[u8], signature: &str) -> Result<String> {
    let s = signature.trim();
    let s = s.strip_prefix("0x").unwrap_or(s);
    if s.len() != 130 {
        return Err(AuthError::MalformedSignature);
    }
    let bytes = hex::decode(s).map_err(|_| AuthError::MalformedSignature)?;
    let v = match bytes[64] {
        0 | 27 => 0u8,
        1 | 28 => 1u8,
        _ => return Err(AuthError::BadRecoveryId),
    };
    let sig = Signature::from_slice(&bytes[..64]).map_err(|_| AuthError::BadWalletSignature)?;
    if sig.normalize_s().is_some() {
        return Err(AuthError::SignatureHighS);
    }
    let recid = RecoveryId::from_byte(v).ok_or(AuthError::BadRecoveryId)?;
    let key = VerifyingKey::recover_from_prehash(&eip191_digest(message), &sig, recid)
        .map_err(|_| AuthError::BadWalletSignature)?;
    let point = key.to_encoded_point(false);
    let hash = Keccak256::digest(&point.as_bytes()[1..]);
    Ok(format!("0x{}", hex::encode(&hash[12..])))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A vector made with `eth-account` (Python), independent of this code:
    /// the private key of web3.py's documentation, its address, a message in
    /// the node's layout and the `personal_sign` signature of it.
    const ADDRESS: &str = "0x2c7536E3605D9C16a7a3D7b1898e529396a65c23";
    const SIGNATURE: &str = "3000d8f8fadcf39b0a04a2749602c9490fa8e81f718144c1c12502c12ea958ff3031f136f655058033d91e1f16beba7f3684b1ff71172386f1b7d46e00b5eaab1c";
    const NOW: u64 = 1_700_000_000;

    fn vector_message() -> SiweMessage {
        let mut m = SiweMessage::for_namespace(
            "localhost",
            "https://localhost",
            ADDRESS,
            1,
            "acme",
            "8f3a1c2b9d4e5f60718293a4b5c6d7e8",
            NOW,
            NOW + 300,
        );
        m.statement = Some("Sign in to namespace acme of this meshgate node.".into());
        m
    }

    /// The fixed vector: the node's layout is the text eth-account signed,
    /// and the signer's address is recovered from it (v 28, and as 1).
    #[test]
    fn recovers_the_address_of_a_fixed_vector() {
        let text = vector_message().render();
        assert_eq!(
            text,
            "localhost wants you to sign in with your Ethereum account:\n\
             0x2c7536E3605D9C16a7a3D7b1898e529396a65c23\n\n\
             Sign in to namespace acme of this meshgate node.\n\n\
             URI: https://localhost\nVersion: 1\nChain ID: 1\n\
             Nonce: 8f3a1c2b9d4e5f60718293a4b5c6d7e8\n\
             Issued At: 2023-11-14T22:13:20Z\n\
             Expiration Time: 2023-11-14T22:18:20Z\n\
             Resources:\n- urn:meshgate:namespace:acme"
        );
        let want = ADDRESS.to_ascii_lowercase();
        assert_eq!(recover_address(text.as_bytes(), SIGNATURE).unwrap(), want);
        let with_0x = format!("0x{SIGNATURE}");
        assert_eq!(recover_address(text.as_bytes(), &with_0x).unwrap(), want);
        let v01 = format!("{}01", &SIGNATURE[..128]);
        assert_eq!(recover_address(text.as_bytes(), &v01).unwrap(), want);
        // Another message: another (wrong) signer, or none at all.
        let other = text.replace("Chain ID: 1", "Chain ID: 2");
        assert_ne!(
            recover_address(other.as_bytes(), SIGNATURE).ok(),
            Some(want)
        );
    }

    /// The example of docs/auth.md, as written there: the message is the
    /// node's layout and its signature recovers the example's address.
    #[test]
    fn the_documented_example_holds() {
        let doc = include_str!("../../docs/auth.md");
        let block = |fence: &str| -> String {
            let start =
                doc.find(&format!("```{fence}\n")).expect("example block") + fence.len() + 4;
            let end = start + doc[start..].find("```").expect("closed");
            doc[start..end]
                .lines()
                .map(|l| l.strip_prefix("   ").unwrap_or(l))
                .collect::<Vec<_>>()
                .join("\n")
                .trim_end()
                .to_string()
        };
        let message = block("siwe");
        let signature = block("siwe-signature");
        assert_eq!(message, vector_message().render());
        assert_eq!(signature, SIGNATURE);
        assert_eq!(
            recover_address(message.as_bytes(), &signature).unwrap(),
            ADDRESS.to_ascii_lowercase()
        );
    }

    /// Malformed signatures each have their own refusal: length, hex, v,
    /// high s.
    #[test]
    fn malformed_signatures() {
        let text = vector_message().render();
        let m = text.as_bytes();
        for s in ["", "00", &SIGNATURE[..128], &format!("{SIGNATURE}00")] {
            assert!(
                matches!(recover_address(m, s), Err(AuthError::MalformedSignature)),
                "{s}"
            );
        }
        let not_hex = format!("zz{}", &SIGNATURE[2..]);
        assert!(matches!(
            recover_address(m, &not_hex),
            Err(AuthError::MalformedSignature)
        ));
        for v in ["02", "1a", "1d", "ff"] {
            let s = format!("{}{v}", &SIGNATURE[..128]);
            assert!(
                matches!(recover_address(m, &s), Err(AuthError::BadRecoveryId)),
                "{v}"
            );
        }
        // s' = n - s with v flipped is the same point: refused as high s.
        let n = hex::decode("fffffffffffffffffffffffffffffffebaaedce6af48a03bbfd25e8cd0364141")
            .unwrap();
        let s = hex::decode(&SIGNATURE[64..128]).unwrap();
        let mut high = [0u8; 32];
        let mut borrow = 0i16;
        for i in (0..32).rev() {
            let d = n[i] as i16 - s[i] as i16 - borrow;
            high[i] = d.rem_euclid(256) as u8;
            borrow = (d < 0) as i16;
        }
        let flipped = format!("{}{}1b", &SIGNATURE[..64], hex::encode(high));
        assert!(matches!(
            recover_address(m, &flipped),
            Err(AuthError::SignatureHighS)
        ));
    }

    /// EIP-55's own examples; a wrong case is refused, all lower or upper
    /// case accepted; not 20 bytes of hex refused.
    #[test]
    fn eip55_addresses() {
        for a in [
            "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed",
            "0xfB6916095ca1df60bB79Ce92cE3Ea74c37c5d359",
            "0xdbF03B407c01E7cD3CBea99509d93f8DDDC8C6FB",
            "0xD1220A0cf47c7B9Be7A2E6BA89F429762e7b9aDb",
        ] {
            assert_eq!(checksum_address(&a.to_ascii_lowercase()), a);
            assert_eq!(normalize_evm_address(a).unwrap(), a.to_ascii_lowercase());
            let lower = a.to_ascii_lowercase();
            assert_eq!(normalize_evm_address(&lower).unwrap(), lower);
            let upper = format!("0x{}", a[2..].to_ascii_uppercase());
            assert_eq!(normalize_evm_address(&upper).unwrap(), lower);
        }
        let wrong = "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAeD";
        assert!(matches!(
            normalize_evm_address(wrong),
            Err(AuthError::AddressChecksum)
        ));
        for bad in [
            "",
            "0x",
            "5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed",
            "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeA",
            "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed00",
            "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAeg",
        ] {
            assert!(
                matches!(normalize_evm_address(bad), Err(AuthError::InvalidWallet(_))),
                "{bad}"
            );
        }
    }

    /// What the node renders parses back to the same fields, with and
    /// without the optional ones; foreign layouts are refused.
    #[test]
    fn render_and_parse_round_trip() {
        let m = vector_message();
        assert_eq!(parse_siwe(&m.render()).unwrap(), m);
        assert_eq!(m.namespace(), Some("acme"));
        let mut bare = m.clone();
        bare.statement = None;
        bare.expiration_time = None;
        bare.resources.clear();
        bare.request_id = Some("r1".into());
        assert_eq!(parse_siwe(&bare.render()).unwrap(), bare);
        let text = m.render();
        for bad in [
            String::new(),
            "hello".into(),
            text.replace("Chain ID: 1", "Chain ID: x"),
            text.replace("Chain ID: 1", "Chain ID: 01"),
            text.replace("Nonce: 8f3a1c2b9d4e5f60718293a4b5c6d7e8", "Nonce: short"),
            text.replace("URI: ", "Uri: "),
            format!("{text}\n"),
            text.replace("- urn", "urn"),
            text.replace("localhost wants", " wants"),
        ] {
            assert!(
                matches!(parse_siwe(&bad), Err(AuthError::MalformedChallenge(_))),
                "{bad:?}"
            );
        }
    }

    /// Nonces are 32 lower-case hex and distinct.
    #[test]
    fn nonces() {
        let a = new_siwe_nonce().unwrap();
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|b| b.is_ascii_alphanumeric()));
        assert_ne!(a, new_siwe_nonce().unwrap());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// The parser and the recovery never panic on arbitrary input.
        #[test]
        fn never_panics(s in ".{0,300}", sig in "[0-9a-fx]{0,140}") {
            let _ = parse_siwe(&s);
            let _ = recover_address(s.as_bytes(), &sig);
            let _ = normalize_evm_address(&s);
        }
    }
}
