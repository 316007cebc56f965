//! The ordered key-value store every piece of node state lives in (docs/design.md §6, §8).
//!
//! One trait, [`OrderedKv`], with get, put, delete, prefix scan, compare-and-swap,
//! put with a time to live and atomic batches. [`Store`] is the node's handle: the
//! embedded sled backend on a single node, or etcd in a cluster (cargo feature
//! `cluster`). Nothing above this module knows which backend it has.
//! [`Store::watch_prefix`] follows the changes under a prefix (etcd's watch;
//! the embedded store, a single node, never reports one).
//! [`SealKey`] and [`adopt_sealed`] keep the cluster's secrets in the shared
//! store as ciphertext (`seal.rs`). [`RecordMac`] authenticates the records
//! that confer authority (API keys, namespaces, refresh tokens): the store
//! MACs them on write and refuses one whose MAC fails on read (`record_mac.rs`).

#![forbid(unsafe_code)]

mod blob_files;
pub mod blob_ledger;
#[cfg(all(test, feature = "cluster"))]
pub(crate) mod etcd_process;
#[cfg(feature = "cluster")]
mod etcd_store;
mod record_mac;
mod seal;
mod sled_store;

/// A journal's value as `apply_journaled` writes it: a test leaves one in
/// the store, as an importer that died past its commit point would.
#[cfg(all(test, feature = "cluster"))]
pub(crate) use etcd_store::encode_journal;
#[cfg(feature = "cluster")]
pub use etcd_store::{
    ConnectError as EtcdConnectError, EtcdAccess, EtcdMember, EtcdStore, EtcdWatch,
    REQUEST_TIMEOUT as ETCD_REQUEST_TIMEOUT,
};
pub use record_mac::{
    MAC_MARKER, MAC_OVERHEAD, MAC_PREFIXES, MAC_V1, MacError, RECORD_MAC_INFO, RecordMac,
};
pub use seal::{Adopted, Adoption, SEAL_INFO, SEAL_V1, SealError, SealKey, adopt_sealed};
pub use sled_store::{SWEEP_INTERVAL, SledStore};

use std::borrow::Cow;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// What the store can fail with.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The data folder is held by another meshgate process.
    #[error("the data folder {0} is in use by another meshgate process")]
    Locked(String),
    /// The data folder cannot be created or written.
    #[error("the data folder {path} is not usable: {reason}")]
    Unusable {
        /// The data folder (or file in it) that failed.
        path: String,
        /// The operating system's or sled's error.
        reason: String,
    },
    /// The backend is unreachable or failed; the operation may be retried.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A stored value does not decode.
    #[error("corrupt value under {0}")]
    Corrupt(String),
    /// A record that must carry a MAC (`record_mac.rs`) does not verify:
    /// refused, never trusted (and logged at WARN with its key).
    #[error("the record under {0} fails its MAC (edited in the store?); refused")]
    Tampered(String),
}

/// The result of every store operation.
pub type StoreResult<T> = Result<T, StoreError>;

/// One write of an atomic batch.
#[derive(Debug, Clone)]
pub enum BatchOp {
    /// Writes the value (second) under the key (first), with no time to live.
    Put(Vec<u8>, Vec<u8>),
    /// Removes the key; absent keys are no error.
    Delete(Vec<u8>),
}

/// The ordered-KV contract shared by every backend. Writes are durable when
/// their future resolves.
pub trait OrderedKv: Send + Sync {
    /// The value under `key`; None when absent (or its time to live ran out).
    fn get(&self, key: &[u8]) -> impl Future<Output = StoreResult<Option<Vec<u8>>>> + Send;
    /// Writes `value` under `key`, replacing any value and time to live.
    fn put(&self, key: &[u8], value: &[u8]) -> impl Future<Output = StoreResult<()>> + Send;
    /// Like `put`, but the key vanishes after `ttl`.
    fn put_ttl(
        &self,
        key: &[u8],
        value: &[u8],
        ttl: Duration,
    ) -> impl Future<Output = StoreResult<()>> + Send;
    /// Returns whether the key existed.
    fn delete(&self, key: &[u8]) -> impl Future<Output = StoreResult<bool>> + Send;
    /// Keys starting with `prefix`, in byte order, at most `limit`.
    fn scan_prefix(
        &self,
        prefix: &[u8],
        limit: usize,
    ) -> impl Future<Output = StoreResult<Vec<(Vec<u8>, Vec<u8>)>>> + Send;
    /// Sets `key` to `new` (None deletes) only if it currently holds `expected`
    /// (None: absent). Returns whether the swap happened.
    fn compare_and_swap(
        &self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
        ttl: Option<Duration>,
    ) -> impl Future<Output = StoreResult<bool>> + Send;
    /// Applies every op or none.
    fn apply_batch(&self, ops: Vec<BatchOp>) -> impl Future<Output = StoreResult<()>> + Send;
    /// Makes every acknowledged write durable.
    fn flush(&self) -> impl Future<Output = StoreResult<()>> + Send;
}

