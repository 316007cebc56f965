//! The cluster hop MAC.
//!
//! A node that forwards a request to another member sends the identity it
//! resolved in `X-Internal-Auth-*` headers and authenticates them with
//! `X-Internal-Auth-MAC: <unix>.<hex>`, an HMAC-SHA256 keyed by
//! HKDF-SHA256(cluster secret, info `internal-auth-hop`) over the
//! newline-joined fields
//!
//! ```text
//! v1: label, method, path, namespace, subject, custom, grants, timestamp
//! v2: label, method, path, namespace, subject, custom, grants, exp, iat, jti, timestamp
//! v3: ... v2 fields ..., exp, iat, jti, device, session, timestamp
//! v4: label, method, path, query, namespace, subject, custom, grants,
//!     exp, iat, jti, device, session, body_sha256, [operator,] timestamp
//! ```
//!
//! The operator's request forwarded by a non-member keeps its operator
//! status: the hop then carries `X-Internal-Auth-Operator: 1` and its MAC
//! covers the word `operator` before the timestamp, so the flag can be
//! neither added to nor removed from a hop on the way (a hop without it
//! MACs exactly as before).
//!
//! (absent optional fields are empty strings; the timestamp is always
//! last). V4 adds the query string and the SHA-256 of the body, which the
//! forwarder also sends as `X-Internal-Auth-Body-SHA256` and the receiver
//! recomputes over the bytes it actually got. The receiver judges a request
//! by the newest MAC it carries, alone, within ±60 s, and believes V4 only
//! ([`HOP_ACCEPTED_VERSION`]): a V1–V3 MAC leaves the query and the body
//! open to change on the way, so it is refused like a wrong one. Older
//! versions can still be produced by [`HopKey::sign`] so that their refusal
//! can be shown.

use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::{digest, hkdf, hmac};

use super::error::{AuthError, Result};
use super::jwt::Claims;

/// How far a MAC's timestamp may be from `now`, in seconds.
pub const HOP_MAC_WINDOW: u64 = 60;
/// The only version [`HopKey::verify`] believes.
pub const HOP_ACCEPTED_VERSION: HopVersion = HopVersion::V4;
/// At most this many MAC values are looked at; more is malformed.
const MAX_MACS: usize = 16;
const HKDF_INFO: &[u8] = b"internal-auth-hop";

/// The target namespace.
pub const HOP_NAMESPACE_HEADER: &str = "X-Internal-Auth-Namespace";
/// The credential's subject.
pub const HOP_SUBJECT_HEADER: &str = "X-Internal-Auth-Subject";
/// The grants, comma-joined.
pub const HOP_GRANTS_HEADER: &str = "X-Internal-Auth-Grants";
/// The custom claims: base64url (no padding) of their canonical JSON.
pub const HOP_CUSTOM_HEADER: &str = "X-Internal-Auth-Custom";
/// The token's `exp` (v2+).
pub const HOP_EXP_HEADER: &str = "X-Internal-Auth-Exp";
/// The token's `iat` (v2+).
pub const HOP_IAT_HEADER: &str = "X-Internal-Auth-Iat";
/// The token's `jti` (v2+).
pub const HOP_JTI_HEADER: &str = "X-Internal-Auth-Jti";
/// The device id (v3+).
pub const HOP_DEVICE_HEADER: &str = "X-Internal-Auth-Device";
/// The session id (v3+).
pub const HOP_SESSION_HEADER: &str = "X-Internal-Auth-Session";
/// Lower-case hex SHA-256 of the request body as the forwarder sent it (v4).
pub const HOP_BODY_SHA256_HEADER: &str = "X-Internal-Auth-Body-SHA256";
/// The version label the sender used (informational; see [`HopKey::verify`]).
/// Present (`1`) when the forwarded credential was the operator key (v4, in the MAC).
pub const HOP_OPERATOR_HEADER: &str = "X-Internal-Auth-Operator";
/// The version of the hop's MAC.
pub const HOP_VERSION_HEADER: &str = "X-Internal-Auth-Version";
/// `<unix>.<64 hex>`.
pub const HOP_MAC_HEADER: &str = "X-Internal-Auth-MAC";
/// Lower-case prefix shared by all of the above: the gate strips every
/// header with it unless the MAC holds.
pub const HOP_HEADER_PREFIX: &str = "x-internal-auth-";
/// Every hop header.
pub const HOP_HEADERS: [&str; 12] = [
    HOP_NAMESPACE_HEADER,
    HOP_SUBJECT_HEADER,
    HOP_GRANTS_HEADER,
    HOP_CUSTOM_HEADER,
    HOP_EXP_HEADER,
    HOP_IAT_HEADER,
    HOP_JTI_HEADER,
    HOP_DEVICE_HEADER,
    HOP_SESSION_HEADER,
    HOP_BODY_SHA256_HEADER,
    HOP_VERSION_HEADER,
    HOP_MAC_HEADER,
];

