//! Function secrets at rest: AES-256-GCM (ring) with a key derived by HKDF
//! from the node's server secret. A sealed value is `nonce (12) || ciphertext
//! || tag`; the store key is the associated data, so a sealed value moved to
//! another namespace or name does not open.

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hkdf;

/// HKDF info of the function-secret key.
const KEY_INFO: &[u8] = b"meshgate function secrets v1";
/// HKDF salt of the function-secret key.
const KEY_SALT: &[u8] = b"meshgate";
/// HKDF info of the key that seals secrets inside a namespace export.
const EXPORT_KEY_INFO: &[u8] = b"meshgate export secrets v1";
/// An export's secrets sealed bound to the secret's name only (older versions' exports).
pub const EXPORT_SEAL_V1: u32 = 1;
/// An export's secrets sealed bound to the exporting namespace and the name.
pub const EXPORT_SEAL_V2: u32 = 2;
/// HKDF info of the export key's public identifier.
const EXPORT_ID_INFO: &[u8] = b"meshgate export key id v1";

/// Derives `len` bytes from the server secret for `info`.
fn derive(server_secret: &[u8], info: &[u8], out: &mut [u8]) {
    struct Len(usize);
    impl hkdf::KeyType for Len {
        fn len(&self) -> usize {
            self.0
        }
    }
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, KEY_SALT).extract(server_secret);
    prk.expand(&[info], Len(out.len()))
        .expect("a short HKDF-SHA256 output")
        .fill(out)
        .expect("fill the HKDF output");
}

/// The sealing key of the node.
pub struct SecretBox {
    /// AES-256-GCM key derived from the server secret by HKDF (per purpose `info`).
    key: LessSafeKey,
}

impl SecretBox {
    /// Derives the key from the server secret.
    pub fn new(server_secret: &[u8]) -> Self {
        Self::derived(server_secret, KEY_INFO)
    }

    /// The same construction for another purpose: a key of its own under
    /// HKDF info `info` (deployment certificate keys use it).
    pub fn derived(server_secret: &[u8], info: &[u8]) -> Self {
        let mut bytes = [0u8; 32];
        derive(server_secret, info, &mut bytes);
        let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &bytes).expect("32-byte key"));
        Self { key }
    }

    /// Seals `plain` bound to `aad` (the store key).
    pub fn seal(&self, aad: &[u8], plain: &[u8]) -> Vec<u8> {
        let nonce_bytes = crate::util::random_bytes::<NONCE_LEN>();
        let mut buf = plain.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce_bytes),
                Aad::from(aad),
                &mut buf,
            )
            .expect("AES-GCM seal of a bounded value");
        let mut out = nonce_bytes.to_vec();
        out.extend_from_slice(&buf);
        out
    }

    /// Opens a sealed value; None if it was tampered with or moved.
    pub fn open(&self, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
        if sealed.len() < NONCE_LEN {
            return None;
        }
        let (nonce, rest) = sealed.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut buf = rest.to_vec();
        let plain = self
            .key
            .open_in_place(nonce, Aad::from(aad), &mut buf)
            .ok()?;
        Some(plain.to_vec())
    }
}

/// The key that seals function secrets inside a namespace export: derived
/// from the server secret like [`SecretBox`] but for another purpose. A seal
/// of version [`EXPORT_SEAL_V2`] is bound to the exporting namespace and the
/// secret's name (associated data), so a leaked export's secrets open on a
/// node with the same server secret (every node of a cluster) and only for
/// the namespace they came from; re-sealing them for another one is the
/// operator's call (`PUT /v1/db/import?secrets=reseal`). Exports written
/// by older versions ([`EXPORT_SEAL_V1`]) are bound to the name only.
pub struct ExportBox {
    /// The sealing key for exports, derived under its own HKDF info (not the store's key).
    inner: SecretBox,
    /// Public id of the key (hex of a separate HKDF output), written as an export's `key_id`.
    id: String,
}