/// A change to one key under a watched prefix (see [`Store::watch_prefix`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The key was written (created, replaced, or given a new time to live).
    Put(Vec<u8>),
    /// The key was deleted, or its time to live ran out.
    Delete(Vec<u8>),
}

/// The changes under a prefix, as they happen; dropping it ends the watch.
pub struct PrefixWatch(WatchInner);

enum WatchInner {
    /// The embedded store: one node, no other writer to hear from.
    Never,
    /// An etcd watch on the prefix.
    #[cfg(feature = "cluster")]
    Etcd(Box<EtcdWatch>),
}

impl PrefixWatch {
    /// The next changes, in order (at least one). An error means the watch
    /// broke and changes may have been missed: watch again, then re-read the
    /// prefix. On the embedded store this never returns.
    pub async fn next(&mut self) -> StoreResult<Vec<Change>> {
        match &mut self.0 {
            WatchInner::Never => std::future::pending().await,
            #[cfg(feature = "cluster")]
            WatchInner::Etcd(w) => w.next().await,
        }
    }
}

/// The node's store handle (cheap to clone): a backend, and the MAC the
/// authority-bearing records carry once the node installed it
/// ([`Store::adopt_record_macs`]; `record_mac.rs`).
#[derive(Clone)]
pub struct Store {
    backend: Backend,
    /// Shared by every clone; empty until start-up installs the key.
    mac: Arc<OnceLock<RecordMac>>,
}

/// Where the store's records live.
#[derive(Clone)]
enum Backend {
    /// The embedded store of a single node (`data_dir/db`).
    Sled(SledStore),
    /// The etcd cluster every member of a cluster shares.
    #[cfg(feature = "cluster")]
    Etcd(EtcdStore),
}

impl Store {
    fn on(backend: Backend) -> Store {
        Store {
            backend,
            mac: Arc::default(),
        }
    }

