//! Records that confer authority carry a MAC: an API key record (`keys/`:
//! its namespace, role and grants), a namespace record (`ns/`) and a refresh
//! token record (`rt/`: its namespace and grants). Whoever can write the
//! store (etcd reached by a tenant, a restored snapshot) cannot move a key
//! into another namespace or widen its grants: the node refuses a record
//! whose MAC fails and logs it, it never trusts it.
//!
//! A record is `version (1) || HMAC-SHA256 (32) || value`. The HMAC key is
//! derived with HKDF-SHA256 (info [`RECORD_MAC_INFO`]) from the cluster
//! secret in a cluster and from the server secret on a single node; the HMAC
//! covers the store key and the value, so a record copied under another key
//! fails. The MAC is deterministic (no nonce), so a compare-and-swap on the
//! value a reader got compares equal bytes: [`Store`](super::Store) wraps and
//! verifies at its boundary and nothing above it knows.
//!
//! Records written before this version are MAC'd once, on start
//! ([`Store::adopt_record_macs`](super::Store::adopt_record_macs)).

use ring::{hkdf, hmac};

/// HKDF info of the record MAC key.
pub const RECORD_MAC_INFO: &[u8] = b"store-record-mac";
/// HKDF salt (fixed: the secret is the only input).
const RECORD_MAC_SALT: &[u8] = b"meshgate";
/// The first byte of a MAC'd record. Never `{`, the first byte of the JSON
/// records older versions wrote.
pub const MAC_V1: u8 = 0xb1;
/// Bytes a MAC'd record has on top of its value.
pub const MAC_OVERHEAD: usize = 1 + 32;
/// The store prefixes whose records carry a MAC.
pub const MAC_PREFIXES: [&[u8]; 3] = [b"keys/", b"ns/", b"rt/"];
/// Where the store notes that its records carry MACs (written once the
/// migration is done; from then on a record without a MAC is never adopted).
/// Not under `_cluster/`, where every record is sealed: the marker is no secret.
pub const MAC_MARKER: &[u8] = b"_store/record_macs";

/// Why a record is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MacError {
    /// No MAC at all (a record in the clear, or another format).
    #[error("the record carries no MAC")]
    Missing,
    /// The MAC does not verify: an edited record, one copied from another
    /// key, or one MAC'd under another secret.
    #[error("the record's MAC does not verify")]
    Bad,
}

/// The key records are MAC'd with.
pub struct RecordMac {
    key: hmac::Key,
}

impl std::fmt::Debug for RecordMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecordMac(..)")
    }
}

impl RecordMac {
    /// HKDF-SHA256(secret, info `store-record-mac`) → HMAC-SHA256 key.
    pub fn derive(secret: &[u8]) -> RecordMac {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, RECORD_MAC_SALT).extract(secret);
        let okm = prk
            .expand(&[RECORD_MAC_INFO], hmac::HMAC_SHA256)
            .expect("32 bytes is a valid HKDF-SHA256 output length");
        RecordMac {
            key: hmac::Key::from(okm),
        }
    }

    /// Whether records under `key` carry a MAC.
    pub fn covers(key: &[u8]) -> bool {
        MAC_PREFIXES.iter().any(|p| key.starts_with(p))
    }

    fn tag(&self, key: &[u8], value: &[u8]) -> hmac::Tag {
        let mut ctx = hmac::Context::with_key(&self.key);
        // The key's length first: the key and the value cannot trade bytes.
        ctx.update(&(key.len() as u64).to_be_bytes());
        ctx.update(key);
        ctx.update(value);
        ctx.sign()
    }

    /// The record stored for `value` under `key`.
    pub fn wrap(&self, key: &[u8], value: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAC_OVERHEAD + value.len());
        out.push(MAC_V1);
        out.extend_from_slice(self.tag(key, value).as_ref());
        out.extend_from_slice(value);
        out
    }

    /// The value of the record stored under `key`, if its MAC verifies.
    pub fn open<'a>(&self, key: &[u8], record: &'a [u8]) -> Result<&'a [u8], MacError> {
        if record.len() < MAC_OVERHEAD || record[0] != MAC_V1 {
            return Err(MacError::Missing);
        }
        let (tag, value) = record[1..].split_at(MAC_OVERHEAD - 1);
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(&(key.len() as u64).to_be_bytes());
        ctx.update(key);
        ctx.update(value);
        // The tags are compared in constant time (no early exit).
        let want = ctx.sign();
        let diff = want
            .as_ref()
            .iter()
            .zip(tag)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff == 0 {
            Ok(value)
        } else {
            Err(MacError::Bad)
        }
    }
}