impl ExportBox {
    pub fn new(server_secret: &[u8]) -> Self {
        let mut id = [0u8; 8];
        derive(server_secret, EXPORT_ID_INFO, &mut id);
        Self {
            inner: SecretBox::derived(server_secret, EXPORT_KEY_INFO),
            id: hex::encode(id),
        }
    }

    /// A public identifier of the key (HKDF output, not the key): an export
    /// whose `key_id` differs was made under another server secret.
    pub fn key_id(&self) -> &str {
        &self.id
    }

    /// Version 1's associated data: the name only.
    fn aad_v1(name: &str) -> Vec<u8> {
        format!("meshgate-export/secret/{name}").into_bytes()
    }

    /// Version 2's: the namespace (length first, so no namespace and name
    /// pair reads as another) and the name.
    fn aad(namespace: &str, name: &str) -> Vec<u8> {
        format!(
            "meshgate-export/v2/{}/{namespace}/secret/{name}",
            namespace.len()
        )
        .into_bytes()
    }

    /// Seals secret `name` of `namespace` for an export ([`EXPORT_SEAL_V2`]).
    pub fn seal(&self, namespace: &str, name: &str, plain: &[u8]) -> Vec<u8> {
        self.inner.seal(&Self::aad(namespace, name), plain)
    }

    /// Opens secret `name` sealed for `namespace`; None if tampered with,
    /// renamed, sealed for another namespace or under another server secret.
    pub fn open(&self, namespace: &str, name: &str, sealed: &[u8]) -> Option<Vec<u8>> {
        self.inner.open(&Self::aad(namespace, name), sealed)
    }

    /// Opens a secret an older export sealed bound to its name only
    /// ([`EXPORT_SEAL_V1`]).
    pub fn open_v1(&self, name: &str, sealed: &[u8]) -> Option<Vec<u8>> {
        self.inner.open(&Self::aad_v1(name), sealed)
    }

    #[cfg(test)]
    fn seal_v1(&self, name: &str, plain: &[u8]) -> Vec<u8> {
        self.inner.seal(&Self::aad_v1(name), plain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An export sealed under one server secret opens under the same one only,
    /// under its own name only; the key id tells the secrets apart.
    #[test]
    fn export_box_opens_with_the_same_server_secret_only() {
        let a = ExportBox::new(b"server secret a");
        let a2 = ExportBox::new(b"server secret a");
        let b = ExportBox::new(b"server secret b");
        let sealed = a.seal("acme", "API_TOKEN", b"s3cret");
        assert_eq!(
            a2.open("acme", "API_TOKEN", &sealed).as_deref(),
            Some(&b"s3cret"[..])
        );
        assert_eq!(a2.open("acme", "OTHER", &sealed), None);
        assert_eq!(b.open("acme", "API_TOKEN", &sealed), None);
        assert_eq!(a.key_id(), a2.key_id());
        assert_ne!(a.key_id(), b.key_id());
        // The export key is not the at-rest key.
        assert_eq!(
            SecretBox::new(b"server secret a").open(b"x", &a.seal("x", "x", b"v")),
            None
        );
    }

    /// A version 2 export seal is bound to its namespace: opened for another
    /// namespace (or one whose name shares a prefix), or as a version 1 seal,
    /// it fails; it opens for its own.
    #[test]
    fn export_seal_bound_to_namespace() {
        let a = ExportBox::new(b"server secret");
        let sealed = a.seal("mallory", "API_TOKEN", b"s3cret");
        assert_eq!(
            a.open("mallory", "API_TOKEN", &sealed).as_deref(),
            Some(&b"s3cret"[..])
        );
        for ns in ["bank", "mallor", "mallory2", ""] {
            assert_eq!(a.open(ns, "API_TOKEN", &sealed), None, "{ns}");
        }
        assert_eq!(a.open_v1("API_TOKEN", &sealed), None);
        // A version 1 seal (name only) does not open as version 2 for any namespace.
        let old = a.seal_v1("API_TOKEN", b"s3cret");
        assert_eq!(
            a.open_v1("API_TOKEN", &old).as_deref(),
            Some(&b"s3cret"[..])
        );
        assert_eq!(a.open("mallory", "API_TOKEN", &old), None);
    }
}