    /// What is written for `value` under `key`: MAC'd when `key` is covered
    /// and the MAC is installed.
    fn out<'a>(&self, key: &[u8], value: &'a [u8]) -> Cow<'a, [u8]> {
        match self.mac.get() {
            Some(m) if RecordMac::covers(key) => Cow::Owned(m.wrap(key, value)),
            _ => Cow::Borrowed(value),
        }
    }

    /// [`Store::out`] for each put of a batch.
    fn ops_out(&self, mut ops: Vec<BatchOp>) -> Vec<BatchOp> {
        if let Some(m) = self.mac.get() {
            for op in &mut ops {
                if let BatchOp::Put(k, v) = op
                    && RecordMac::covers(k)
                {
                    *v = m.wrap(k, v);
                }
            }
        }
        ops
    }

    /// The value of the record read under `key`: a covered record whose MAC
    /// fails is refused (`Tampered`) and logged.
    fn value_in(&self, key: &[u8], mut record: Vec<u8>) -> StoreResult<Vec<u8>> {
        match self.mac.get() {
            Some(m) if RecordMac::covers(key) => match m.open(key, &record) {
                Ok(_) => {
                    record.drain(..MAC_OVERHEAD);
                    Ok(record)
                }
                Err(e) => Err(tampered(key, e)),
            },
            _ => Ok(record),
        }
    }

    /// [`Store::value_in`] for the rows of a scan: a refused row is left out.
    fn rows_in(&self, rows: &mut Vec<(Vec<u8>, Vec<u8>)>) {
        let Some(m) = self.mac.get() else { return };
        rows.retain_mut(|(k, v)| {
            if !RecordMac::covers(k) {
                return true;
            }
            match m.open(k, v) {
                Ok(_) => {
                    v.drain(..MAC_OVERHEAD);
                    true
                }
                Err(e) => {
                    tampered(k, e);
                    false
                }
            }
        });
    }

    /// Opens the embedded store under `data_dir/db`.
    pub fn open_sled(data_dir: &std::path::Path) -> StoreResult<Store> {
        Ok(Store::on(Backend::Sled(SledStore::open(data_dir)?)))
    }

    /// Connects to the etcd cluster at `endpoints` (`http://host:port`, or
    /// `https://host:port` with TLS in `access`).
    #[cfg(feature = "cluster")]
    pub async fn open_etcd(
        endpoints: &[String],
        access: &EtcdAccess,
    ) -> Result<Store, EtcdConnectError> {
        Ok(Store::on(Backend::Etcd(
            EtcdStore::connect_with(endpoints, access).await?,
        )))
    }

    /// Closes the store; on sled, waits until the data folder is free for
    /// another process (see `SledStore::close`).
    pub fn close(self) {
        match self.backend {
            Backend::Sled(s) => s.close(),
            #[cfg(feature = "cluster")]
            Backend::Etcd(_) => {}
        }
    }

    /// The etcd backend (its member list, for the egress policy); None on sled.
    #[cfg(feature = "cluster")]
    pub fn as_etcd(&self) -> Option<&EtcdStore> {
        match &self.backend {
            Backend::Etcd(s) => Some(s),
            Backend::Sled(_) => None,
        }
    }

    /// The embedded backend, which needs its expired keys swept; None on etcd,
    /// whose leases remove them.
    pub fn as_sled(&self) -> Option<&SledStore> {
        match &self.backend {
            Backend::Sled(s) => Some(s),
            #[cfg(feature = "cluster")]
            Backend::Etcd(_) => None,
        }
    }

    /// Watches the keys under `prefix` for changes other writers (other
    /// nodes) make. Once it returns, a scan misses no later change. On the
    /// embedded store (a single node) the watch never reports anything.
    pub async fn watch_prefix(&self, prefix: &[u8]) -> StoreResult<PrefixWatch> {
        match &self.backend {
            Backend::Sled(_) => {
                let _ = prefix;
                Ok(PrefixWatch(WatchInner::Never))
            }
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => Ok(PrefixWatch(WatchInner::Etcd(Box::new(
                s.watch_prefix(prefix).await?,
            )))),
        }
    }

    /// Applies `ops` without waiting for the disk on the embedded store, and
    /// there one by one, not as one atomic batch: sled writes them out in its
    /// own background flush (every 500 ms) or with the next durable write,
    /// so a crash may lose the last of them, or part of one call's `ops`.
    /// (A sled batch seals sled's log buffer and wakes all seven of its I/O
    /// threads for the write: about 1,500 wake-ups a second under an invoke
    /// load, BENCHMARKS.md.) For data the node can lose and that needs no
    /// atomicity (invocation records and their trim, written after their
    /// call was answered); never for what a caller was told is stored. On
    /// etcd the same as `apply_batch` (one transaction; raft makes every
    /// write durable).
    pub async fn apply_buffered(&self, ops: Vec<BatchOp>) -> StoreResult<()> {
        let ops = self.ops_out(ops);
        match &self.backend {
            Backend::Sled(s) => s.apply_each_buffered(ops),
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => Box::pin(s.apply_batch(ops)).await,
        }
    }

    /// Whether [`OrderedKv::apply_batch`] of `ops` lands all at once for
    /// every reader on this backend: always on sled (one sled batch); on etcd
    /// only when it fits one transaction (`etcd_store::atomic_check`).
    /// Otherwise the reason, naming the limit.
    pub fn check_atomic(&self, ops: &[BatchOp]) -> Result<(), String> {
        match &self.backend {
            Backend::Sled(_) => {
                let _ = ops;
                Ok(())
            }
            #[cfg(feature = "cluster")]
            Backend::Etcd(_) => etcd_store::atomic_check(ops),
        }
    }

    /// Reads `key` unless the journal `journal` of a change in progress is
    /// there ([`Store::apply_journaled`]), checked in the same step as the
    /// read; `None` then (wait and retry, or [`Store::roll_forward`]).
    pub async fn get_unless(
        &self,
        key: &[u8],
        journal: &[u8],
    ) -> StoreResult<Option<Option<Vec<u8>>>> {
        let raw = match &self.backend {
            // One sled batch is atomic: an import never leaves a journal here.
            Backend::Sled(s) => {
                let _ = journal;
                Some(s.get(key).await?)
            }
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => Box::pin(s.get_unless(key, journal)).await?,
        };
        match raw {
            Some(Some(r)) => Ok(Some(Some(self.value_in(key, r)?))),
            other => Ok(other),
        }
    }

    /// Scans each of `prefixes` (at most `limit` keys each) unless `journal`
    /// is there; on etcd all as of one revision.
    pub async fn scan_unless(
        &self,
        prefixes: &[Vec<u8>],
        limit: usize,
        journal: &[u8],
    ) -> StoreResult<Option<Vec<Vec<(Vec<u8>, Vec<u8>)>>>> {
        let mut scans = match &self.backend {
            Backend::Sled(s) => {
                let _ = journal;
                let mut out = Vec::with_capacity(prefixes.len());
                for p in prefixes {
                    out.push(s.scan_prefix(p, limit).await?);
                }
                Some(out)
            }
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => Box::pin(s.scan_unless(prefixes, limit, journal)).await?,
        };
        for rows in scans.iter_mut().flatten() {
            self.rows_in(rows);
        }
        Ok(scans)
    }

    /// The keys under `prefix` (at most `limit`), without reading their
    /// values, unless `journal` is there (`None` then). For prefixes whose
    /// records carry no MAC (a namespace's KV).
    pub async fn scan_keys_unless(
        &self,
        prefix: &[u8],
        limit: usize,
        journal: &[u8],
    ) -> StoreResult<Option<Vec<Vec<u8>>>> {
        match &self.backend {
            Backend::Sled(s) => {
                let _ = journal;
                s.scan_keys(prefix, limit).map(Some)
            }
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => Box::pin(s.scan_keys_unless(prefix, limit, journal)).await,
        }
    }

    /// Puts (`Some`) or deletes (`None`) `key` unless `journal` is there
    /// (`None` then); for a delete, whether the key existed.
    pub async fn write_unless(
        &self,
        key: &[u8],
        value: Option<&[u8]>,
        journal: &[u8],
    ) -> StoreResult<Option<bool>> {
        let value = value.map(|v| self.out(key, v));
        let value = value.as_deref();
        match &self.backend {
            Backend::Sled(s) => {
                let _ = journal;
                Ok(Some(match value {
                    Some(v) => {
                        s.put(key, v).await?;
                        false
                    }
                    None => s.delete(key).await?,
                }))
            }
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => Box::pin(s.write_unless(key, value, journal)).await,
        }
    }

    /// A guarded read-modify-write over a few keys: reads `keys`, hands their
    /// values (in order) to `decide`, and applies the writes it returns, only
    /// if none of `keys` changed in between (else it reads and decides again,
    /// so `decide` must be pure) and `journal` (if named) is absent. `None`
    /// while the journal is there (as `write_unless`); `Some(Err)` when
    /// `decide` refused, nothing written. The writes must fit one store
    /// transaction ([`Store::check_atomic`]). Counters kept beside the data
    /// (a namespace's usage, `quota.rs`) stay exact this way on every node.
    pub async fn transact<T, E, F>(
        &self,
        keys: &[Vec<u8>],
        journal: Option<&[u8]>,
        decide: F,
    ) -> StoreResult<Option<Result<T, E>>>
    where
        F: Fn(&[Option<Vec<u8>>]) -> Result<(Vec<BatchOp>, T), E> + Send + Sync,
        T: Send,
        E: Send,
    {
        // The records that carry MACs are never read-modify-written here.
        if keys.iter().any(|k| RecordMac::covers(k)) {
            return Err(StoreError::Unavailable(
                "a guarded change cannot read a MAC'd record".into(),
            ));
        }
        let decide =
            |vals: &[Option<Vec<u8>>]| decide(vals).map(|(ops, out)| (self.ops_out(ops), out));
        match &self.backend {
            // One sled transaction: an import never leaves a journal here.
            Backend::Sled(s) => {
                let _ = journal;
                s.transact(keys, decide).await.map(Some)
            }
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => Box::pin(s.transact(keys, journal, decide)).await,
        }
    }

    /// Applies `steps` then `last` as one change for every reader and writer
    /// that names `journal` (`*_unless`), of any size, and completes it after
    /// a crash ([`Store::roll_forward`]). On sled one batch. On etcd one
    /// transaction when it fits; else the whole change is first written as
    /// the journal's value (the commit point), then `steps` go in several
    /// transactions and `last` in one with the journal's deletion, so `last`
    /// must fit one ([`Store::check_atomic`]). Readers that do not name the
    /// journal may see `steps` land in parts, never `last`.
    pub async fn apply_journaled(
        &self,
        journal: &[u8],
        steps: Vec<BatchOp>,
        last: Vec<BatchOp>,
    ) -> StoreResult<()> {
        let (steps, last) = (self.ops_out(steps), self.ops_out(last));
        match &self.backend {
            Backend::Sled(s) => {
                let _ = journal;
                let mut all = steps;
                all.extend(last);
                s.apply_batch(all).await
            }
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => Box::pin(s.apply_journaled(journal, steps, last)).await,
        }
    }

    /// Completes the journaled change under `journal` left by a writer that
    /// stopped half way (or still running: the work is not done twice).
    /// Returns whether there was one.
    pub async fn roll_forward(&self, journal: &[u8]) -> StoreResult<bool> {
        match &self.backend {
            Backend::Sled(_) => {
                let _ = journal;
                Ok(false)
            }
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => Box::pin(s.roll_forward(journal)).await,
        }
    }

    /// Scans every key under a prefix (no limit).
    pub async fn scan_all(&self, prefix: &[u8]) -> StoreResult<Vec<(Vec<u8>, Vec<u8>)>> {
        self.scan_prefix(prefix, usize::MAX).await
    }

    /// Reads and JSON-decodes a value.
    pub async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        key: &[u8],
    ) -> StoreResult<Option<T>> {
        match self.get(key).await? {
            Some(v) => serde_json::from_slice(&v)
                .map(Some)
                .map_err(|_| StoreError::Corrupt(String::from_utf8_lossy(key).into_owned())),
            None => Ok(None),
        }
    }

    /// JSON-encodes and writes a value.
    pub async fn put_json<T: serde::Serialize>(&self, key: &[u8], value: &T) -> StoreResult<()> {
        self.put(key, &serde_json::to_vec(value).expect("serializable"))
            .await
    }
}

