//! Every record the store keeps is authenticated: whoever can write the
//! store (etcd reached by a tenant, a restored snapshot) can neither edit a
//! record, nor move it under another key, nor swap two records: the node
//! refuses a record whose MAC fails, logs it and counts it
//! (`meshgate_store_records_refused_total`), it never uses it. A function
//! version pointed at another namespace's module, a key moved into another
//! namespace, a dashboard session copied under a token of the writer's
//! choosing: each is a record that fails its MAC.
//!
//! A record is `version (1) || HMAC-SHA256 (32) || value`. The HMAC key is
//! derived with HKDF-SHA256 (info [`RECORD_MAC_INFO`]) from the cluster
//! secret in a cluster and from the server secret on a single node; the HMAC
//! covers the store key and the value, so a record copied under another key
//! fails. The MAC is deterministic (no nonce), so a compare-and-swap on the
//! value a reader got compares equal bytes: [`Store`](super::Store) wraps and
//! verifies at its boundary and nothing above it knows.
//!
//! Every key is covered unless [`RecordMac::covers`] names it as one of the
//! few exceptions, each authenticated another way (there is no list of
//! covered prefixes to keep current: a new kind of record is covered without
//! being named):
//! - `_cluster/`: sealed with AES-256-GCM under a key of the cluster secret,
//!   the store key as associated data (`seal.rs`), adopted before the record
//!   MAC is installed;
//! - `blob/<sha256>`: content-addressed bytes, checked against the hash in
//!   their key when read ([`blob_matches`]);
//! - [`MAC_MARKER`]: the note that the records carry MACs (no secret, and a
//!   forged or deleted one gains nothing: see [`Store::adopt_record_macs`](super::Store::adopt_record_macs)).
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
/// The prefixes whose records carried a MAC under the first marker
/// ([`MARKER_V1`]): in a store marked so, a record under them without a MAC
/// is an edit, never adopted; every other record is MAC'd on start.
pub const V1_PREFIXES: [&[u8]; 3] = [b"keys/", b"ns/", b"rt/"];
/// Where the store notes that its records carry MACs (written once the
/// migration is done; from then on a record without a MAC is never adopted).
/// Not under `_cluster/`, where every record is sealed: the marker is no secret.
pub const MAC_MARKER: &[u8] = b"_store/record_macs";
/// The marker's value once only [`V1_PREFIXES`] carried MACs.
pub const MARKER_V1: &[u8] = b"v1";
/// The marker's value once every record carries a MAC.
pub const MARKER_V2: &[u8] = b"v2";
/// Content-addressed records: `blob/<hex sha256 of the value>`.
pub const BLOB_PREFIX: &[u8] = b"blob/";
/// Records sealed under the cluster secret (`seal.rs`).
pub const SEALED_PREFIX: &[u8] = b"_cluster/";

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
    /// A blob whose bytes do not hash to the key they are stored under.
    #[error("the blob's bytes do not match the hash in its key")]
    Content,
}

/// The key records are MAC'd with.
pub struct RecordMac {
    key: hmac::Key,
    /// Which key this is, for the records this thread has verified
    /// ([`VERIFIED`]): a record verified under one key is never believed
    /// under another.
    id: u64,
}

/// Slots of the per-thread memory of records whose MAC verified.
const VERIFIED_SLOTS: usize = 512;
/// The longest record remembered: comparing it costs a tenth of its HMAC.
const VERIFIED_MAX_RECORD: usize = 1024;

/// A record whose MAC verified: the key it is stored under and its bytes, MAC
/// included, under the [`RecordMac`] `mac`.
struct Verified {
    mac: u64,
    key: Box<[u8]>,
    record: Box<[u8]>,
}

thread_local! {
    /// The records this thread verified last, one per slot (the slot picked
    /// by the record's own MAC bytes). A record read again with the same
    /// bytes under the same key costs two compares instead of an HMAC; any
    /// other bytes, key or MAC key misses and is verified in full. Nothing
    /// is believed that was not verified: a slot holds only what passed.
    static VERIFIED: std::cell::RefCell<Vec<Option<Verified>>> =
        std::cell::RefCell::new((0..VERIFIED_SLOTS).map(|_| None).collect());
}

