//! API keys: `mg_<sk|rk>_<base62 of 24 random bytes>_<base62 CRC32>`.
//!
//! The CRC32 (over everything before the last `_`) lets a client or the
//! gateway reject a mistyped key without a store lookup. The node stores
//! only `hash(server_secret, key)`; `key_id` of that hash is the short
//! public id used in list and revoke URLs.

use std::fmt;

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use super::error::{AuthError, Result};

/// Default API key lifetime, in days.
pub const API_KEY_DEFAULT_TTL_DAYS: u64 = 90;
/// Longest API key lifetime allowed, in days.
pub const API_KEY_MAX_TTL_DAYS: u64 = 365;

const PREFIX: &str = "mg_";
const RANDOM_LEN: usize = 24;
/// 62^33 > 2^192 > 62^32: 24 bytes always fit in 33 base62 digits.
const BODY_LEN: usize = 33;
/// 62^6 > 2^32 > 62^5.
const CRC_LEN: usize = 6;
/// `mg_` + `sk` + `_` + body + `_` + crc.
const KEY_LEN: usize = PREFIX.len() + 2 + 1 + BODY_LEN + 1 + CRC_LEN;

const ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
/// Each byte's value as a base62 digit, or `NOT_DIGIT`: one load per
/// character where a scan of the alphabet took up to 62 compares (every
/// request with an API key parses one).
const DIGITS: [u8; 256] = {
    let mut t = [NOT_DIGIT; 256];
    let mut i = 0;
    while i < ALPHABET.len() {
        t[ALPHABET[i] as usize] = i as u8;
        i += 1;
    }
    t
};
/// Marks a byte that is not a base62 digit in [`DIGITS`].
const NOT_DIGIT: u8 = u8::MAX;

/// Which plane a key is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyKind {
    /// `sk`: control plane (deploy, manage keys, ...).
    Secret,
    /// `rk`: data plane (invoke, publish, KV), safe to embed in a runtime.
    Runtime,
}

impl KeyKind {
    /// The two-letter tag in the key.
    pub fn tag(self) -> &'static str {
        match self {
            KeyKind::Secret => "sk",
            KeyKind::Runtime => "rk",
        }
    }

    fn from_tag(tag: &str) -> Option<Self> {
        match tag {
            "sk" => Some(KeyKind::Secret),
            "rk" => Some(KeyKind::Runtime),
            _ => None,
        }
    }
}

impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.tag())
    }
}

/// A key whose shape and checksum are right (not yet looked up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedKey {
    /// The plane the key is for.
    pub kind: KeyKind,
    /// The whole key, as given; hash this for the lookup.
    pub key: String,
}

/// A new random key of `kind`. Fails only if the system random
/// generator does.
pub fn generate(kind: KeyKind) -> Result<String> {
    let mut bytes = [0u8; RANDOM_LEN];
    SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| AuthError::Random)?;
    let mut key = String::with_capacity(KEY_LEN);
    key.push_str(PREFIX);
    key.push_str(kind.tag());
    key.push('_');
    key.push_str(&base62_encode(&bytes, BODY_LEN));
    let crc = checksum(&key);
    key.push('_');
    key.push_str(&crc);
    Ok(key)
}

/// Whether `s` looks like an API key rather than a JWT (cheap prefix
/// test for the `Authorization: Bearer` dispatch).
pub fn is_api_key_shaped(s: &str) -> bool {
    s.starts_with(PREFIX)
}

/// Checks shape, then checksum, without any lookup.
pub fn parse(s: &str) -> Result<ParsedKey> {
    if s.len() != KEY_LEN || !s.is_ascii() {
        return Err(AuthError::MalformedKey("wrong length"));
    }
    let Some(rest) = s.strip_prefix(PREFIX) else {
        return Err(AuthError::MalformedKey("must start with mg_"));
    };
    let kind =
        KeyKind::from_tag(&rest[..2]).ok_or(AuthError::MalformedKey("kind must be sk or rk"))?;
    let rest = &rest[2..];
    let bytes = rest.as_bytes();
    if bytes[0] != b'_' || bytes[1 + BODY_LEN] != b'_' {
        return Err(AuthError::MalformedKey("misplaced separator"));
    }
    let body = &rest[1..1 + BODY_LEN];
    let crc = &rest[2 + BODY_LEN..];
    // The body is RANDOM_LEN bytes in base62: digits only, at most the
    // largest such number. ALPHABET is in ASCII order, so between strings of
    // digits of one length the byte order is the numeric order (no decode
    // per request; a test holds this to `base62_decode`).
    if !is_base62(body) || body.as_bytes() > largest_body() {
        return Err(AuthError::MalformedKey("body is not base62"));
    }
    if !is_base62(crc) {
        return Err(AuthError::MalformedKey("checksum is not base62"));
    }
    let signed = &s[..s.len() - CRC_LEN - 1];
    // CRC_LEN digits hold any u32 one way only, so comparing numbers is
    // comparing `checksum(signed)` with `crc`, without building the string.
    let stated = crc
        .bytes()
        .fold(0u64, |n, b| n * 62 + u64::from(DIGITS[usize::from(b)]));
    if stated != u64::from(crc32fast::hash(signed.as_bytes())) {
        return Err(AuthError::BadChecksum);
    }
    Ok(ParsedKey {
        kind,
        key: s.to_owned(),
    })
}