/// Whether `record` is one an older version wrote before records carried
/// MACs: JSON, an object.
pub fn is_clear_record(record: &[u8]) -> bool {
    record.first() == Some(&b'{')
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"keys/00ff";

    /// A wrapped record opens under its key and secret and keeps its value readable.
    #[test]
    fn round_trip() {
        let m = RecordMac::derive(b"secret");
        let rec = m.wrap(KEY, br#"{"namespace":"mallory"}"#);
        assert_eq!(rec[0], MAC_V1);
        assert_eq!(rec.len(), MAC_OVERHEAD + 23);
        assert_eq!(m.open(KEY, &rec), Ok(&br#"{"namespace":"mallory"}"#[..]));
        // Deterministic: a compare-and-swap on the value finds the same bytes.
        assert_eq!(m.wrap(KEY, br#"{"namespace":"mallory"}"#), rec);
        assert_eq!(
            RecordMac::derive(b"secret").open(KEY, &rec),
            Ok(&br#"{"namespace":"mallory"}"#[..])
        );
    }

    /// An edited value (a key moved to another namespace) is refused, at any byte.
    #[test]
    fn edited_record_refused() {
        let m = RecordMac::derive(b"secret");
        let rec = m.wrap(KEY, br#"{"namespace":"mallory"}"#);
        for i in 0..rec.len() {
            let mut t = rec.clone();
            t[i] ^= 0x01;
            assert!(m.open(KEY, &t).is_err(), "bit flip at {i} accepted");
        }
        let mut moved = rec[..MAC_OVERHEAD].to_vec();
        moved.extend_from_slice(br#"{"namespace":"bank"}"#);
        assert_eq!(m.open(KEY, &moved), Err(MacError::Bad));
        for len in 0..MAC_OVERHEAD {
            assert_eq!(m.open(KEY, &rec[..len]), Err(MacError::Missing));
        }
    }

    /// A record copied under another store key, or MAC'd under another
    /// secret, or in the clear, is refused.
    #[test]
    fn moved_other_secret_or_clear_refused() {
        let m = RecordMac::derive(b"secret");
        let rec = m.wrap(KEY, b"{}");
        assert_eq!(m.open(b"keys/00fe", &rec), Err(MacError::Bad));
        assert_eq!(
            RecordMac::derive(b"other").open(KEY, &rec),
            Err(MacError::Bad)
        );
        assert_eq!(m.open(KEY, b"{}"), Err(MacError::Missing));
        assert!(is_clear_record(b"{}"));
        assert!(!is_clear_record(&rec));
    }

    use crate::storage::{BatchOp, OrderedKv, Store, StoreError};

    fn sled() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open_sled(dir.path()).unwrap();
        (dir, s)
    }

    /// The bytes the backend holds under `key`, past the store's MAC layer.
    async fn raw(store: &Store, key: &[u8]) -> Option<Vec<u8>> {
        store.as_sled().unwrap().get(key).await.unwrap()
    }

    /// Once installed, the store MACs what it writes under the covered
    /// prefixes (put, batch, compare-and-swap) and hands back the value;
    /// other keys are stored as given; a covered record edited in the store
    /// is refused on get and left out of a scan.
    #[tokio::test]
    async fn store_macs_covered_records_and_refuses_edits() {
        let (_d, store) = sled();
        store
            .adopt_record_macs(RecordMac::derive(b"s"))
            .await
            .unwrap();
        let m = RecordMac::derive(b"s");
        store.put(b"keys/a", b"{\"ns\":\"a\"}").await.unwrap();
        store
            .apply_batch(vec![BatchOp::Put(b"ns/a".to_vec(), b"{}".to_vec())])
            .await
            .unwrap();
        store.put(b"kv/a/x", b"plain").await.unwrap();
        assert_eq!(
            raw(&store, b"keys/a").await.unwrap(),
            m.wrap(b"keys/a", b"{\"ns\":\"a\"}")
        );
        assert_eq!(raw(&store, b"ns/a").await.unwrap(), m.wrap(b"ns/a", b"{}"));
        assert_eq!(raw(&store, b"kv/a/x").await.unwrap(), b"plain");
        assert_eq!(
            store.get(b"keys/a").await.unwrap().unwrap(),
            b"{\"ns\":\"a\"}"
        );
        // A compare-and-swap on the value read finds the MAC'd record.
        assert!(
            store
                .compare_and_swap(b"keys/a", Some(b"{\"ns\":\"a\"}"), Some(b"{}"), None)
                .await
                .unwrap()
        );
        assert_eq!(store.get(b"keys/a").await.unwrap().unwrap(), b"{}");
        // Edited behind the store's back: MAC kept, value changed; or in the clear.
        let mut edited = raw(&store, b"keys/a").await.unwrap();
        edited.extend_from_slice(b" ");
        for forged in [edited, b"{\"ns\":\"b\"}".to_vec()] {
            store
                .as_sled()
                .unwrap()
                .put(b"keys/a", &forged)
                .await
                .unwrap();
            assert!(matches!(
                store.get(b"keys/a").await,
                Err(StoreError::Tampered(k)) if k == "keys/a"
            ));
        }
        store.put(b"keys/b", b"{}").await.unwrap();
        let rows = store.scan_all(b"keys/").await.unwrap();
        assert_eq!(rows, vec![(b"keys/b".to_vec(), b"{}".to_vec())]);
    }

    /// A store written before record MACs: its clear records are MAC'd in
    /// place on start (values kept) and the marker written; a clear record
    /// that appears after that is refused, at the next start too.
    #[tokio::test]
    async fn clear_records_migrated_once() {
        let (_d, store) = sled();
        let backend = store.as_sled().unwrap();
        backend.put(b"keys/a", b"{\"k\":1}").await.unwrap();
        backend.put(b"ns/a", b"{\"n\":1}").await.unwrap();
        let report = store
            .adopt_record_macs(RecordMac::derive(b"s"))
            .await
            .unwrap();
        assert_eq!((report.verified, report.migrated), (0, 2));
        assert!(report.refused.is_empty());
        assert_eq!(store.get(b"keys/a").await.unwrap().unwrap(), b"{\"k\":1}");
        assert_eq!(raw(&store, b"ns/a").await.unwrap()[0], MAC_V1);
        assert!(raw(&store, MAC_MARKER).await.is_some());
        // An edit in the clear after the migration: not adopted by a later start.
        backend.put(b"keys/b", b"{\"k\":2}").await.unwrap();
        let again = Store::on(super::super::Backend::Sled(backend.clone()));
        let report = again
            .adopt_record_macs(RecordMac::derive(b"s"))
            .await
            .unwrap();
        assert_eq!((report.verified, report.migrated), (2, 0));
        assert_eq!(report.refused.len(), 1);
        assert!(matches!(
            again.get(b"keys/b").await,
            Err(StoreError::Tampered(_))
        ));
        // Nor when the marker was deleted: MAC'd records show the migration ran.
        backend.delete(MAC_MARKER).await.unwrap();
        let third = Store::on(super::super::Backend::Sled(backend.clone()));
        let report = third
            .adopt_record_macs(RecordMac::derive(b"s"))
            .await
            .unwrap();
        assert_eq!((report.migrated, report.refused.len()), (0, 1));
        assert_eq!(raw(&store, b"keys/b").await.unwrap(), b"{\"k\":2}");
    }

    /// Two nodes migrate the same clear store at once (separate handles, a
    /// multi-threaded runtime): both end with every record MAC'd once and
    /// readable through either.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn racing_migrations_agree() {
        let (_d, store) = sled();
        let backend = store.as_sled().unwrap().clone();
        for i in 0..50 {
            backend
                .put(format!("keys/{i:02}").as_bytes(), b"{\"k\":1}")
                .await
                .unwrap();
        }
        let tasks: Vec<_> = (0..2)
            .map(|_| {
                let s = Store::on(super::super::Backend::Sled(backend.clone()));
                tokio::spawn(async move {
                    s.adopt_record_macs(RecordMac::derive(b"s")).await.unwrap();
                    s
                })
            })
            .collect();
        let mut stores = Vec::new();
        for t in tasks {
            stores.push(t.await.unwrap());
        }
        for s in stores {
            let rows = s.scan_all(b"keys/").await.unwrap();
            assert_eq!(rows.len(), 50);
            assert!(rows.iter().all(|(_, v)| v == b"{\"k\":1}"));
        }
    }

    /// Exactly the authority-bearing prefixes are covered.
    #[test]
    fn covered_prefixes() {
        for k in [&b"keys/ab"[..], b"ns/acme", b"rt/cd"] {
            assert!(RecordMac::covers(k));
        }
        for k in [
            &b"nskeys/acme/id"[..],
            b"kv/acme/x",
            b"rtfam/f/x",
            b"_cluster/jwt_key",
        ] {
            assert!(!RecordMac::covers(k));
        }
    }
}
