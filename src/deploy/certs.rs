//! Per-host certificates of deployments (docs/deployments.md "Certificates"):
//! a PEM chain and its private key, checked before anything is stored,
//! kept with the key sealed, and served by SNI.
//!
//! - [`validate`]: the upload's checks (a chain that parses, the key matches
//!   the leaf, inside its validity, covers every host of the deployment).
//! - [`CertRecord`]: what the store holds under `depcert/<ns>/<name>`: the
//!   chain in the clear (it is public), the key sealed with AES-256-GCM under
//!   a key derived from the server secret for this purpose only, bound to
//!   the record's store key (a sealed key moved to another deployment does
//!   not open).
//! - [`ServedCerts`]: the host → certificate map the TLS listener's resolver
//!   reads (`http/tls.rs`), rebuilt with the routing index and swapped whole,
//!   so a handshake never takes a lock.

use crate::error::{ApiError, Code};
use crate::functions::SecretBox;
use arc_swap::ArcSwap;
use base64::Engine as _;
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;

/// HKDF info of the key that seals certificate keys.
const SEAL_INFO: &[u8] = b"meshgate deployment certificate keys v1";
/// Largest `cert` part (a chain of a few certificates is a few KiB).
pub const MAX_CHAIN_BYTES: usize = 64 * 1024;
/// Largest `key` part (a 4096-bit RSA key in PEM is about 3.3 KiB).
pub const MAX_KEY_BYTES: usize = 16 * 1024;
/// Most certificates in one chain.
pub const MAX_CHAIN_LEN: usize = 8;

/// The certificates the TLS listener serves for deployment hosts, by host.
pub type ServedCerts = Arc<ArcSwap<HashMap<String, Arc<CertifiedKey>>>>;

/// The store key of a deployment's certificate.
pub fn cert_key(ns: &str, name: &str) -> Vec<u8> {
    format!("depcert/{ns}/{name}").into_bytes()
}

/// The prefix of every deployment certificate.
pub const CERT_PREFIX: &[u8] = b"depcert/";

/// A deployment's certificate as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertRecord {
    /// Namespace of the deployment.
    pub namespace: String,
    /// The deployment's name.
    pub deployment: String,
    /// The chain, leaf first, in PEM (public).
    pub chain_pem: String,
    /// The private key (PKCS#8, SEC1 or PKCS#1 DER), sealed, in base64.
    pub key_sealed: String,
    /// The leaf's DNS names (subject alternative names).
    pub names: Vec<String>,
    /// The leaf's subject, its attributes in the certificate's order
    /// (`C=US, O=Example, CN=shop.example.com`).
    pub subject: String,
    /// The leaf's issuer, likewise.
    pub issuer: String,
    /// Start of the leaf's validity, Unix seconds.
    pub not_before: i64,
    /// End of the leaf's validity, Unix seconds.
    pub not_after: i64,
    /// SHA-256 of the leaf's DER, hex.
    pub sha256: String,
    /// When it was uploaded, Unix seconds.
    pub uploaded_at: u64,
}

/// A deployment's certificate as the dashboard shows it, kept in memory by
/// the index rebuild.
#[derive(Debug, Clone, Copy, Default)]
pub struct TlsSummary {
    /// Its active version asks for `tls: "auto"` (ACME).
    pub auto: bool,
    /// Its stored leaf's `(not_before, not_after)`, Unix seconds; None: its
    /// hosts get the node's own pair.
    pub leaf: Option<(i64, i64)>,
}

/// An upload that passed every check, ready to be sealed and stored.
pub struct Validated {
    /// The chain as DER, leaf first.
    chain: Vec<CertificateDer<'static>>,
    /// The key as DER.
    key_der: Vec<u8>,
    names: Vec<String>,
    subject: String,
    issuer: String,
    not_before: i64,
    not_after: i64,
    sha256: String,
}

fn refuse(code: Code, message: impl Into<String>) -> ApiError {
    ApiError::new(code, message)
}