/// HMAC-SHA256(server secret, key): the only form a key is stored in.
pub fn hash(server_secret: &[u8], key: &str) -> [u8; 32] {
    hash_with(&hmac::Key::new(hmac::HMAC_SHA256, server_secret), key)
}

/// [`hash`] with the server secret's HMAC key already made (a node keeps
/// one for the checks every request makes).
pub fn hash_with(mac_key: &hmac::Key, key: &str) -> [u8; 32] {
    let tag = hmac::sign(mac_key, key.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(tag.as_ref());
    out
}

/// The short public id of a key: the first 12 hex characters of its hash.
pub fn key_id(hash: &[u8; 32]) -> String {
    hex::encode(&hash[..6])
}

fn checksum(s: &str) -> String {
    base62_encode(&crc32fast::hash(s.as_bytes()).to_be_bytes(), CRC_LEN)
}

/// Whether every byte of `s` is a base62 digit.
fn is_base62(s: &str) -> bool {
    s.bytes().all(|b| DIGITS[usize::from(b)] != NOT_DIGIT)
}

/// The largest body: RANDOM_LEN bytes of 0xff in BODY_LEN digits.
fn largest_body() -> &'static [u8] {
    static LARGEST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    LARGEST
        .get_or_init(|| base62_encode(&[0xff; RANDOM_LEN], BODY_LEN))
        .as_bytes()
}

/// Big-endian base62, left-padded with `0` to `width` digits.
fn base62_encode(bytes: &[u8], width: usize) -> String {
    let mut num = bytes.to_vec();
    let mut digits = Vec::with_capacity(width);
    while num.iter().any(|&b| b != 0) {
        let mut rem = 0u32;
        for b in num.iter_mut() {
            let acc = (rem << 8) | u32::from(*b);
            *b = (acc / 62) as u8;
            rem = acc % 62;
        }
        digits.push(ALPHABET[rem as usize]);
    }
    while digits.len() < width {
        digits.push(b'0');
    }
    digits.reverse();
    digits.into_iter().map(char::from).collect()
}

