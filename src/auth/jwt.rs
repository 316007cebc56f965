//! EdDSA (Ed25519) JSON Web Tokens, written by hand on `ring`.
//!
//! Only `alg: EdDSA` is accepted, and only with a `kid` naming one of the
//! keys this node verifies with: that closes `alg: none` and the
//! HS256-with-the-public-key confusion by construction.

use std::fs::{self, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::digest;
use ring::rand::{SecureRandom, SystemRandom};
use ring::signature::{self, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use serde::{Deserialize, Serialize};

use super::error::{AuthError, Result, TokenPart};

/// Lifetime of an access token, in seconds (15 minutes).
pub const ACCESS_TOKEN_TTL: u64 = 15 * 60;
/// Clock skew tolerated on `exp`, `nbf` and `iat`, in seconds.
pub const JWT_LEEWAY: u64 = 60;
/// Longest token accepted, in bytes; longer input is refused unparsed.
pub const MAX_TOKEN_LEN: usize = 16 * 1024;

const ALG: &str = "EdDSA";

/// The claims of a meshgate access token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claims {
    /// Issuer: the node's `server.public_url`; checked on verify.
    pub iss: String,
    /// Audience: also `server.public_url`; checked on verify.
    pub aud: String,
    /// Subject: `key:<key id>` or `wallet:<address>`, whoever the token was issued to.
    pub sub: String,
    /// Issued at, unix seconds.
    pub iat: u64,
    /// Not before, unix seconds.
    pub nbf: u64,
    /// Expires at, unix seconds.
    pub exp: u64,
    /// Unique token id.
    pub jti: String,
    /// The namespace the token is for.
    pub namespace: String,
    /// Grant strings (`domain:action:resource`).
    pub grants: Vec<String>,
    /// Claims added by the namespace's claims provider (`null` if none).
    #[serde(default)]
    pub custom: serde_json::Value,
    /// The namespace's own role a wallet sign-in was issued as (`wallet`
    /// unless its owner named another); absent on other tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The device the sign-in named (`device_id`); absent when it named none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub did: Option<String>,
    /// The session: minted per sign-in, kept across refreshes; ending it
    /// (`DELETE /v1/auth/sessions/{sid}`) refuses the token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sid: Option<String>,
}

impl Claims {
    /// Claims issued `now`, valid for [`ACCESS_TOKEN_TTL`], with a random `jti`.
    pub fn new(
        iss: &str,
        aud: &str,
        sub: &str,
        namespace: &str,
        grants: Vec<String>,
        now: u64,
    ) -> Result<Self> {
        Ok(Claims {
            iss: iss.to_owned(),
            aud: aud.to_owned(),
            sub: sub.to_owned(),
            iat: now,
            nbf: now,
            exp: now + ACCESS_TOKEN_TTL,
            jti: random_id()?,
            namespace: namespace.to_owned(),
            grants,
            custom: serde_json::Value::Null,
            role: None,
            did: None,
            sid: None,
        })
    }
}

/// The JOSE header fields a verify reads.
#[derive(Deserialize)]
struct Header {
    /// Must be `EdDSA`; anything else is refused before the signature is looked at.
    alg: String,
    /// Which key signed the token; required to pick the verifier.
    #[serde(default)]
    kid: Option<String>,
}

/// A public key tokens are accepted from.
struct VerifyingKey {
    /// Its [`kid_for`] id.
    kid: String,
    /// The raw Ed25519 public key.
    public: Vec<u8>,
}

/// The node's signing key plus every key it still accepts.
pub struct JwtKeys {
    /// Signs every new token.
    signer: Ed25519KeyPair,
    /// The signer's id, put in each token's header.
    kid: String,
    /// The signer's public key first, then previous ones.
    verifiers: Vec<VerifyingKey>,
}

impl std::fmt::Debug for JwtKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kids: Vec<&str> = self.verifiers.iter().map(|v| v.kid.as_str()).collect();
        f.debug_struct("JwtKeys")
            .field("kid", &self.kid)
            .field("verifiers", &kids)
            .finish()
    }
}

/// `ed_` + the first 16 hex characters of SHA-256(raw public key).
pub fn kid_for(public_key: &[u8]) -> String {
    let d = digest::digest(&digest::SHA256, public_key);
    format!("ed_{}", hex::encode(&d.as_ref()[..8]))
}