/// Parses and checks an upload against the deployment's `hosts` at Unix
/// time `now`. Every refusal is 400 and names what is wrong; the key's bytes
/// never appear in a message.
pub fn validate(
    cert_pem: &[u8],
    key_pem: &[u8],
    hosts: &[String],
    now: i64,
) -> Result<Validated, ApiError> {
    if cert_pem.len() > MAX_CHAIN_BYTES {
        return Err(refuse(
            Code::InvalidCertificate,
            format!("the certificate chain is larger than {MAX_CHAIN_BYTES} bytes"),
        ));
    }
    if key_pem.len() > MAX_KEY_BYTES {
        return Err(refuse(
            Code::InvalidCertificate,
            format!("the private key is larger than {MAX_KEY_BYTES} bytes"),
        ));
    }
    // A key pasted where the chain goes: say so, and never echo it.
    if PrivateKeyDer::from_pem_slice(cert_pem).is_ok() {
        return Err(refuse(
            Code::InvalidCertificate,
            "the certificate part holds a private key: send the PEM certificate chain \
             (BEGIN CERTIFICATE) as `cert` and the private key as `key`",
        ));
    }
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| {
            refuse(
                Code::InvalidCertificate,
                format!("the certificate chain is not PEM: {e}"),
            )
        })?;
    if chain.is_empty() {
        return Err(refuse(
            Code::InvalidCertificate,
            "the certificate part holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
        ));
    }
    if chain.len() > MAX_CHAIN_LEN {
        return Err(refuse(
            Code::InvalidCertificate,
            format!("the chain has more than {MAX_CHAIN_LEN} certificates"),
        ));
    }
    let mut leaf_info = None;
    for (i, der) in chain.iter().enumerate() {
        let what = if i == 0 {
            "the leaf certificate".to_string()
        } else {
            format!("certificate {} of the chain", i + 1)
        };
        let (rest, cert) = x509_parser::parse_x509_certificate(der.as_ref()).map_err(|e| {
            refuse(
                Code::InvalidCertificate,
                format!("{what} is not an X.509 certificate: {e}"),
            )
        })?;
        if !rest.is_empty() {
            return Err(refuse(
                Code::InvalidCertificate,
                format!("{what} has trailing bytes after its DER"),
            ));
        }
        let v = cert.validity();
        let (nb, na) = (v.not_before.timestamp(), v.not_after.timestamp());
        if nb > now {
            return Err(refuse(
                Code::CertificateNotYetValid,
                format!(
                    "{what} is not valid before {}: upload it once it is",
                    rfc3339(nb)
                ),
            ));
        }
        if na < now {
            return Err(refuse(
                Code::CertificateExpired,
                format!("{what} expired at {}", rfc3339(na)),
            ));
        }
        if i == 0 {
            leaf_info = Some((
                cert.subject().to_string(),
                cert.issuer().to_string(),
                nb,
                na,
            ));
        }
    }
    let Some((subject, issuer, not_before, not_after)) = leaf_info else {
        return Err(refuse(Code::InvalidCertificate, "no leaf certificate"));
    };
    let leaf = webpki::EndEntityCert::try_from(&chain[0]).map_err(|e| {
        refuse(
            Code::InvalidCertificate,
            format!("the leaf certificate cannot serve TLS: {e}"),
        )
    })?;
    let names: Vec<String> = leaf.valid_dns_names().map(str::to_string).collect();
    for h in hosts {
        if !covers(&leaf, h) {
            return Err(refuse(
                Code::CertificateHostMismatch,
                format!(
                    "the certificate does not cover host {h} of the deployment (its names: {})",
                    if names.is_empty() {
                        "none".to_string()
                    } else {
                        names.join(", ")
                    }
                ),
            ));
        }
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|_| {
        refuse(
            Code::InvalidCertificate,
            "the key part is not a PEM private key (-----BEGIN PRIVATE KEY-----, \
             EC PRIVATE KEY or RSA PRIVATE KEY)",
        )
    })?;
    let key_der = key.secret_der().to_vec();
    let ck = certified(chain.clone(), &key_der)?;
    match ck.keys_match() {
        Ok(()) => {}
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
            return Err(refuse(
                Code::CertificateKeyMismatch,
                "the private key does not belong to the leaf certificate",
            ));
        }
        Err(e) => {
            return Err(refuse(
                Code::CertificateKeyMismatch,
                format!("the private key cannot be checked against the leaf certificate: {e}"),
            ));
        }
    }
    let sha256 = hex::encode(ring::digest::digest(
        &ring::digest::SHA256,
        chain[0].as_ref(),
    ));
    Ok(Validated {
        chain,
        key_der,
        names,
        subject,
        issuer,
        not_before,
        not_after,
        sha256,
    })
}

/// Whether the leaf is valid for `host` (wildcards as TLS clients read them).
fn covers(leaf: &webpki::EndEntityCert<'_>, host: &str) -> bool {
    ServerName::try_from(host)
        .ok()
        .is_some_and(|n| leaf.verify_is_valid_for_subject_name(&n).is_ok())
}

