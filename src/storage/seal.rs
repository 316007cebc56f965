//! Sealed records: what the node keeps under `_cluster/` in the shared store
//! (the server secret, the JWT signing key) is ciphertext, so whoever reads
//! the store (a backup, a snapshot, a tenant who reached etcd) learns nothing
//! that mints a credential.
//!
//! A sealed record is `version (1) || nonce (12) || AES-256-GCM(value) || tag (16)`.
//! The key is derived from the cluster secret with HKDF-SHA256 (info
//! [`SEAL_INFO`]); the nonce is random per record; the record's store key is
//! the associated data, so a sealed record copied under another key does not
//! open.
//!
//! Nodes agree on each record by compare-and-swap ([`adopt_sealed`]): the
//! first node writes its own value sealed, the others open it. A record an
//! older meshgate wrote in the clear is sealed in place by the first node that
//! finds it (also by compare-and-swap, so nodes starting together agree).

use super::{OrderedKv, StoreError};
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hkdf;

/// HKDF info of the seal key.
pub const SEAL_INFO: &[u8] = b"shared-store-seal";
/// HKDF salt of the seal key (fixed: the cluster secret is the only input).
const SEAL_SALT: &[u8] = b"meshgate";
/// The first byte of a record sealed by this version. Never 0x30, the first
/// byte of the PKCS#8 (DER) records older versions wrote in the clear.
pub const SEAL_V1: u8 = 0xa1;
const TAG_LEN: usize = 16;
/// Bytes a sealed record has on top of its value.
pub const SEAL_OVERHEAD: usize = 1 + NONCE_LEN + TAG_LEN;
/// Rounds of read-then-CAS before [`adopt_sealed`] gives up (each lost round
/// means another node changed the record in between).
const ADOPT_ROUNDS: usize = 8;

/// Why a sealed record does not open, or cannot be agreed on.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// Too short or an unknown version byte.
    #[error("not a sealed record")]
    NotSealed,
    /// The tag does not verify: another cluster secret, another store key, or
    /// altered bytes.
    #[error("sealed under a different cluster secret (or altered)")]
    WrongKey,
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Other nodes kept changing the record.
    #[error("the record kept changing under {0} compare-and-swap rounds")]
    Contended(usize),
}

/// The key records are sealed with, derived from the cluster secret.
pub struct SealKey {
    key: LessSafeKey,
}

impl SealKey {
    /// HKDF-SHA256(cluster secret, info `shared-store-seal`) → AES-256-GCM key.
    pub fn derive(cluster_secret: &[u8]) -> SealKey {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, SEAL_SALT).extract(cluster_secret);
        let okm = prk
            .expand(&[SEAL_INFO], &AES_256_GCM)
            .expect("32 bytes is a valid HKDF-SHA256 output length");
        let mut bytes = [0u8; 32];
        okm.fill(&mut bytes).expect("fill 32 bytes");
        SealKey {
            key: LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &bytes).expect("32-byte key")),
        }
    }

    /// Seals `value` for the store key `key`.
    pub fn seal(&self, key: &[u8], value: &[u8]) -> Vec<u8> {
        let nonce = crate::util::random_bytes::<NONCE_LEN>();
        let mut buf = value.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(key),
                &mut buf,
            )
            .expect("AES-GCM seal of a bounded value");
        let mut out = Vec::with_capacity(SEAL_OVERHEAD + value.len());
        out.push(SEAL_V1);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&buf);
        out
    }

    /// Opens the record stored under `key`.
    pub fn open(&self, key: &[u8], record: &[u8]) -> Result<Vec<u8>, SealError> {
        if record.len() < SEAL_OVERHEAD || record[0] != SEAL_V1 {
            return Err(SealError::NotSealed);
        }
        let (nonce, sealed) = record[1..].split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| SealError::NotSealed)?;
        let mut buf = sealed.to_vec();
        let plain = self
            .key
            .open_in_place(nonce, Aad::from(key), &mut buf)
            .map_err(|_| SealError::WrongKey)?;
        Ok(plain.to_vec())
    }
}

/// What [`adopt_sealed`] agreed on.
#[derive(Debug, PartialEq, Eq)]
pub struct Adopted {
    /// The cluster-wide value.
    pub value: Vec<u8>,
    /// How it came to be.
    pub how: Adoption,
}