/// Which fields a MAC covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HopVersion {
    /// The base identity.
    V1,
    /// Adds the token's exp, iat, jti.
    V2,
    /// Adds device and session.
    V3,
    /// Adds the query string and the body's SHA-256.
    V4,
}

impl HopVersion {
    /// `v1` … `v4`.
    pub fn label(self) -> &'static str {
        match self {
            HopVersion::V1 => "v1",
            HopVersion::V2 => "v2",
            HopVersion::V3 => "v3",
            HopVersion::V4 => "v4",
        }
    }

    /// The version of a label.
    pub fn from_label(s: &str) -> Option<Self> {
        match s {
            "v1" => Some(HopVersion::V1),
            "v2" => Some(HopVersion::V2),
            "v3" => Some(HopVersion::V3),
            "v4" => Some(HopVersion::V4),
            _ => None,
        }
    }
}

impl fmt::Display for HopVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// What of the request a MAC covers beside the identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HopRequest<'a> {
    /// The HTTP method.
    pub method: &'a str,
    /// The URI path, as sent.
    pub path: &'a str,
    /// The query string without its `?` (empty if none) (v4).
    pub query: &'a str,
    /// Lower-case hex SHA-256 of the body ([`body_sha256`]) (v4).
    pub body_sha256: &'a str,
}

impl HopRequest<'_> {
    /// A newline would let one field pose as two.
    fn is_macable(&self) -> bool {
        [self.method, self.path, self.query, self.body_sha256]
            .iter()
            .all(|s| !s.contains(['\n', '\r']))
    }
}

/// Lower-case hex SHA-256 of a body, as carried in
/// [`HOP_BODY_SHA256_HEADER`] (an empty body has a digest too).
pub fn body_sha256(body: &[u8]) -> String {
    hex::encode(digest::digest(&digest::SHA256, body).as_ref())
}

/// The identity a forwarding node resolved, as carried in the hop headers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HopIdentity {
    /// The namespace the credential belongs to.
    pub namespace: String,
    /// The credential's subject.
    pub subject: String,
    /// Custom claims as canonical JSON ([`canonical_json`]); empty if none.
    pub custom: String,
    /// Grant strings.
    pub grants: Vec<String>,
    /// The token's `exp` (v2+).
    pub exp: Option<u64>,
    /// The token's `iat` (v2+).
    pub iat: Option<u64>,
    /// The token's `jti` (v2+).
    pub jti: Option<String>,
    /// Device id (v3+).
    pub device: Option<String>,
    /// Session id (v3+).
    pub session: Option<String>,
    /// The credential was the operator key (v4; see the module's doc).
    pub operator: bool,
}

impl HopIdentity {
    /// The identity of a verified JWT (exp, iat and jti set: use v2+).
    pub fn from_claims(claims: &Claims) -> Self {
        HopIdentity {
            namespace: claims.namespace.clone(),
            subject: claims.sub.clone(),
            custom: if claims.custom.is_null() {
                String::new()
            } else {
                canonical_json(&claims.custom)
            },
            grants: claims.grants.clone(),
            exp: Some(claims.exp),
            iat: Some(claims.iat),
            jti: Some(claims.jti.clone()),
            device: None,
            session: None,
            operator: false,
        }
    }

    /// The lowest version whose MAC covers every field that is set. A MAC
    /// of a lower version would leave a present field unauthenticated.
    pub fn min_version(&self) -> HopVersion {
        if self.device.is_some() || self.session.is_some() {
            HopVersion::V3
        } else if self.exp.is_some() || self.iat.is_some() || self.jti.is_some() {
            HopVersion::V2
        } else {
            HopVersion::V1
        }
    }