/// A signing key for `key_der` with `chain`.
fn certified(
    chain: Vec<CertificateDer<'static>>,
    key_der: &[u8],
) -> Result<CertifiedKey, ApiError> {
    let key = PrivateKeyDer::try_from(key_der.to_vec()).map_err(|e| {
        refuse(
            Code::InvalidCertificate,
            format!("the private key is not PKCS#8, SEC1 or PKCS#1: {e}"),
        )
    })?;
    let signer = rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| {
        refuse(
            Code::InvalidCertificate,
            format!(
                "the private key's type is not supported (RSA, ECDSA P-256/P-384, Ed25519): {e}"
            ),
        )
    })?;
    Ok(CertifiedKey::new(chain, signer))
}

/// `2026-12-07T17:00:00Z`.
pub fn rfc3339(t: i64) -> String {
    chrono::DateTime::<chrono::Utc>::from_timestamp(t, 0)
        .map(|d| d.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_else(|| t.to_string())
}

/// An opened record: the stored bytes it came from, and its signing key.
type Opened = (Vec<u8>, Arc<CertifiedKey>);

/// Certificate keys sealed and opened, and the map the listener serves.
pub struct Certs {
    seal: SecretBox,
    /// What the TLS resolver reads.
    pub served: ServedCerts,
    /// Opened records by store key, with the stored bytes they came from: a
    /// rebuild opens only what changed.
    opened: parking_lot::Mutex<HashMap<Vec<u8>, Opened>>,
}

impl Certs {
    /// Keys sealed under `server_secret` (cluster-wide in a cluster).
    pub fn new(server_secret: &[u8]) -> Certs {
        Certs {
            seal: SecretBox::derived(server_secret, SEAL_INFO),
            served: Arc::new(ArcSwap::from_pointee(HashMap::new())),
            opened: parking_lot::Mutex::new(HashMap::new()),
        }
    }

    /// The record to store for a validated upload.
    pub fn record(&self, ns: &str, name: &str, v: Validated, now: u64) -> CertRecord {
        let chain_pem = v
            .chain
            .iter()
            .map(|c| pem_block("CERTIFICATE", c.as_ref()))
            .collect::<String>();
        let sealed = self.seal.seal(&cert_key(ns, name), &v.key_der);
        CertRecord {
            namespace: ns.to_string(),
            deployment: name.to_string(),
            chain_pem,
            key_sealed: base64::engine::general_purpose::STANDARD.encode(sealed),
            names: v.names,
            subject: v.subject,
            issuer: v.issuer,
            not_before: v.not_before,
            not_after: v.not_after,
            sha256: v.sha256,
            uploaded_at: now,
        }
    }

    /// The signing key of the record stored as `raw` under `key`: from the
    /// cache when those bytes were opened before.
    pub fn open(&self, key: &[u8], raw: &[u8], rec: &CertRecord) -> Option<Arc<CertifiedKey>> {
        if let Some((seen, ck)) = self.opened.lock().get(key)
            && seen == raw
        {
            return Some(ck.clone());
        }
        let sealed = base64::engine::general_purpose::STANDARD
            .decode(&rec.key_sealed)
            .ok()?;
        let Some(key_der) = self.seal.open(key, &sealed) else {
            tracing::warn!(namespace = %rec.namespace, deployment = %rec.deployment, "A certificate key does not open (another server secret, or moved); not served.");
            return None;
        };
        let chain = CertificateDer::pem_slice_iter(rec.chain_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .ok()?;
        let ck = Arc::new(certified(chain, &key_der).ok()?);
        self.opened
            .lock()
            .insert(key.to_vec(), (raw.to_vec(), ck.clone()));
        Some(ck)
    }

    /// Forgets opened records whose store keys are not in `live`.
    pub fn retain(&self, live: &std::collections::BTreeSet<Vec<u8>>) {
        self.opened.lock().retain(|k, _| live.contains(k));
    }
}

/// Whether the record's leaf covers `host` (its stored names, wildcards as
/// TLS clients read them).
pub fn record_covers(rec: &CertRecord, host: &str) -> bool {
    rec.names.iter().any(|n| name_matches(n, host))
}

fn name_matches(name: &str, host: &str) -> bool {
    let name = name.to_ascii_lowercase();
    match name.strip_prefix("*.") {
        Some(suffix) => host
            .split_once('.')
            .is_some_and(|(label, rest)| !label.is_empty() && rest == suffix),
        None => name == host,
    }
}

/// The certificate as `GET /v1/deployments/{name}/certificate` shows it
/// (never the key): its names, issuer, validity, and its state against the
/// deployment's current `hosts` at `now`.
pub fn view(rec: &CertRecord, hosts: &[String], now: i64) -> Value {
    let uncovered: Vec<&String> = hosts.iter().filter(|h| !record_covers(rec, h)).collect();
    let state = if rec.not_after < now {
        "expired"
    } else if rec.not_before > now {
        "not_yet_valid"
    } else if !uncovered.is_empty() {
        "hosts_not_covered"
    } else {
        "active"
    };
    json!({
        "deployment": rec.deployment,
        "state": state,
        "names": rec.names,
        "subject": rec.subject,
        "issuer": rec.issuer,
        "not_before": rfc3339(rec.not_before),
        "not_after": rfc3339(rec.not_after),
        "sha256": rec.sha256,
        "uploaded_at": rfc3339(rec.uploaded_at as i64),
        "hosts": hosts.iter().map(|h| json!({"host": h, "covered": record_covers(rec, h)})).collect::<Vec<_>>(),
        "chain_pem": rec.chain_pem,
    })
}

fn pem_block(label: &str, der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(names: &[&str]) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert =
            rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap()
                .self_signed(&key)
                .unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// Each check of an upload, obeyed and violated.
    #[test]
    fn uploads_are_checked() {
        let now = 1_800_000_000;
        let hosts = vec!["a.test".to_string(), "x.b.test".to_string()];
        let (c, k) = pair(&["a.test", "*.b.test"]);
        let v = validate(c.as_bytes(), k.as_bytes(), &hosts, now).unwrap();
        assert_eq!(v.names, vec!["a.test", "*.b.test"]);
        let code = |c: &str, k: &str, h: &[String]| {
            validate(c.as_bytes(), k.as_bytes(), h, now)
                .err()
                .map(|e| e.code)
        };
        assert_eq!(
            code(&c, &k, &["c.test".into()]),
            Some(Code::CertificateHostMismatch)
        );
        assert_eq!(
            code(&c, &k, &["y.x.b.test".into()]),
            Some(Code::CertificateHostMismatch)
        );
        let (_, other_key) = pair(&["a.test"]);
        assert_eq!(
            code(&c, &other_key, &hosts),
            Some(Code::CertificateKeyMismatch)
        );
        assert_eq!(code(&k, &k, &hosts), Some(Code::InvalidCertificate));
        assert_eq!(code("junk", &k, &hosts), Some(Code::InvalidCertificate));
        assert_eq!(code(&c, "junk", &hosts), Some(Code::InvalidCertificate));
        // rcgen's default validity: 1975 to 4096.
        assert_eq!(
            validate(c.as_bytes(), k.as_bytes(), &hosts, 100_000_000)
                .err()
                .map(|e| e.code),
            Some(Code::CertificateNotYetValid)
        );
        assert_eq!(
            validate(c.as_bytes(), k.as_bytes(), &hosts, 100_000_000_000)
                .err()
                .map(|e| e.code),
            Some(Code::CertificateExpired)
        );
    }

    /// A sealed key opens only under its own store key.
    #[test]
    fn sealed_keys_open_under_their_own_record_only() {
        let (c, k) = pair(&["a.test"]);
        let certs = Certs::new(&[3u8; 32]);
        let v = validate(
            c.as_bytes(),
            k.as_bytes(),
            &["a.test".into()],
            1_800_000_000,
        )
        .unwrap();
        let rec = certs.record("n", "site", v, 1);
        let raw = serde_json::to_vec(&rec).unwrap();
        assert!(certs.open(&cert_key("n", "site"), &raw, &rec).is_some());
        assert!(certs.open(&cert_key("n", "other"), &raw, &rec).is_none());
        assert!(
            Certs::new(&[4u8; 32])
                .open(&cert_key("n", "site"), &raw, &rec)
                .is_none()
        );
    }

    #[test]
    fn wildcards_cover_one_label() {
        assert!(name_matches("*.example.com", "a.example.com"));
        assert!(!name_matches("*.example.com", "a.b.example.com"));
        assert!(!name_matches("*.example.com", "example.com"));
        assert!(name_matches("Shop.Example.com", "shop.example.com"));
    }
}
