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

/// The sealing key of the node.
pub struct SecretBox {
    key: LessSafeKey,
}

impl SecretBox {
    /// Derives the key from the server secret.
    pub fn new(server_secret: &[u8]) -> Self {
        let salt = hkdf::Salt::new(hkdf::HKDF_SHA256, KEY_SALT);
        let prk = salt.extract(server_secret);
        let okm = prk
            .expand(&[KEY_INFO], &AES_256_GCM)
            .expect("32 bytes is a valid HKDF-SHA256 output length");
        let mut bytes = [0u8; 32];
        okm.fill(&mut bytes).expect("fill 32 bytes");
        let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &bytes).expect("32-byte key"));
        Self { key }
    }

    /// Seals `plain` bound to `aad` (the store key).
    pub fn seal(&self, aad: &[u8], plain: &[u8]) -> Vec<u8> {
        let nonce_bytes = crate::node::random_bytes::<NONCE_LEN>();
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