/// Each operation on its backend. The etcd arm's future (a gRPC call,
/// kilobytes) is boxed: inline, it made every future that awaits the store
/// that large on sled too, and the request path moves such futures whole
/// into actix's boxes (docs/architecture.md, "Futures on the request path"). One
/// small allocation per call on etcd, beside a network round trip.
macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match &$self.backend {
            Backend::Sled($s) => $e,
            #[cfg(feature = "cluster")]
            Backend::Etcd($s) => Box::pin(async { $e }).await,
        }
    };
}

impl OrderedKv for Store {
    async fn get(&self, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        match delegate!(self, s => s.get(key).await)? {
            Some(r) => Ok(Some(self.value_in(key, r)?)),
            None => Ok(None),
        }
    }
    async fn put(&self, key: &[u8], value: &[u8]) -> StoreResult<()> {
        let value = self.out(key, value);
        delegate!(self, s => s.put(key, &value).await)
    }
    async fn put_ttl(&self, key: &[u8], value: &[u8], ttl: Duration) -> StoreResult<()> {
        let value = self.out(key, value);
        delegate!(self, s => s.put_ttl(key, &value, ttl).await)
    }
    async fn delete(&self, key: &[u8]) -> StoreResult<bool> {
        delegate!(self, s => s.delete(key).await)
    }
    async fn scan_prefix(
        &self,
        prefix: &[u8],
        limit: usize,
    ) -> StoreResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut rows = delegate!(self, s => s.scan_prefix(prefix, limit).await)?;
        self.rows_in(&mut rows);
        Ok(rows)
    }
    async fn compare_and_swap(
        &self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
        ttl: Option<Duration>,
    ) -> StoreResult<bool> {
        // The MAC is deterministic: the expected value, MAC'd, is the stored record.
        let expected = expected.map(|v| self.out(key, v));
        let new = new.map(|v| self.out(key, v));
        let (expected, new) = (expected.as_deref(), new.as_deref());
        delegate!(self, s => s.compare_and_swap(key, expected, new, ttl).await)
    }
    async fn apply_batch(&self, ops: Vec<BatchOp>) -> StoreResult<()> {
        let ops = self.ops_out(ops);
        delegate!(self, s => s.apply_batch(ops).await)
    }
    async fn flush(&self) -> StoreResult<()> {
        delegate!(self, s => s.flush().await)
    }
}