impl JwtKeys {
    /// Keys from an Ed25519 PKCS#8 v2 document.
    pub fn from_pkcs8(der: &[u8]) -> Result<Self> {
        let signer =
            Ed25519KeyPair::from_pkcs8(der).map_err(|e| AuthError::BadKey(e.to_string()))?;
        let public = signer.public_key().as_ref().to_vec();
        let kid = kid_for(&public);
        Ok(JwtKeys {
            signer,
            verifiers: vec![VerifyingKey {
                kid: kid.clone(),
                public,
            }],
            kid,
        })
    }

    /// A fresh key pair, kept only in memory (tests, benches); returns
    /// the PKCS#8 document too so a caller can persist it.
    pub fn generate() -> Result<(Self, Vec<u8>)> {
        let der =
            Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).map_err(|_| AuthError::Random)?;
        let der = der.as_ref().to_vec();
        Ok((Self::from_pkcs8(&der)?, der))
    }

    /// Loads the PKCS#8 key at `path`, or generates one and writes it
    /// there with mode 0600. The write goes to a temporary file that is
    /// then hard-linked into place, so a crash never leaves half a key and
    /// two processes starting at once end up with the same key.
    pub fn load_or_generate(path: &Path) -> Result<Self> {
        let io_err = |source| AuthError::KeyFile {
            path: path.display().to_string(),
            source,
        };
        match fs::read(path) {
            Ok(der) => return Self::from_pkcs8(&der),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(e)),
        }
        let (keys, der) = Self::generate()?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir).map_err(io_err)?;
        }
        let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
        tmp_name.push(format!(".{}.tmp", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let written = (|| {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&der)?;
            f.sync_all()?;
            fs::hard_link(&tmp, path)
        })();
        let _ = fs::remove_file(&tmp);
        match written {
            Ok(()) => Ok(keys),
            // Another process won the race: use its key.
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                let der = fs::read(path).map_err(io_err)?;
                Self::from_pkcs8(&der)
            }
            Err(e) => Err(io_err(e)),
        }
    }

    /// Also accept tokens signed by this raw 32-byte Ed25519 public key
    /// (a previous signer, or another node's). Returns its `kid`.
    pub fn add_verifying_key(&mut self, public_key: &[u8]) -> Result<String> {
        if public_key.len() != 32 {
            return Err(AuthError::BadKey(
                "an Ed25519 public key is 32 bytes".into(),
            ));
        }
        let kid = kid_for(public_key);
        if !self.verifiers.iter().any(|v| v.kid == kid) {
            self.verifiers.push(VerifyingKey {
                kid: kid.clone(),
                public: public_key.to_vec(),
            });
        }
        Ok(kid)
    }

    /// Starts signing with a new key; the old one stays a verifier.
    /// Returns the new PKCS#8 document for the caller to persist.
    pub fn rotate(&mut self) -> Result<Vec<u8>> {
        let (next, der) = Self::generate()?;
        self.signer = next.signer;
        self.kid = next.kid;
        let new_kid = self.kid.clone();
        let mut verifiers = next.verifiers;
        verifiers.extend(self.verifiers.drain(..).filter(|v| v.kid != new_kid));
        self.verifiers = verifiers;
        Ok(der)
    }

    /// The `kid` of the current signing key.
    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// The raw public key of the current signer.
    pub fn public_key(&self) -> &[u8] {
        self.signer.public_key().as_ref()
    }

    /// A signed compact JWT with header `{"alg":"EdDSA","typ":"JWT","kid":...}`.
    pub fn sign(&self, claims: &Claims) -> String {
        let payload = serde_json::to_vec(claims).expect("claims always serialize");
        self.sign_raw(&payload)
    }

    /// Signs an arbitrary payload (tests need tokens whose payload is not
    /// valid claims but whose signature is good).
    fn sign_raw(&self, payload: &[u8]) -> String {
        let header = serde_json::json!({"alg": ALG, "typ": "JWT", "kid": self.kid});
        let mut token = URL_SAFE_NO_PAD.encode(header.to_string());
        token.push('.');
        token.push_str(&URL_SAFE_NO_PAD.encode(payload));
        let sig = self.signer.sign(token.as_bytes());
        token.push('.');
        token.push_str(&URL_SAFE_NO_PAD.encode(sig.as_ref()));
        token
    }

    /// Verifies `token` at `now` for the expected issuer and audience.
    ///
    /// Checks, in order: shape, encoding, header JSON, `alg`, `kid`,
    /// signature, claims JSON, `exp`, `nbf`, `iat` (±[`JWT_LEEWAY`]),
    /// `iss`, `aud`. The payload is parsed only after the signature holds.
    pub fn verify(
        &self,
        token: &str,
        now: u64,
        expected_iss: &str,
        expected_aud: &str,
    ) -> Result<Claims> {
        if token.len() > MAX_TOKEN_LEN {
            return Err(AuthError::MalformedToken("token too long"));
        }
        let mut parts = token.split('.');
        let (Some(h64), Some(p64), Some(s64), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(AuthError::MalformedToken(
                "expected three dot-separated parts",
            ));
        };
        let decode = |s: &str, part| {
            URL_SAFE_NO_PAD
                .decode(s)
                .map_err(|_| AuthError::TokenEncoding(part))
        };
        let header = decode(h64, TokenPart::Header)?;
        let payload = decode(p64, TokenPart::Payload)?;
        let sig = decode(s64, TokenPart::Signature)?;

        let header: Header = serde_json::from_slice(&header).map_err(|e| AuthError::TokenJson {
            part: TokenPart::Header,
            reason: e.to_string(),
        })?;
        if header.alg != ALG {
            return Err(AuthError::UnsupportedAlg(
                header.alg.chars().take(16).collect(),
            ));
        }
        let kid = header.kid.ok_or(AuthError::MissingKid)?;
        let key = self
            .verifiers
            .iter()
            .find(|v| v.kid == kid)
            .ok_or_else(|| AuthError::UnknownKid(kid.chars().take(32).collect()))?;
        let signed = &token[..h64.len() + 1 + p64.len()];
        UnparsedPublicKey::new(&signature::ED25519, &key.public)
            .verify(signed.as_bytes(), &sig)
            .map_err(|_| AuthError::BadSignature)?;

        let claims: Claims =
            serde_json::from_slice(&payload).map_err(|e| AuthError::TokenJson {
                part: TokenPart::Payload,
                reason: e.to_string(),
            })?;
        if now > claims.exp.saturating_add(JWT_LEEWAY) {
            return Err(AuthError::TokenExpired);
        }
        if claims.nbf > now.saturating_add(JWT_LEEWAY) {
            return Err(AuthError::TokenNotYetValid);
        }
        if claims.iat > now.saturating_add(JWT_LEEWAY) {
            return Err(AuthError::TokenIssuedInFuture);
        }
        if claims.iss != expected_iss {
            return Err(AuthError::WrongIssuer);
        }
        if claims.aud != expected_aud {
            return Err(AuthError::WrongAudience);
        }
        Ok(claims)
    }

    /// The JWKS document of every verifying key, current signer first.
    pub fn jwks(&self) -> serde_json::Value {
        let keys: Vec<_> = self
            .verifiers
            .iter()
            .map(|v| {
                serde_json::json!({
                    "kty": "OKP",
                    "crv": "Ed25519",
                    "x": URL_SAFE_NO_PAD.encode(&v.public),
                    "kid": v.kid,
                    "alg": ALG,
                    "use": "sig",
                })
            })
            .collect();
        serde_json::json!({ "keys": keys })
    }
}