    /// Newlines would let one field pose as two; commas inside a grant
    /// would do the same to the grant list.
    fn is_macable(&self) -> bool {
        let strs = [
            Some(self.namespace.as_str()),
            Some(self.subject.as_str()),
            Some(self.custom.as_str()),
            self.jti.as_deref(),
            self.device.as_deref(),
            self.session.as_deref(),
        ];
        strs.into_iter()
            .flatten()
            .all(|s| !s.contains(['\n', '\r']))
            && self.grants.iter().all(|g| !g.contains(['\n', '\r', ',']))
    }
}

/// The key both ends of a hop derive from the cluster secret.
#[derive(Clone)]
pub struct HopKey(hmac::Key);

impl fmt::Debug for HopKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HopKey(..)")
    }
}

impl HopKey {
    /// HKDF-SHA256(secret, salt empty, info `internal-auth-hop`). The
    /// secret should be at least 32 random bytes.
    pub fn from_secret(secret: &[u8]) -> Self {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &[]).extract(secret);
        let info = [HKDF_INFO];
        let okm = prk
            .expand(&info, hmac::HMAC_SHA256)
            .expect("32 bytes is a valid HKDF-SHA256 output length");
        HopKey(hmac::Key::from(okm))
    }

    /// The `X-Internal-Auth-MAC` value for this hop at `now`. Versions
    /// before v4 leave `req.query` and `req.body_sha256` out (and are
    /// refused by [`HopKey::verify`]).
    pub fn sign(
        &self,
        version: HopVersion,
        req: &HopRequest,
        id: &HopIdentity,
        now: u64,
    ) -> String {
        let tag = hmac::sign(&self.0, mac_input(version, req, id, now).as_bytes());
        format!("{now}.{}", hex::encode(tag.as_ref()))
    }

    /// Every hop header of a v4 hop for `req` at `now`: what a forwarder
    /// sends.
    pub fn sign_headers(
        &self,
        req: &HopRequest,
        id: &HopIdentity,
        now: u64,
    ) -> Vec<(&'static str, String)> {
        let mac = self.sign(HopVersion::V4, req, id, now);
        to_headers(id, HopVersion::V4, req.body_sha256, &mac)
    }

    /// Judges a request by the newest MAC among all `X-Internal-Auth-MAC`
    /// values (each may itself be a comma-joined list), alone: if it is
    /// bad, an older good one does not help. The MAC must be within
    /// ±[`HOP_MAC_WINDOW`] of `now` and of [`HOP_ACCEPTED_VERSION`] (v4,
    /// which covers every identity field, the query and the body digest):
    /// a MAC of an older version does not match. `req.body_sha256` is the
    /// digest the sender claims; the caller compares it with the body it
    /// received. Returns the version that matched.
    pub fn verify(
        &self,
        header_values: &[&str],
        req: &HopRequest,
        id: &HopIdentity,
        now: u64,
    ) -> Result<HopVersion> {
        let mut macs = Vec::new();
        for part in header_values.iter().flat_map(|v| v.split(',')) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            if macs.len() == MAX_MACS {
                return Err(AuthError::MalformedMac("too many MAC values"));
            }
            macs.push(parse_mac(part)?);
        }
        let newest = macs
            .iter()
            .map(|(ts, _)| *ts)
            .max()
            .ok_or(AuthError::MissingMac)?;
        if now.abs_diff(newest) > HOP_MAC_WINDOW {
            return Err(AuthError::MacExpired);
        }
        if !id.is_macable() || !req.is_macable() {
            return Err(AuthError::MalformedMac(
                "newline or comma in an identity or request field",
            ));
        }
        let version = HOP_ACCEPTED_VERSION;
        let input = mac_input(version, req, id, newest);
        // Several values with the same newest timestamp must all hold.
        for (_, tag) in macs.iter().filter(|(ts, _)| *ts == newest) {
            hmac::verify(&self.0, input.as_bytes(), tag).map_err(|_| AuthError::BadMac)?;
        }
        Ok(version)
    }
}