/// How the cluster-wide value was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adoption {
    /// No record: this node's value was written, sealed.
    Written,
    /// A sealed record was there and opened.
    Opened,
    /// A record in the clear (an older version's) was there; this node sealed it.
    Migrated,
}

/// One round of [`adopt_sealed`] given what the store held when read.
/// `Ok(None)`: the compare-and-swap lost (another node wrote in between).
pub async fn adopt_round(
    store: &impl OrderedKv,
    seal: &SealKey,
    key: &[u8],
    local: &[u8],
    is_clear: &impl Fn(&[u8]) -> bool,
    current: Option<Vec<u8>>,
) -> Result<Option<Adopted>, SealError> {
    let (value, how) = match current {
        None => (local.to_vec(), Adoption::Written),
        Some(record) if is_clear(&record) => (record, Adoption::Migrated),
        Some(record) => {
            let value = seal.open(key, &record)?;
            return Ok(Some(Adopted {
                value,
                how: Adoption::Opened,
            }));
        }
    };
    let expected = match how {
        Adoption::Migrated => Some(value.as_slice()),
        _ => None,
    };
    let sealed = seal.seal(key, &value);
    if store
        .compare_and_swap(key, expected, Some(&sealed), None)
        .await?
    {
        Ok(Some(Adopted { value, how }))
    } else {
        Ok(None)
    }
}