/// The id of the next [`RecordMac`].
static NEXT_MAC_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

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
            id: NEXT_MAC_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Whether the record under `key` carries a MAC: every key but the
    /// three exceptions the module doc names, each authenticated otherwise.
    pub fn covers(key: &[u8]) -> bool {
        !(key.starts_with(SEALED_PREFIX) || key.starts_with(BLOB_PREFIX) || key == MAC_MARKER)
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

    /// The value of the record stored under `key`, if its MAC verifies
    /// (or these very bytes verified under `key` before on this thread).
    pub fn open<'a>(&self, key: &[u8], record: &'a [u8]) -> Result<&'a [u8], MacError> {
        if record.len() < MAC_OVERHEAD || record[0] != MAC_V1 {
            return Err(MacError::Missing);
        }
        let (tag, value) = record[1..].split_at(MAC_OVERHEAD - 1);
        let slot =
            u64::from_le_bytes(tag[..8].try_into().unwrap_or_default()) as usize % VERIFIED_SLOTS;
        let seen = VERIFIED.with(|v| {
            v.borrow()[slot]
                .as_ref()
                .is_some_and(|s| s.mac == self.id && *s.record == *record && *s.key == *key)
        });
        if seen {
            return Ok(value);
        }
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
        if diff != 0 {
            return Err(MacError::Bad);
        }
        if record.len() <= VERIFIED_MAX_RECORD {
            VERIFIED.with(|v| {
                v.borrow_mut()[slot] = Some(Verified {
                    mac: self.id,
                    key: key.into(),
                    record: record.into(),
                });
            });
        }
        Ok(value)
    }
}