/// Logs a record refused for its MAC and names the error for the caller.
fn tampered(key: &[u8], why: MacError) -> StoreError {
    let key = String::from_utf8_lossy(key).into_owned();
    tracing::warn!(key = %key, reason = %why, "Store record refused: its MAC does not verify.");
    StoreError::Tampered(key)
}

/// What [`Store::adopt_record_macs`] found and did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MacAdoption {
    /// Records that already carried a valid MAC.
    pub verified: usize,
    /// Clear records of an older version MAC'd in place by this node.
    pub migrated: usize,
    /// Records refused (a bad MAC, or in the clear after the migration): left
    /// as they are, refused on every read; their keys.
    pub refused: Vec<String>,
}

impl Store {
    /// Installs the record MAC (start-up, once the secret it derives from is
    /// settled): from now on the store MACs every record under
    /// [`MAC_PREFIXES`] it writes and refuses one whose MAC fails on read.
    ///
    /// Records an older version wrote in the clear (JSON) are MAC'd in place,
    /// by compare-and-swap from the clear value, only while the store has never
    /// been migrated: no [`MAC_MARKER`] and no record with a valid MAC. Then
    /// the marker is written. After that a clear record is somebody's edit and
    /// stays refused. Two nodes starting at once agree: the MAC is
    /// deterministic, so both would write the same bytes, and the loser's
    /// compare-and-swap simply finds them there.
    pub async fn adopt_record_macs(&self, mac: RecordMac) -> StoreResult<MacAdoption> {
        let migrated_before = delegate!(self, s => s.get(MAC_MARKER).await)?.is_some();
        let mut report = MacAdoption::default();
        let mut clear = Vec::new();
        for prefix in MAC_PREFIXES {
            for (k, v) in delegate!(self, s => s.scan_prefix(prefix, usize::MAX).await)? {
                match mac.open(&k, &v) {
                    Ok(_) => report.verified += 1,
                    Err(MacError::Missing) if record_mac::is_clear_record(&v) => clear.push((k, v)),
                    Err(e) => report.refused.push(tampered(&k, e).to_string()),
                }
            }
        }
        if !migrated_before && report.verified == 0 {
            for (k, v) in clear {
                let Some(ttl) = migration_ttl(&k, &v) else {
                    continue;
                };
                let new = mac.wrap(&k, &v);
                let swapped =
                    delegate!(self, s => s.compare_and_swap(&k, Some(&v), Some(&new), ttl).await)?;
                // A lost swap: another node migrated it (the same bytes) or it changed.
                report.migrated += usize::from(swapped);
            }
        } else {
            for (k, _) in clear {
                report
                    .refused
                    .push(tampered(&k, MacError::Missing).to_string());
            }
        }
        if !migrated_before {
            delegate!(self, s => s.compare_and_swap(MAC_MARKER, None, Some(b"v1"), None).await)?;
        }
        // A second install (a test reusing a store) keeps the first key.
        let _ = self.mac.set(mac);
        Ok(report)
    }
}