/// `<unix>.<64 hex>` → (timestamp, tag).
fn parse_mac(s: &str) -> Result<(u64, [u8; 32])> {
    let (ts, tag) = s
        .split_once('.')
        .ok_or(AuthError::MalformedMac("expected <unix>.<hex>"))?;
    if ts.is_empty() || ts.len() > 20 || !ts.bytes().all(|b| b.is_ascii_digit()) {
        return Err(AuthError::MalformedMac("timestamp is not a number"));
    }
    let ts = ts
        .parse()
        .map_err(|_| AuthError::MalformedMac("timestamp out of range"))?;
    let mut out = [0u8; 32];
    hex::decode_to_slice(tag, &mut out)
        .map_err(|_| AuthError::MalformedMac("tag is not 64 hex characters"))?;
    Ok((ts, out))
}

fn mac_input(version: HopVersion, req: &HopRequest, id: &HopIdentity, ts: u64) -> String {
    let num = |n: Option<u64>| n.map(|n| n.to_string()).unwrap_or_default();
    let mut fields: Vec<String> = vec![version.label().into(), req.method.into(), req.path.into()];
    if version >= HopVersion::V4 {
        fields.push(req.query.into());
    }
    fields.extend([
        id.namespace.clone(),
        id.subject.clone(),
        id.custom.clone(),
        id.grants.join(","),
    ]);
    if version >= HopVersion::V2 {
        fields.push(num(id.exp));
        fields.push(num(id.iat));
        fields.push(id.jti.clone().unwrap_or_default());
    }
    if version >= HopVersion::V3 {
        fields.push(id.device.clone().unwrap_or_default());
        fields.push(id.session.clone().unwrap_or_default());
    }
    if version >= HopVersion::V4 {
        fields.push(req.body_sha256.into());
        if id.operator {
            fields.push("operator".into());
        }
    }
    fields.push(ts.to_string());
    fields.join("\n")
}

/// The hop headers for `id` under `version` with the `mac` from
/// [`HopKey::sign`] and, for v4, the body digest it covered. Fields the
/// version does not cover are left out, so the receiver never sees an
/// unauthenticated field.
pub fn to_headers(
    id: &HopIdentity,
    version: HopVersion,
    body_sha256: &str,
    mac: &str,
) -> Vec<(&'static str, String)> {
    let mut h = vec![
        (HOP_NAMESPACE_HEADER, id.namespace.clone()),
        (HOP_SUBJECT_HEADER, id.subject.clone()),
        (HOP_GRANTS_HEADER, id.grants.join(",")),
        (HOP_CUSTOM_HEADER, URL_SAFE_NO_PAD.encode(&id.custom)),
    ];
    if version >= HopVersion::V2 {
        if let Some(exp) = id.exp {
            h.push((HOP_EXP_HEADER, exp.to_string()));
        }
        if let Some(iat) = id.iat {
            h.push((HOP_IAT_HEADER, iat.to_string()));
        }
        if let Some(jti) = &id.jti {
            h.push((HOP_JTI_HEADER, jti.clone()));
        }
    }
    if version >= HopVersion::V3 {
        if let Some(device) = &id.device {
            h.push((HOP_DEVICE_HEADER, device.clone()));
        }
        if let Some(session) = &id.session {
            h.push((HOP_SESSION_HEADER, session.clone()));
        }
    }
    if version >= HopVersion::V4 {
        h.push((HOP_BODY_SHA256_HEADER, body_sha256.into()));
        if id.operator {
            h.push((HOP_OPERATOR_HEADER, "1".into()));
        }
    }
    h.push((HOP_VERSION_HEADER, version.label().into()));
    h.push((HOP_MAC_HEADER, mac.into()));
    h
}