/// Inverse of `base62_encode`; `None` on a foreign character or a value
/// that does not fit in `N` bytes.
#[cfg(test)]
fn base62_decode<const N: usize>(s: &str) -> Option<[u8; N]> {
    let mut out = [0u8; N];
    for c in s.bytes() {
        let d = DIGITS[usize::from(c)];
        if d == NOT_DIGIT {
            return None;
        }
        let d = u32::from(d);
        let mut carry = d;
        for b in out.iter_mut().rev() {
            let acc = u32::from(*b) * 62 + carry;
            *b = acc as u8;
            carry = acc >> 8;
        }
        if carry != 0 {
            return None;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A generated key parses back with its kind.
    #[test]
    fn generated_keys_parse() {
        for kind in [KeyKind::Secret, KeyKind::Runtime] {
            let k = generate(kind).unwrap();
            assert_eq!(k.len(), KEY_LEN);
            assert!(k.starts_with(&format!("mg_{}_", kind.tag())));
            let p = parse(&k).unwrap();
            assert_eq!(p.kind, kind);
            assert_eq!(p.key, k);
        }
    }

    /// The example in `docs/auth.md` (made by an independent script) parses.
    #[test]
    fn docs_example_parses() {
        let k = "mg_sk_04crZ4GhdmAq6HqrSj93MQXrOIprIhWsT_45jvuC";
        assert_eq!(parse(k).unwrap().kind, KeyKind::Secret);
    }

    /// Two keys differ.
    #[test]
    fn keys_are_random() {
        assert_ne!(
            generate(KeyKind::Secret).unwrap(),
            generate(KeyKind::Secret).unwrap()
        );
    }

    /// A single mistyped character in the body is caught by the checksum.
    #[test]
    fn typo_is_bad_checksum() {
        let k = generate(KeyKind::Runtime).unwrap();
        let mut b = k.into_bytes();
        b[10] = if b[10] == b'a' { b'b' } else { b'a' };
        let typo = String::from_utf8(b).unwrap();
        assert!(matches!(parse(&typo), Err(AuthError::BadChecksum)));
    }

    /// A tampered checksum is also `BadChecksum`.
    #[test]
    fn tampered_crc_is_bad_checksum() {
        let k = generate(KeyKind::Secret).unwrap();
        let mut b = k.into_bytes();
        let last = b.len() - 1;
        b[last] = if b[last] == b'0' { b'1' } else { b'0' };
        assert!(matches!(
            parse(&String::from_utf8(b).unwrap()),
            Err(AuthError::BadChecksum)
        ));
    }

    /// Wrong shapes are `MalformedKey`, not `BadChecksum`.
    #[test]
    fn wrong_shapes_are_malformed() {
        let k = generate(KeyKind::Secret).unwrap();
        let cases = [
            String::new(),
            "mg_sk_".into(),
            k.replacen("mg_", "mx_", 1),
            k.replacen("_sk_", "_xk_", 1),
            format!("{k}0"),
            k[..k.len() - 1].to_string(),
            k.replacen('_', "-", 3),
            // 33 base62 digits that overflow 24 bytes.
            {
                let body = "z".repeat(BODY_LEN);
                let head = format!("mg_sk_{body}");
                format!("{head}_{}", checksum(&head))
            },
            k.replace(&k[7..8], "é"),
        ];
        for c in cases {
            assert!(
                matches!(parse(&c), Err(AuthError::MalformedKey(_))),
                "{c:?} -> {:?}",
                parse(&c)
            );
        }
    }

    /// The hash depends on the server secret; the id is 12 hex characters.
    #[test]
    fn hash_and_id() {
        let k = generate(KeyKind::Secret).unwrap();
        let h1 = hash(b"secret-1", &k);
        assert_eq!(h1, hash(b"secret-1", &k));
        assert_ne!(h1, hash(b"secret-2", &k));
        let id = key_id(&h1);
        assert_eq!(id.len(), 12);
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    /// base62 round-trips, with and without leading zero bytes.
    #[test]
    fn base62_round_trip() {
        for bytes in [[0u8; 24], [255u8; 24], {
            let mut b = [0u8; 24];
            b[23] = 61;
            b
        }] {
            let s = base62_encode(&bytes, BODY_LEN);
            assert_eq!(s.len(), BODY_LEN);
            assert_eq!(base62_decode::<24>(&s), Some(bytes));
        }
        assert_eq!(
            base62_encode(&u32::MAX.to_be_bytes(), CRC_LEN).len(),
            CRC_LEN
        );
    }

    proptest! {
        // Parsers of untrusted bytes: thousands of generated inputs each.
        #![proptest_config(ProptestConfig::with_cases(3000))]
        /// `parse` never panics on arbitrary input.
        #[test]
        fn parse_never_panics(s in ".{0,80}") {
            let _ = parse(&s);
        }

        /// `parse` never panics on near-keys of the right length.
        #[test]
        fn parse_near_keys(s in "mg_[sr]k_[0-9A-Za-z_é]{33}_[0-9A-Za-z]{6}") {
            let _ = parse(&s);
        }

        /// `parse`'s body check (digits, then byte order against the largest
        /// body) accepts exactly the bodies that decode to 24 bytes, near the
        /// largest one as well as anywhere.
        #[test]
        fn the_body_check_is_the_decode(
            body in prop_oneof![
                "[0-9A-Za-z]{33}",
                "[0-9A-Za-z_]{33}",
                "[0-9A-Za-z]{1}".prop_map(|t| {
                    let mut b = largest_body().to_vec();
                    b[32] = t.as_bytes()[0];
                    String::from_utf8(b).unwrap()
                }),
                "[0-9A-Za-z]{2}".prop_map(|t| {
                    let mut b = largest_body().to_vec();
                    b[5] = t.as_bytes()[0];
                    b[6] = t.as_bytes()[1];
                    String::from_utf8(b).unwrap()
                }),
            ]
        ) {
            let fits = is_base62(&body) && body.as_bytes() <= largest_body();
            prop_assert_eq!(fits, base62_decode::<24>(&body).is_some(), "{}", body);
        }

        /// A key with any checksum digits parses exactly when they are the
        /// checksum's string (`checksum`), and a generated key always does.
        #[test]
        fn the_checksum_check_is_the_string_compare(
            crc in "[0-9A-Za-z]{6}",
            random in proptest::array::uniform24(any::<u8>()),
        ) {
            let signed = format!("mg_rk_{}", base62_encode(&random, BODY_LEN));
            let right = checksum(&signed);
            let key = format!("{signed}_{crc}");
            prop_assert_eq!(parse(&key).is_ok(), crc == right);
            let good = format!("{signed}_{right}");
            prop_assert!(parse(&good).is_ok());
        }

        /// base62 round-trips any 24 bytes.
        #[test]
        fn base62_any(bytes in proptest::array::uniform24(any::<u8>())) {
            let s = base62_encode(&bytes, BODY_LEN);
            prop_assert_eq!(s.len(), BODY_LEN);
            prop_assert_eq!(base62_decode::<24>(&s), Some(bytes));
        }
    }
}