/// The cluster-wide value under `key`: this node's `local` one, sealed, if it
/// is the first to write it; the one already there, opened, otherwise. A
/// record `is_clear` recognises as an older version's clear value is sealed in
/// place and adopted. A record that does not open is an error: the node must
/// not run with keys of its own.
pub async fn adopt_sealed(
    store: &impl OrderedKv,
    seal: &SealKey,
    key: &[u8],
    local: &[u8],
    is_clear: impl Fn(&[u8]) -> bool,
) -> Result<Adopted, SealError> {
    for _ in 0..ADOPT_ROUNDS {
        let current = store.get(key).await?;
        if let Some(a) = adopt_round(store, seal, key, local, &is_clear, current).await? {
            return Ok(a);
        }
    }
    Err(SealError::Contended(ADOPT_ROUNDS))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::Store;

    const KEY: &[u8] = b"_cluster/server_secret";

    fn clear_secret(r: &[u8]) -> bool {
        r.len() == 32
    }

    /// A sealed value opens under the same secret and key, and is not the value.
    #[test]
    fn round_trip() {
        let k = SealKey::derive(b"cluster secret");
        let value = b"0123456789abcdef0123456789abcdef";
        let sealed = k.seal(KEY, value);
        assert_eq!(sealed.len(), value.len() + SEAL_OVERHEAD);
        assert_eq!(sealed[0], SEAL_V1);
        assert!(!sealed.windows(value.len()).any(|w| w == value));
        assert_eq!(k.open(KEY, &sealed).unwrap(), value);
        // A fresh nonce each time: two seals of one value differ.
        assert_ne!(k.seal(KEY, value), sealed);
        // Reopening with a key derived again from the same secret works.
        assert_eq!(
            SealKey::derive(b"cluster secret")
                .open(KEY, &sealed)
                .unwrap(),
            value
        );
    }

    /// A record sealed under another cluster secret does not open.
    #[test]
    fn wrong_key_refused() {
        let sealed = SealKey::derive(b"secret one").seal(KEY, b"value");
        assert!(matches!(
            SealKey::derive(b"secret two").open(KEY, &sealed),
            Err(SealError::WrongKey)
        ));
    }

    /// A sealed record copied under another store key does not open (AAD).
    #[test]
    fn moved_key_refused() {
        let k = SealKey::derive(b"s");
        let sealed = k.seal(b"_cluster/jwt_key", b"value");
        assert!(matches!(
            k.open(b"_cluster/server_secret", &sealed),
            Err(SealError::WrongKey)
        ));
    }

    /// Any flipped bit (version, nonce, ciphertext, tag) or truncation is refused.
    #[test]
    fn tampered_refused() {
        let k = SealKey::derive(b"s");
        let sealed = k.seal(KEY, b"the value");
        for i in 0..sealed.len() {
            let mut t = sealed.clone();
            t[i] ^= 0x01;
            assert!(k.open(KEY, &t).is_err(), "bit flip at {i} accepted");
        }
        for len in 0..sealed.len() {
            assert!(k.open(KEY, &sealed[..len]).is_err(), "truncation to {len}");
        }
        assert!(matches!(k.open(KEY, b""), Err(SealError::NotSealed)));
    }

    fn sled() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open_sled(dir.path()).unwrap();
        (dir, s)
    }

    /// The first node writes its value sealed; the second opens it and gets the
    /// first's value, not its own.
    #[tokio::test]
    async fn first_writer_wins_sealed() {
        let (_d, store) = sled();
        let k = SealKey::derive(b"s");
        let a = adopt_sealed(&store, &k, KEY, &[1; 32], clear_secret)
            .await
            .unwrap();
        assert_eq!((a.value, a.how), (vec![1; 32], Adoption::Written));
        let raw = store.get(KEY).await.unwrap().unwrap();
        assert_eq!(raw[0], SEAL_V1);
        let b = adopt_sealed(&store, &k, KEY, &[2; 32], clear_secret)
            .await
            .unwrap();
        assert_eq!((b.value, b.how), (vec![1; 32], Adoption::Opened));
    }

    /// A node with another cluster secret is refused instead of adopting its own value.
    #[tokio::test]
    async fn other_secret_refused() {
        let (_d, store) = sled();
        adopt_sealed(&store, &SealKey::derive(b"s"), KEY, &[1; 32], clear_secret)
            .await
            .unwrap();
        let r = adopt_sealed(&store, &SealKey::derive(b"t"), KEY, &[2; 32], clear_secret).await;
        assert!(matches!(r, Err(SealError::WrongKey)), "{r:?}");
        assert_eq!(
            SealKey::derive(b"s")
                .open(KEY, &store.get(KEY).await.unwrap().unwrap())
                .unwrap(),
            vec![1; 32]
        );
    }

    /// A clear record (an older version's) is sealed in place and its value kept.
    #[tokio::test]
    async fn clear_record_is_migrated() {
        let (_d, store) = sled();
        store.put(KEY, &[7; 32]).await.unwrap();
        let k = SealKey::derive(b"s");
        let a = adopt_sealed(&store, &k, KEY, &[1; 32], clear_secret)
            .await
            .unwrap();
        assert_eq!((a.value, a.how), (vec![7; 32], Adoption::Migrated));
        let raw = store.get(KEY).await.unwrap().unwrap();
        assert_ne!(raw, vec![7; 32]);
        assert_eq!(k.open(KEY, &raw).unwrap(), vec![7; 32]);
    }

    /// Two nodes migrate at once: the one whose compare-and-swap loses (it read
    /// the clear record before the other sealed it) reads again and opens the
    /// other's sealed record: both end with the old value, sealed once.
    #[tokio::test]
    async fn racing_migration_agrees() {
        let (_d, store) = sled();
        store.put(KEY, &[7; 32]).await.unwrap();
        let k = SealKey::derive(b"s");
        let stale = store.get(KEY).await.unwrap();
        let winner = adopt_sealed(&store, &k, KEY, &[1; 32], clear_secret)
            .await
            .unwrap();
        assert_eq!(winner.how, Adoption::Migrated);
        let sealed = store.get(KEY).await.unwrap();
        // The loser's round on what it read before: its CAS fails, nothing written.
        let lost = adopt_round(&store, &k, KEY, &[2; 32], &clear_secret, stale)
            .await
            .unwrap();
        assert_eq!(lost, None);
        assert_eq!(store.get(KEY).await.unwrap(), sealed);
        let loser = adopt_sealed(&store, &k, KEY, &[2; 32], clear_secret)
            .await
            .unwrap();
        assert_eq!((loser.value, loser.how), (vec![7; 32], Adoption::Opened));
    }

    /// Eight nodes find the same clear record at once (a multi-threaded
    /// runtime): all adopt the old value and exactly one sealed it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn many_racing_migrations_agree() {
        let (_d, store) = sled();
        store.put(KEY, &[9; 32]).await.unwrap();
        let tasks: Vec<_> = (0..8u8)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move {
                    let k = SealKey::derive(b"s");
                    adopt_sealed(&store, &k, KEY, &[i; 32], clear_secret)
                        .await
                        .unwrap()
                })
            })
            .collect();
        let mut migrated = 0;
        for t in tasks {
            let a = t.await.unwrap();
            assert_eq!(a.value, vec![9; 32]);
            migrated += usize::from(a.how == Adoption::Migrated);
        }
        assert_eq!(migrated, 1, "exactly one node sealed the clear record");
    }
}