/// The time to live a clear record keeps when it is MAC'd: a refresh token's
/// (`rt/`) runs to its `expires_at`; `None` (outer) for one already expired,
/// left to lapse; the others have none.
fn migration_ttl(key: &[u8], value: &[u8]) -> Option<Option<Duration>> {
    if !key.starts_with(b"rt/") {
        return Some(None);
    }
    let expires_at = serde_json::from_slice::<serde_json::Value>(value)
        .ok()?
        .get("expires_at")?
        .as_u64()?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    (expires_at > now).then(|| Some(Duration::from_secs(expires_at - now)))
}

/// `blob/<sha256>`: content-addressed bytes (function modules, site files),
/// shared by every namespace that stores the same bytes.
pub fn blob_key(sha256_hex: &str) -> Vec<u8> {
    format!("blob/{sha256_hex}").into_bytes()
}

#[cfg(test)]
mod future_size_tests {
    use super::*;

    /// On sled, a store call's future is small: the etcd arm's gRPC call is
    /// boxed (it was 6.7 KiB inline, in every future awaiting the store).
    #[test]
    fn store_futures_are_small_on_sled() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        let sizes = [
            ("get", size_of_val(&store.get(b"k"))),
            (
                "get_json",
                size_of_val(&store.get_json::<serde_json::Value>(b"k")),
            ),
            ("get_unless", size_of_val(&store.get_unless(b"k", b"j"))),
            ("apply_batch", size_of_val(&store.apply_batch(vec![]))),
            ("scan_prefix", size_of_val(&store.scan_prefix(b"k", 1))),
        ];
        for (what, size) in sizes {
            assert!(size < 512, "Store::{what}'s future is {size} bytes");
        }
    }
}