/// Reads an identity back from headers (`get` is a case-insensitive
/// header lookup). `None` if namespace or subject is missing or a field
/// does not decode. Verify the MAC before trusting the result.
pub fn from_headers(get: impl Fn(&str) -> Option<String>) -> Option<HopIdentity> {
    let num = |name| match get(name) {
        None => Some(None),
        Some(v) => v.parse::<u64>().ok().map(Some),
    };
    let custom = match get(HOP_CUSTOM_HEADER) {
        None => String::new(),
        Some(b) => String::from_utf8(URL_SAFE_NO_PAD.decode(b).ok()?).ok()?,
    };
    let grants = get(HOP_GRANTS_HEADER)
        .map(|g| {
            g.split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    Some(HopIdentity {
        namespace: get(HOP_NAMESPACE_HEADER)?,
        subject: get(HOP_SUBJECT_HEADER)?,
        custom,
        grants,
        exp: num(HOP_EXP_HEADER)?,
        iat: num(HOP_IAT_HEADER)?,
        jti: get(HOP_JTI_HEADER),
        device: get(HOP_DEVICE_HEADER),
        session: get(HOP_SESSION_HEADER),
        operator: get(HOP_OPERATOR_HEADER).is_some_and(|v| v == "1"),
    })
}

/// Compact JSON with object keys sorted at every level, so both ends of a
/// hop MAC the same bytes whatever map order serde_json was built with.
pub fn canonical_json(v: &serde_json::Value) -> String {
    use serde_json::Value;
    fn write(v: &Value, out: &mut String) {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String(k.clone()).to_string());
                    out.push(':');
                    write(&m[k], out);
                }
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(x, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    write(v, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    const NOW: u64 = 1_700_000_000;
    const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    fn key() -> HopKey {
        HopKey::from_secret(b"cluster-secret-cluster-secret-32")
    }

    fn id() -> HopIdentity {
        HopIdentity {
            namespace: "acme".into(),
            subject: "key_0123abcd".into(),
            custom: canonical_json(&serde_json::json!({"tier":"gold","a":[1,{"z":1,"b":2}]})),
            grants: vec!["kv:read:*".into(), "pubsub:publish:chat.*".into()],
            ..Default::default()
        }
    }

    fn id_v2() -> HopIdentity {
        HopIdentity {
            exp: Some(1),
            iat: Some(2),
            jti: Some("j".into()),
            ..id()
        }
    }

    fn id_v3() -> HopIdentity {
        HopIdentity {
            exp: Some(NOW + 900),
            iat: Some(NOW),
            jti: Some("j1".into()),
            device: Some("dev-1".into()),
            session: Some("s-1".into()),
            ..id()
        }
    }

    /// A PUT with a query and a body, as a forwarder would sign it.
    fn put(digest: &str) -> HopRequest<'_> {
        HopRequest {
            method: "PUT",
            path: "/v1/kv/x",
            query: "ttl=60&if=none",
            body_sha256: digest,
        }
    }

    fn get(path: &str) -> HopRequest<'_> {
        HopRequest {
            method: "GET",
            path,
            query: "",
            body_sha256: EMPTY_SHA256,
        }
    }

    /// The digest is SHA-256 in lower-case hex (FIPS 180-2 vectors).
    #[test]
    fn body_digest() {
        assert_eq!(body_sha256(b""), EMPTY_SHA256);
        assert_eq!(
            body_sha256(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    /// V4 signs and verifies for every identity shape; the verifier reports V4.
    #[test]
    fn round_trip_v4() {
        let k = key();
        let digest = body_sha256(b"hello");
        for ident in [id(), id_v2(), id_v3()] {
            let mac = k.sign(HopVersion::V4, &put(&digest), &ident, NOW);
            assert!(mac.starts_with(&format!("{NOW}.")));
            assert_eq!(
                k.verify(&[&mac], &put(&digest), &ident, NOW).unwrap(),
                HopVersion::V4
            );
        }
    }

    /// A MAC of v1, v2 or v3, however well made, is refused: they do not
    /// cover the query or the body.
    #[test]
    fn older_versions_refused() {
        let k = key();
        for (v, ident) in [
            (HopVersion::V1, id()),
            (HopVersion::V2, id_v2()),
            (HopVersion::V3, id_v3()),
        ] {
            let mac = k.sign(v, &put(EMPTY_SHA256), &ident, NOW);
            assert!(
                matches!(
                    k.verify(&[&mac], &put(EMPTY_SHA256), &ident, NOW),
                    Err(AuthError::BadMac)
                ),
                "{v}"
            );
        }
        // Nor does an old MAC help beside a newer v4 one that is bad.
        let old = k.sign(HopVersion::V3, &put(EMPTY_SHA256), &id(), NOW);
        let bad = format!("{NOW}.{}", "ab".repeat(32));
        assert!(matches!(
            k.verify(&[&old, &bad], &put(EMPTY_SHA256), &id(), NOW),
            Err(AuthError::BadMac)
        ));
    }

    /// V4 covers every field: the MAC of one request does not verify once
    /// any one of method, path, query, body digest, an identity field or the
    /// timestamp is changed.
    #[test]
    fn v4_covers_every_field() {
        let k = key();
        let digest = body_sha256(b"value");
        let req = put(&digest);
        let ident = id_v3();
        let mac = k.sign(HopVersion::V4, &req, &ident, NOW);
        assert!(k.verify(&[&mac], &req, &ident, NOW).is_ok());

        let other_digest = body_sha256(b"valuE");
        let requests: Vec<(&str, HopRequest)> = vec![
            (
                "method",
                HopRequest {
                    method: "POST",
                    ..req
                },
            ),
            (
                "path",
                HopRequest {
                    path: "/v1/kv/y",
                    ..req
                },
            ),
            (
                "query",
                HopRequest {
                    query: "ttl=61&if=none",
                    ..req
                },
            ),
            ("query dropped", HopRequest { query: "", ..req }),
            (
                "body",
                HopRequest {
                    body_sha256: &other_digest,
                    ..req
                },
            ),
            (
                "body empty",
                HopRequest {
                    body_sha256: EMPTY_SHA256,
                    ..req
                },
            ),
            (
                "body digest missing",
                HopRequest {
                    body_sha256: "",
                    ..req
                },
            ),
        ];
        for (what, r) in requests {
            assert!(
                matches!(k.verify(&[&mac], &r, &ident, NOW), Err(AuthError::BadMac)),
                "{what} altered yet verified"
            );
        }
        type Change = fn(&mut HopIdentity);
        let changes: Vec<(&str, Change)> = vec![
            ("namespace", |i| i.namespace = "evil".into()),
            ("subject", |i| i.subject = "root".into()),
            ("custom", |i| i.custom = "{\"tier\":\"platinum\"}".into()),
            ("grants", |i| i.grants.push("*:*:*".into())),
            ("exp", |i| i.exp = Some(NOW + 99_999)),
            ("iat", |i| i.iat = None),
            ("jti", |i| i.jti = Some("j2".into())),
            ("device", |i| i.device = Some("stolen".into())),
            ("session", |i| i.session = None),
            ("operator", |i| i.operator = true),
        ];
        for (what, change) in changes {
            let mut other = ident.clone();
            change(&mut other);
            assert!(
                matches!(k.verify(&[&mac], &req, &other, NOW), Err(AuthError::BadMac)),
                "{what} altered yet verified"
            );
        }
        // The tag moved to another timestamp.
        let (_, tag) = mac.split_once('.').unwrap();
        let moved = format!("{}.{tag}", NOW + 1);
        assert!(matches!(
            k.verify(&[&moved], &req, &ident, NOW),
            Err(AuthError::BadMac)
        ));
    }

    /// No MAC header, or only empty values.
    #[test]
    fn missing_mac() {
        let k = key();
        assert!(matches!(
            k.verify(&[], &get("/"), &id(), NOW),
            Err(AuthError::MissingMac)
        ));
        assert!(matches!(
            k.verify(&["", " , "], &get("/"), &id(), NOW),
            Err(AuthError::MissingMac)
        ));
    }

    /// Malformed values and wrong tags.
    #[test]
    fn bad_mac() {
        let k = key();
        for bad in [
            "abc",
            "123",
            "x.00",
            &format!("{NOW}.zz"),
            &format!("{NOW}.{}", "0".repeat(63)),
            &format!("-1.{}", "0".repeat(64)),
        ] {
            assert!(
                matches!(
                    k.verify(&[bad], &get("/"), &id(), NOW),
                    Err(AuthError::MalformedMac(_))
                ),
                "{bad}"
            );
        }
        let wrong = format!("{NOW}.{}", "0".repeat(64));
        assert!(matches!(
            k.verify(&[&wrong], &get("/"), &id(), NOW),
            Err(AuthError::BadMac)
        ));
        // Signed by another cluster.
        let other =
            HopKey::from_secret(b"another-secret").sign(HopVersion::V4, &get("/"), &id(), NOW);
        assert!(matches!(
            k.verify(&[&other], &get("/"), &id(), NOW),
            Err(AuthError::BadMac)
        ));
    }

    /// Older than the window, newer than the window, and the edges.
    #[test]
    fn window() {
        let k = key();
        let mac = k.sign(HopVersion::V4, &get("/"), &id(), NOW);
        assert!(k.verify(&[&mac], &get("/"), &id(), NOW + 60).is_ok());
        assert!(k.verify(&[&mac], &get("/"), &id(), NOW - 60).is_ok());
        assert!(matches!(
            k.verify(&[&mac], &get("/"), &id(), NOW + 61),
            Err(AuthError::MacExpired)
        ));
        assert!(matches!(
            k.verify(&[&mac], &get("/"), &id(), NOW - 61),
            Err(AuthError::MacExpired)
        ));
    }

    /// The newest MAC is judged alone: a bad newest fails even beside a
    /// good older one; a good newest passes beside a bad older one.
    #[test]
    fn newest_judged_alone() {
        let k = key();
        let r = get("/");
        let good_old = k.sign(HopVersion::V4, &r, &id(), NOW - 10);
        let bad_new = format!("{}.{}", NOW - 5, "ab".repeat(32));
        assert!(matches!(
            k.verify(&[&good_old, &bad_new], &r, &id(), NOW),
            Err(AuthError::BadMac)
        ));
        let joined = format!("{good_old}, {bad_new}");
        assert!(matches!(
            k.verify(&[&joined], &r, &id(), NOW),
            Err(AuthError::BadMac)
        ));

        let good_new = k.sign(HopVersion::V4, &r, &id(), NOW);
        let bad_old = format!("{}.{}", NOW - 5, "ab".repeat(32));
        assert!(k.verify(&[&bad_old, &good_new], &r, &id(), NOW).is_ok());
        // The newest outside the window fails.
        let stale = k.sign(HopVersion::V4, &r, &id(), NOW - 100);
        assert!(matches!(
            k.verify(&[&stale], &r, &id(), NOW),
            Err(AuthError::MacExpired)
        ));
        // A future-dated bad MAC outranks a good current one.
        let future_bad = format!("{}.{}", NOW + 30, "cd".repeat(32));
        assert!(matches!(
            k.verify(&[&good_new, &future_bad], &r, &id(), NOW),
            Err(AuthError::BadMac)
        ));
    }

    /// Fields with newlines are refused rather than MACed ambiguously.
    #[test]
    fn newline_fields_refused() {
        let k = key();
        let mut bad = id();
        bad.subject = "a\nb".into();
        let mac = k.sign(HopVersion::V4, &get("/"), &bad, NOW);
        assert!(matches!(
            k.verify(&[&mac], &get("/"), &bad, NOW),
            Err(AuthError::MalformedMac(_))
        ));
        let r = HopRequest {
            query: "a\nb",
            ..get("/")
        };
        let mac = k.sign(HopVersion::V4, &r, &id(), NOW);
        assert!(matches!(
            k.verify(&[&mac], &r, &id(), NOW),
            Err(AuthError::MalformedMac(_))
        ));
    }

    /// Headers round-trip through `sign_headers` / `from_headers` and verify;
    /// the body digest travels in its own header.
    #[test]
    fn headers_round_trip() {
        let k = key();
        let digest = body_sha256(b"payload");
        let operator = HopIdentity {
            operator: true,
            ..id()
        };
        for ident in [id(), id_v3(), operator] {
            let headers = k.sign_headers(&put(&digest), &ident, NOW);
            let map: HashMap<String, String> = headers
                .iter()
                .map(|(n, v)| (n.to_ascii_lowercase(), v.clone()))
                .collect();
            assert!(
                headers
                    .iter()
                    .all(|(n, _)| n.to_ascii_lowercase().starts_with(HOP_HEADER_PREFIX))
            );
            assert!(
                headers
                    .iter()
                    .all(|(_, v)| v.bytes().all(|b| (0x20..0x7f).contains(&b)))
            );
            assert_eq!(map["x-internal-auth-version"], "v4");
            assert_eq!(map["x-internal-auth-body-sha256"], digest);
            let back = from_headers(|n| map.get(&n.to_ascii_lowercase()).cloned()).unwrap();
            assert_eq!(back, ident);
            let got = &map["x-internal-auth-mac"];
            let r = put(&map["x-internal-auth-body-sha256"]);
            assert_eq!(k.verify(&[got], &r, &back, NOW).unwrap(), HopVersion::V4);
            // The flag travels only when set, and its removal breaks the MAC.
            assert_eq!(map.contains_key("x-internal-auth-operator"), ident.operator);
            if ident.operator {
                let stripped = from_headers(|n| {
                    (n != HOP_OPERATOR_HEADER)
                        .then(|| map.get(&n.to_ascii_lowercase()).cloned())
                        .flatten()
                })
                .unwrap();
                assert!(!stripped.operator);
                assert!(k.verify(&[got], &r, &stripped, NOW).is_err());
            }
        }
        // v1 headers leave the v2+ fields and the digest out.
        let h = to_headers(&id_v3(), HopVersion::V1, &digest, "m");
        assert!(!h.iter().any(|(n, _)| *n == HOP_DEVICE_HEADER
            || *n == HOP_EXP_HEADER
            || *n == HOP_BODY_SHA256_HEADER));
        // Missing subject, or a bad number.
        assert!(from_headers(|n| (n == HOP_NAMESPACE_HEADER).then(|| "a".into())).is_none());
        assert!(
            from_headers(|n| match n {
                HOP_EXP_HEADER => Some("soon".into()),
                HOP_CUSTOM_HEADER => Some(String::new()),
                _ => Some("x".into()),
            })
            .is_none()
        );
    }

    /// Canonical JSON sorts keys at every level.
    #[test]
    fn canonical() {
        let v = serde_json::json!({"b":1,"a":{"d":[{"y":1,"x":"é\n"}],"c":null}});
        assert_eq!(
            canonical_json(&v),
            r#"{"a":{"c":null,"d":[{"x":"é\n","y":1}]},"b":1}"#
        );
        assert!(!canonical_json(&v).contains('\n'));
    }

    /// The identity of a verified JWT needs v2.
    #[test]
    fn from_claims_is_v2() {
        let c = Claims::new("i", "a", "s", "ns", vec!["kv:read:*".into()], NOW).unwrap();
        let ident = HopIdentity::from_claims(&c);
        assert_eq!(ident.min_version(), HopVersion::V2);
        assert_eq!(ident.custom, "");
    }

    proptest! {
        // Parsers of untrusted bytes: thousands of generated inputs each.
        #![proptest_config(ProptestConfig::with_cases(3000))]
        /// The MAC header parser and verifier never panic.
        #[test]
        fn verify_never_panics(
            a in ".{0,100}",
            b in "[0-9]{0,22}\\.[0-9a-fA-F]{0,66}",
            q in ".{0,40}",
            now in any::<u64>(),
        ) {
            let k = key();
            let _ = parse_mac(&a);
            let _ = parse_mac(&b);
            let r = HopRequest { method: "GET", path: "/", query: &q, body_sha256: &a };
            let _ = k.verify(&[&a, &b], &r, &id(), now);
        }

        /// `from_headers` never panics on arbitrary values.
        #[test]
        fn from_headers_never_panics(v in ".{0,40}") {
            let _ = from_headers(|_| Some(v.clone()));
        }

        /// A v4 MAC holds for exactly the query and body it was made for:
        /// any other query or body is refused.
        #[test]
        fn query_and_body_bound(
            q in "[a-z0-9=&%]{0,30}",
            q2 in "[a-z0-9=&%]{0,30}",
            body in proptest::collection::vec(any::<u8>(), 0..64),
            body2 in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let k = key();
            let (d, d2) = (body_sha256(&body), body_sha256(&body2));
            let r = HopRequest { method: "PUT", path: "/v1/kv/k", query: &q, body_sha256: &d };
            let mac = k.sign(HopVersion::V4, &r, &id(), NOW);
            prop_assert!(k.verify(&[&mac], &r, &id(), NOW).is_ok());
            let other = HopRequest { query: &q2, body_sha256: &d2, ..r };
            let same = q == q2 && body == body2;
            prop_assert_eq!(k.verify(&[&mac], &other, &id(), NOW).is_ok(), same);
        }
    }
}