/// 16 random bytes as hex: token ids.
fn random_id() -> Result<String> {
    let mut b = [0u8; 16];
    SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| AuthError::Random)?;
    Ok(hex::encode(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use ring::hmac;

    const ISS: &str = "meshgate";
    const AUD: &str = "meshgate-api";
    const NOW: u64 = 1_700_000_000;

    fn keys() -> JwtKeys {
        JwtKeys::generate().unwrap().0
    }

    fn claims() -> Claims {
        let mut c =
            Claims::new(ISS, AUD, "key_abc", "acme", vec!["kv:read:*".into()], NOW).unwrap();
        c.custom = serde_json::json!({"tier": "gold"});
        c
    }

    fn b64(s: &str) -> String {
        URL_SAFE_NO_PAD.encode(s)
    }

    fn parts(t: &str) -> Vec<String> {
        t.split('.').map(str::to_owned).collect()
    }

    /// A token signed now verifies now and carries its claims.
    #[test]
    fn round_trip() {
        let k = keys();
        let c = claims();
        let t = k.sign(&c);
        assert_eq!(k.verify(&t, NOW, ISS, AUD).unwrap(), c);
        let h: serde_json::Value =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(&parts(&t)[0]).unwrap()).unwrap();
        assert_eq!(
            h,
            serde_json::json!({"alg":"EdDSA","typ":"JWT","kid":k.kid()})
        );
        assert_eq!(c.exp - c.iat, ACCESS_TOKEN_TTL);
    }

    /// The kid is `ed_` + 16 hex characters of SHA-256(public key).
    #[test]
    fn kid_shape() {
        let k = keys();
        assert_eq!(k.kid().len(), 19);
        assert!(k.kid().starts_with("ed_"));
        let d = digest::digest(&digest::SHA256, k.public_key());
        assert_eq!(&k.kid()[3..], &hex::encode(d.as_ref())[..16]);
    }

    /// Not three parts.
    #[test]
    fn wrong_part_count() {
        let k = keys();
        let t = k.sign(&claims());
        for bad in [String::new(), "a.b".into(), format!("{t}.x"), "...".into()] {
            let e = k.verify(&bad, NOW, ISS, AUD).unwrap_err();
            assert!(
                matches!(
                    e,
                    AuthError::MalformedToken(_)
                        | AuthError::TokenEncoding(_)
                        | AuthError::TokenJson { .. }
                ),
                "{bad:?}: {e:?}"
            );
        }
        assert!(matches!(
            k.verify("a.b", NOW, ISS, AUD),
            Err(AuthError::MalformedToken(_))
        ));
        assert!(matches!(
            k.verify(&format!("{t}.x"), NOW, ISS, AUD),
            Err(AuthError::MalformedToken(_))
        ));
        assert!(matches!(
            k.verify(&"a".repeat(MAX_TOKEN_LEN + 1), NOW, ISS, AUD),
            Err(AuthError::MalformedToken(_))
        ));
    }

    /// Each part with bad base64 is reported for that part.
    #[test]
    fn bad_base64_each_part() {
        let k = keys();
        let p = parts(&k.sign(&claims()));
        let cases = [
            (format!("{}!.{}.{}", p[0], p[1], p[2]), TokenPart::Header),
            (format!("{}.{}*.{}", p[0], p[1], p[2]), TokenPart::Payload),
            (format!("{}.{}.{}=", p[0], p[1], p[2]), TokenPart::Signature),
            (
                format!("{}.{}.+{}", p[0], p[1], &p[2][1..]),
                TokenPart::Signature,
            ),
        ];
        for (t, part) in cases {
            match k.verify(&t, NOW, ISS, AUD) {
                Err(AuthError::TokenEncoding(got)) if got == part => {}
                other => panic!("{part}: {other:?}"),
            }
        }
    }

    /// A header that is not JSON, or JSON without `alg`.
    #[test]
    fn bad_header_json() {
        let k = keys();
        let p = parts(&k.sign(&claims()));
        for h in ["not json", "{\"kid\":\"x\"}", "[]", "{\"alg\":5}"] {
            let t = format!("{}.{}.{}", b64(h), p[1], p[2]);
            assert!(
                matches!(
                    k.verify(&t, NOW, ISS, AUD),
                    Err(AuthError::TokenJson {
                        part: TokenPart::Header,
                        ..
                    })
                ),
                "{h}"
            );
        }
    }

    /// A correctly signed payload that is not valid claims JSON.
    #[test]
    fn bad_payload_json() {
        let k = keys();
        for p in [&b"not json"[..], b"{}", b"{\"sub\":1}"] {
            let t = k.sign_raw(p);
            assert!(matches!(
                k.verify(&t, NOW, ISS, AUD),
                Err(AuthError::TokenJson {
                    part: TokenPart::Payload,
                    ..
                })
            ));
        }
    }

    /// `alg: none` with an empty signature is refused before any key use.
    #[test]
    fn alg_none() {
        let k = keys();
        let p = parts(&k.sign(&claims()));
        let h = format!(r#"{{"alg":"none","typ":"JWT","kid":"{}"}}"#, k.kid());
        for t in [
            format!("{}.{}.", b64(&h), p[1]),
            format!("{}.{}.{}", b64(&h), p[1], p[2]),
        ] {
            assert!(
                matches!(k.verify(&t, NOW, ISS, AUD), Err(AuthError::UnsupportedAlg(a)) if a == "none")
            );
        }
    }

    /// HS256 signed with the public key bytes as the HMAC key (the classic
    /// algorithm-confusion attack) is refused.
    #[test]
    fn hs256_with_public_key() {
        let k = keys();
        let p = parts(&k.sign(&claims()));
        let h = format!(r#"{{"alg":"HS256","typ":"JWT","kid":"{}"}}"#, k.kid());
        let signed = format!("{}.{}", b64(&h), p[1]);
        let mac = hmac::sign(
            &hmac::Key::new(hmac::HMAC_SHA256, k.public_key()),
            signed.as_bytes(),
        );
        let t = format!("{signed}.{}", URL_SAFE_NO_PAD.encode(mac.as_ref()));
        assert!(
            matches!(k.verify(&t, NOW, ISS, AUD), Err(AuthError::UnsupportedAlg(a)) if a == "HS256")
        );
    }

    /// Missing and unknown `kid`.
    #[test]
    fn kid_missing_or_unknown() {
        let k = keys();
        let p = parts(&k.sign(&claims()));
        let t = format!(
            "{}.{}.{}",
            b64(r#"{"alg":"EdDSA","typ":"JWT"}"#),
            p[1],
            p[2]
        );
        assert!(matches!(
            k.verify(&t, NOW, ISS, AUD),
            Err(AuthError::MissingKid)
        ));
        let t = format!(
            "{}.{}.{}",
            b64(r#"{"alg":"EdDSA","kid":"ed_0000000000000000"}"#),
            p[1],
            p[2]
        );
        assert!(matches!(
            k.verify(&t, NOW, ISS, AUD),
            Err(AuthError::UnknownKid(_))
        ));
        // A token from another node's key is an unknown kid here.
        let other = keys().sign(&claims());
        assert!(matches!(
            k.verify(&other, NOW, ISS, AUD),
            Err(AuthError::UnknownKid(_))
        ));
    }

    /// Changing one claim breaks the signature.
    #[test]
    fn tampered_payload() {
        let k = keys();
        let p = parts(&k.sign(&claims()));
        let mut c = claims();
        c.grants = vec!["*:*:*".into()];
        let forged = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&c).unwrap());
        let t = format!("{}.{}.{}", p[0], forged, p[2]);
        assert!(matches!(
            k.verify(&t, NOW, ISS, AUD),
            Err(AuthError::BadSignature)
        ));
        // A truncated signature too.
        let t = format!("{}.{}.{}", p[0], p[1], &p[2][..20]);
        assert!(matches!(
            k.verify(&t, NOW, ISS, AUD),
            Err(AuthError::BadSignature)
        ));
    }

    /// `exp` is honoured up to the leeway and not one second more.
    #[test]
    fn expiry_and_leeway() {
        let k = keys();
        let c = claims();
        let t = k.sign(&c);
        assert!(k.verify(&t, c.exp, ISS, AUD).is_ok());
        assert!(k.verify(&t, c.exp + JWT_LEEWAY, ISS, AUD).is_ok());
        assert!(matches!(
            k.verify(&t, c.exp + JWT_LEEWAY + 1, ISS, AUD),
            Err(AuthError::TokenExpired)
        ));
    }

    /// `nbf` and `iat` in the future are refused beyond the leeway.
    #[test]
    fn not_yet_valid_and_future_iat() {
        let k = keys();
        let mut c = claims();
        c.nbf = NOW + 300;
        let t = k.sign(&c);
        assert!(matches!(
            k.verify(&t, NOW, ISS, AUD),
            Err(AuthError::TokenNotYetValid)
        ));
        assert!(matches!(
            k.verify(&t, NOW + 239, ISS, AUD),
            Err(AuthError::TokenNotYetValid)
        ));
        assert!(k.verify(&t, NOW + 240, ISS, AUD).is_ok());

        let mut c = claims();
        c.iat = NOW + JWT_LEEWAY + 1;
        let t = k.sign(&c);
        assert!(matches!(
            k.verify(&t, NOW, ISS, AUD),
            Err(AuthError::TokenIssuedInFuture)
        ));
        c.iat = NOW + JWT_LEEWAY;
        assert!(k.verify(&k.sign(&c), NOW, ISS, AUD).is_ok());
    }

    /// Wrong issuer and wrong audience.
    #[test]
    fn wrong_iss_aud() {
        let k = keys();
        let t = k.sign(&claims());
        assert!(matches!(
            k.verify(&t, NOW, "other", AUD),
            Err(AuthError::WrongIssuer)
        ));
        assert!(matches!(
            k.verify(&t, NOW, ISS, "other"),
            Err(AuthError::WrongAudience)
        ));
    }

    /// After rotation, old tokens still verify; the JWKS lists both keys.
    #[test]
    fn rotation_and_jwks() {
        let mut k = keys();
        let old_kid = k.kid().to_owned();
        let old = k.sign(&claims());
        k.rotate().unwrap();
        assert_ne!(k.kid(), old_kid);
        assert!(k.verify(&old, NOW, ISS, AUD).is_ok());
        assert!(k.verify(&k.sign(&claims()), NOW, ISS, AUD).is_ok());
        let jwks = k.jwks();
        let list = jwks["keys"].as_array().unwrap();
        assert_eq!(list.len(), 2);
        assert_eq!(list[0]["kid"], k.kid());
        assert_eq!(list[1]["kid"], old_kid.as_str());
        assert_eq!(list[0]["kty"], "OKP");
        assert_eq!(list[0]["crv"], "Ed25519");
        assert_eq!(list[0]["alg"], "EdDSA");
        assert_eq!(list[0]["use"], "sig");
        let x = URL_SAFE_NO_PAD
            .decode(list[0]["x"].as_str().unwrap())
            .unwrap();
        assert_eq!(x, k.public_key());
    }

    /// Another node's public key can be added for verification.
    #[test]
    fn add_verifying_key() {
        let mut k = keys();
        let other = keys();
        let t = other.sign(&claims());
        assert_eq!(
            k.add_verifying_key(other.public_key()).unwrap(),
            other.kid()
        );
        assert!(k.verify(&t, NOW, ISS, AUD).is_ok());
        assert!(matches!(
            k.add_verifying_key(&[0; 31]),
            Err(AuthError::BadKey(_))
        ));
    }

    /// The key file is created with mode 0600 and loaded on the next start.
    #[test]
    fn load_or_generate_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("jwt.pk8");
        let a = JwtKeys::load_or_generate(&path).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let b = JwtKeys::load_or_generate(&path).unwrap();
        assert_eq!(a.kid(), b.kid());
        assert_eq!(fs::read_dir(path.parent().unwrap()).unwrap().count(), 1);
        fs::write(&path, b"garbage").unwrap();
        assert!(matches!(
            JwtKeys::load_or_generate(&path),
            Err(AuthError::BadKey(_))
        ));
    }

    proptest! {
        // Parsers of untrusted bytes: thousands of generated inputs each.
        #![proptest_config(ProptestConfig::with_cases(3000))]
        /// `verify` never panics on arbitrary input.
        #[test]
        fn verify_never_panics(s in ".{0,200}") {
            let k = keys();
            let _ = k.verify(&s, NOW, ISS, AUD);
        }

        /// Nor on three base64url parts of arbitrary bytes.
        #[test]
        fn verify_never_panics_on_parts(
            h in proptest::collection::vec(any::<u8>(), 0..64),
            p in proptest::collection::vec(any::<u8>(), 0..64),
            s in proptest::collection::vec(any::<u8>(), 0..80),
        ) {
            let k = keys();
            let t = format!(
                "{}.{}.{}",
                URL_SAFE_NO_PAD.encode(h),
                URL_SAFE_NO_PAD.encode(p),
                URL_SAFE_NO_PAD.encode(s)
            );
            let _ = k.verify(&t, NOW, ISS, AUD);
        }

        /// Nor on a real header with an arbitrary payload and time.
        #[test]
        fn verify_never_panics_on_payload(p in ".{0,100}", now in any::<u64>()) {
            let k = keys();
            let t = k.sign_raw(p.as_bytes());
            let _ = k.verify(&t, now, ISS, AUD);
        }
    }
}