/// Whether `value`, read under the blob key `key` (`blob/<hex sha256>`), is
/// the content its key names. Any other key under `blob/` names no content:
/// false.
pub fn blob_matches(key: &[u8], value: &[u8]) -> bool {
    let Some(hex_sha) = key.strip_prefix(BLOB_PREFIX) else {
        return false;
    };
    let digest = ring::digest::digest(&ring::digest::SHA256, value);
    let mut want = [0u8; 64];
    // Lower-case hex, as `blob_key` is called with (`hex::encode`).
    hex::encode_to_slice(digest.as_ref(), &mut want).is_ok() && want[..] == *hex_sha
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
    }

    /// A record verified once is remembered on its thread, and nothing else
    /// is believed for it: after a good read, the same record with any bit
    /// flipped, under another key, or under another secret (even one derived
    /// from the same secret, a second store) is still verified in full and
    /// refused; the remembered record still opens.
    #[test]
    fn a_verified_record_remembered_believes_nothing_else() {
        let m = RecordMac::derive(b"secret");
        let rec = m.wrap(KEY, br#"{"namespace":"bank","module":"aa"}"#);
        assert!(m.open(KEY, &rec).is_ok());
        // The same slot (same MAC bytes), other value bytes: refused.
        for i in MAC_OVERHEAD..rec.len() {
            let mut t = rec.clone();
            t[i] ^= 0x01;
            assert_eq!(m.open(KEY, &t), Err(MacError::Bad), "byte {i}");
        }
        assert_eq!(m.open(b"keys/00fe", &rec), Err(MacError::Bad));
        assert_eq!(
            RecordMac::derive(b"other").open(KEY, &rec),
            Err(MacError::Bad)
        );
        // A second MAC of the same secret verifies on its own (same bytes).
        assert!(RecordMac::derive(b"secret").open(KEY, &rec).is_ok());
        assert_eq!(m.open(KEY, &rec).ok(), Some(&rec[MAC_OVERHEAD..]));
        // A record longer than what is remembered still opens each time.
        let big = m.wrap(KEY, &vec![b'x'; VERIFIED_MAX_RECORD + 1]);
        assert!(m.open(KEY, &big).is_ok() && m.open(KEY, &big).is_ok());
        let mut t = big.clone();
        t[MAC_OVERHEAD + 5] ^= 1;
        assert_eq!(m.open(KEY, &t), Err(MacError::Bad));
    }

    use crate::storage::{BatchOp, OrderedKv, Store, StoreError, blob_key};

    fn sled() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open_sled(dir.path()).unwrap();
        (dir, s)
    }

    /// The bytes the backend holds under `key`, past the store's MAC layer.
    async fn raw(store: &Store, key: &[u8]) -> Option<Vec<u8>> {
        store.as_sled().unwrap().get(key).await.unwrap()
    }

    /// Writes `value` under `key` straight into the backend, as a store writer.
    async fn forge(store: &Store, key: &[u8], value: &[u8]) {
        store.as_sled().unwrap().put(key, value).await.unwrap();
    }

    /// A store with the MAC installed and its refusals counted.
    async fn macd() -> (tempfile::TempDir, Store, prometheus::IntCounter) {
        let (d, store) = sled();
        store
            .adopt_record_macs(RecordMac::derive(b"s"), true)
            .await
            .unwrap();
        let refused = prometheus::IntCounter::new("refused", "refused").unwrap();
        store.count_refusals(refused.clone());
        (d, store, refused)
    }

    fn sha_hex(v: &[u8]) -> String {
        hex::encode(ring::digest::digest(&ring::digest::SHA256, v))
    }

    /// Every record the store writes carries a MAC bound to its key, whatever
    /// its prefix (the known ones, and one no code names), through put, put
    /// with a time to live, batch, buffered batch, compare-and-swap and
    /// guarded change; it reads back as the value. The exceptions are stored
    /// as given: sealed `_cluster/` records, the marker, content-addressed blobs.
    #[tokio::test]
    async fn every_prefix_wrapped() {
        let (_d, store, refused) = macd().await;
        let m = RecordMac::derive(b"s");
        let keys: [&[u8]; 12] = [
            b"keys/a",
            b"ns/a",
            b"rt/a",
            b"fnver/bank/f/0000000001",
            b"dep/bank/site",
            b"depv/bank/site/1",
            b"host/bank.example",
            b"secret/bank/TOKEN",
            b"_admin/session/00ff",
            b"kv/bank/x",
            b"_nodes/n1",
            b"a-kind-no-code-names-yet/x",
        ];
        for (i, k) in keys.iter().enumerate() {
            let v = format!("value {i}").into_bytes();
            match i % 4 {
                0 => store.put(k, &v).await.unwrap(),
                1 => store
                    .put_ttl(k, &v, std::time::Duration::from_secs(60))
                    .await
                    .unwrap(),
                2 => store
                    .apply_batch(vec![BatchOp::Put(k.to_vec(), v.clone())])
                    .await
                    .unwrap(),
                _ => store
                    .apply_buffered(vec![BatchOp::Put(k.to_vec(), v.clone())])
                    .await
                    .unwrap(),
            }
            assert_eq!(raw(&store, k).await.unwrap(), m.wrap(k, &v));
            assert_eq!(store.get(k).await.unwrap().unwrap(), v);
        }
        assert!(
            store
                .compare_and_swap(b"kv/bank/x", Some(b"value 9"), Some(b"cas"), None)
                .await
                .unwrap()
        );
        assert_eq!(
            raw(&store, b"kv/bank/x").await.unwrap(),
            m.wrap(b"kv/bank/x", b"cas")
        );
        let r = store
            .transact(&[b"kv/bank/x".to_vec()], None, |vals| {
                assert_eq!(vals[0].as_deref(), Some(&b"cas"[..]));
                Ok::<_, ()>((
                    vec![BatchOp::Put(b"usage/bank/kv".to_vec(), b"1".to_vec())],
                    7,
                ))
            })
            .await
            .unwrap();
        assert_eq!(r, Some(Ok(7)));
        assert_eq!(
            raw(&store, b"usage/bank/kv").await.unwrap(),
            m.wrap(b"usage/bank/kv", b"1")
        );
        // The exceptions, stored as given.
        let blob = b"module bytes".to_vec();
        let bkey = blob_key(&sha_hex(&blob));
        store.put(&bkey, &blob).await.unwrap();
        store
            .put(b"_cluster/jwt_key", b"sealed elsewhere")
            .await
            .unwrap();
        assert_eq!(raw(&store, &bkey).await.unwrap(), blob);
        assert_eq!(
            raw(&store, b"_cluster/jwt_key").await.unwrap(),
            b"sealed elsewhere"
        );
        assert_eq!(raw(&store, MAC_MARKER).await.unwrap(), MARKER_V2);
        assert_eq!(store.get(&bkey).await.unwrap().unwrap(), blob);
        assert_eq!(refused.get(), 0);
    }

    /// A store writer's records, each refused on every read path (get, scan,
    /// guarded change) and counted: bank's function version swapped for the
    /// one copied from evil's key, a record moved under another key, a value
    /// edited behind its kept MAC, one in the clear, one of a prefix no code
    /// names; a blob whose bytes were replaced. The genuine records around
    /// them read as before.
    #[tokio::test]
    async fn moved_swapped_edited_records_refused() {
        let (_d, store, refused) = macd().await;
        let bank = b"fnver/bank/pay/0000000001";
        let evil = b"fnver/evil/pay/0000000001";
        store.put(bank, br#"{"sha256":"bank"}"#).await.unwrap();
        store.put(evil, br#"{"sha256":"evil"}"#).await.unwrap();
        store
            .put(b"fnver/bank/pay/0000000002", b"{}")
            .await
            .unwrap();
        // Swapped: evil's record, MAC and all, under bank's key.
        forge(&store, bank, &raw(&store, evil).await.unwrap()).await;
        assert!(matches!(
            store.get(bank).await,
            Err(StoreError::Tampered(k)) if k == "fnver/bank/pay/0000000001"
        ));
        assert_eq!(refused.get(), 1);
        let rows = store.scan_all(b"fnver/bank/").await.unwrap();
        assert_eq!(
            rows,
            vec![(b"fnver/bank/pay/0000000002".to_vec(), b"{}".to_vec())]
        );
        assert_eq!(refused.get(), 2);
        let r = store
            .transact(&[bank.to_vec()], None, |_| Ok::<_, ()>((vec![], ())))
            .await;
        assert!(matches!(r, Err(StoreError::Tampered(_))), "{r:?}");
        assert_eq!(refused.get(), 3);
        // Moved (a session under a token of the writer's choosing), edited,
        // clear, and under a prefix no code names.
        store
            .put(b"_admin/session/aa", b"{\"exp\":1}")
            .await
            .unwrap();
        let session = raw(&store, b"_admin/session/aa").await.unwrap();
        forge(&store, b"_admin/session/bb", &session).await;
        store
            .put(b"dep/bank/x", b"{\"upstream\":\"bank\"}")
            .await
            .unwrap();
        let mut edited = raw(&store, b"dep/bank/x").await.unwrap();
        let at = edited.len() - 6;
        edited[at..].copy_from_slice(b"evil\"}");
        forge(&store, b"dep/bank/x", &edited).await;
        forge(&store, b"host/bank.example", b"{\"namespace\":\"evil\"}").await;
        store.put(b"brand-new/x", b"v").await.unwrap();
        forge(
            &store,
            b"brand-new/y",
            &raw(&store, b"brand-new/x").await.unwrap(),
        )
        .await;
        for k in [
            &b"_admin/session/bb"[..],
            b"dep/bank/x",
            b"host/bank.example",
            b"brand-new/y",
        ] {
            assert!(
                matches!(store.get(k).await, Err(StoreError::Tampered(_))),
                "{}",
                String::from_utf8_lossy(k)
            );
        }
        assert_eq!(refused.get(), 7);
        assert_eq!(
            store.get(b"_admin/session/aa").await.unwrap().unwrap(),
            b"{\"exp\":1}"
        );
        // A blob whose bytes were replaced: refused on load; the genuine one reads.
        let module = b"bank's module".to_vec();
        let bkey = blob_key(&sha_hex(&module));
        store.put(&bkey, &module).await.unwrap();
        assert_eq!(store.get(&bkey).await.unwrap().unwrap(), module);
        forge(&store, &bkey, b"evil's module").await;
        assert!(matches!(
            store.get(&bkey).await,
            Err(StoreError::Tampered(_))
        ));
        assert!(store.scan_all(b"blob/").await.unwrap().is_empty());
        assert_eq!(refused.get(), 9);
    }

    /// A store writer strips every record's MAC, forges a key record into
    /// another namespace and deletes the marker: the store looks like an
    /// older version's. Without the operator's consent the node adopts
    /// nothing (`Unmigrated`, the start stops) and the forged record stays
    /// refused; with it (an upgrade) the records are MAC'd.
    #[tokio::test]
    async fn a_stripped_store_is_not_adopted_without_consent() {
        let (_d, store) = sled();
        let backend = store.as_sled().unwrap();
        backend
            .put(b"keys/evil", b"{\"namespace\":\"bank\"}")
            .await
            .unwrap();
        backend
            .put(b"fnver/bank/f/1", b"{\"sha256\":\"x\"}")
            .await
            .unwrap();
        let err = store
            .adopt_record_macs(RecordMac::derive(b"s"), false)
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Unmigrated(2)), "{err}");
        assert!(err.to_string().contains("adopt_store_records"), "{err}");
        assert_eq!(
            raw(&store, b"keys/evil").await.unwrap()[0],
            b'{',
            "nothing MAC'd"
        );
        assert!(raw(&store, MAC_MARKER).await.is_none(), "no marker written");
        let report = store
            .adopt_record_macs(RecordMac::derive(b"s"), true)
            .await
            .unwrap();
        assert_eq!(report.migrated, 2);
    }

    /// A store written before record MACs: its records, of every prefix, are
    /// MAC'd in place on start (values and times to live kept; an expired
    /// refresh token left out) and the marker written; a clear record that
    /// appears after that is refused, at the next start too, and also when
    /// the marker was deleted (the MAC'd records show the migration ran).
    #[tokio::test]
    async fn clear_records_migrated_once() {
        let (_d, store) = sled();
        let backend = store.as_sled().unwrap();
        backend.put(b"keys/a", b"{\"k\":1}").await.unwrap();
        backend
            .put(b"fnver/bank/f/1", b"{\"sha256\":\"x\"}")
            .await
            .unwrap();
        backend.put(b"kv/bank/v", &[MAC_V1; 40]).await.unwrap();
        backend
            .put_ttl(
                b"_admin/session/aa",
                b"{}",
                std::time::Duration::from_secs(600),
            )
            .await
            .unwrap();
        backend.put(b"rt/old", b"{\"expires_at\":1}").await.unwrap();
        let blob = b"bytes".to_vec();
        backend
            .put(&blob_key(&sha_hex(&blob)), &blob)
            .await
            .unwrap();
        let report = store
            .adopt_record_macs(RecordMac::derive(b"s"), true)
            .await
            .unwrap();
        assert_eq!((report.verified, report.migrated), (0, 4));
        assert!(report.refused.is_empty());
        assert_eq!(store.get(b"keys/a").await.unwrap().unwrap(), b"{\"k\":1}");
        assert_eq!(
            store.get(b"kv/bank/v").await.unwrap().unwrap(),
            [MAC_V1; 40]
        );
        assert_eq!(raw(&store, b"fnver/bank/f/1").await.unwrap()[0], MAC_V1);
        assert_eq!(
            store
                .get(&blob_key(&sha_hex(&blob)))
                .await
                .unwrap()
                .unwrap(),
            blob
        );
        assert_eq!(raw(&store, MAC_MARKER).await.unwrap(), MARKER_V2);
        // The session kept its time to live: the sweep would remove it.
        let sled_raw = backend.raw_record(b"_admin/session/aa").unwrap().unwrap();
        assert_eq!(sled_raw[0], 1, "no longer an expiring record");
        // An edit in the clear after the migration: refused on read, and not
        // adopted by a later start, with or without the marker.
        backend.put(b"dep/bank/x", b"{\"k\":2}").await.unwrap();
        assert!(matches!(
            store.get(b"dep/bank/x").await,
            Err(StoreError::Tampered(_))
        ));
        let again = Store::on(super::super::Backend::Sled(backend.clone()));
        let report = again
            .adopt_record_macs(RecordMac::derive(b"s"), true)
            .await
            .unwrap();
        assert_eq!(
            report,
            super::super::MacAdoption::default(),
            "v2: nothing read"
        );
        backend.delete(MAC_MARKER).await.unwrap();
        let third = Store::on(super::super::Backend::Sled(backend.clone()));
        let report = third
            .adopt_record_macs(RecordMac::derive(b"s"), true)
            .await
            .unwrap();
        assert_eq!(
            (report.verified, report.migrated, report.refused.len()),
            (4, 0, 2)
        );
        assert_eq!(raw(&store, b"dep/bank/x").await.unwrap(), b"{\"k\":2}");
        assert!(matches!(
            third.get(b"dep/bank/x").await,
            Err(StoreError::Tampered(_))
        ));
    }

    /// A store of the version that MAC'd `keys/`, `ns/` and `rt/` only
    /// (marker v1): its other records are MAC'd on start; a clear record
    /// under those three prefixes is an edit, refused, not adopted.
    #[tokio::test]
    async fn v1_store_migrated_but_its_clear_key_records_refused() {
        let (_d, store) = sled();
        let backend = store.as_sled().unwrap();
        let m = RecordMac::derive(b"s");
        backend
            .put(b"keys/good", &m.wrap(b"keys/good", b"{}"))
            .await
            .unwrap();
        backend
            .put(b"keys/forged", b"{\"namespace\":\"bank\"}")
            .await
            .unwrap();
        backend.put(b"fnver/bank/f/1", b"{}").await.unwrap();
        backend.put(MAC_MARKER, MARKER_V1).await.unwrap();
        let report = store.adopt_record_macs(m, true).await.unwrap();
        assert_eq!((report.verified, report.migrated), (1, 1));
        assert_eq!(report.refused.len(), 1);
        assert_eq!(store.get(b"fnver/bank/f/1").await.unwrap().unwrap(), b"{}");
        assert!(matches!(
            store.get(b"keys/forged").await,
            Err(StoreError::Tampered(_))
        ));
        assert_eq!(raw(&store, MAC_MARKER).await.unwrap(), MARKER_V2);
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
                    s.adopt_record_macs(RecordMac::derive(b"s"), true)
                        .await
                        .unwrap();
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

    /// Every key is covered but the three exceptions, whatever its prefix.
    #[test]
    fn covered_keys() {
        for k in [
            &b"keys/ab"[..],
            b"ns/acme",
            b"rt/cd",
            b"fnver/a/b/1",
            b"dep/a/b",
            b"depv/a/b/1",
            b"host/x",
            b"secret/a/B",
            b"_admin/session/x",
            b"_import/a",
            b"_store/other",
            b"blobs/x",
            b"_clusterx/y",
            b"",
            b"z",
        ] {
            assert!(RecordMac::covers(k), "{}", String::from_utf8_lossy(k));
        }
        for k in [&b"_cluster/jwt_key"[..], b"blob/00", MAC_MARKER] {
            assert!(!RecordMac::covers(k));
        }
        let h = ring::digest::digest(&ring::digest::SHA256, b"x");
        let key = [BLOB_PREFIX, hex::encode(h).as_bytes()].concat();
        assert!(blob_matches(&key, b"x"));
        assert!(!blob_matches(&key, b"y"));
        assert!(!blob_matches(&key.to_ascii_uppercase(), b"x"));
        assert!(!blob_matches(b"blob/short", b"x"));
    }
}
