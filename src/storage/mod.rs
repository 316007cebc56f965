//! The ordered key-value store every piece of node state lives in (docs/design.md §6, §8).
//!
//! One trait, [`OrderedKv`], with get, put, delete, prefix scan, compare-and-swap,
//! put with a time to live and atomic batches. [`Store`] is the node's handle: the
//! embedded sled backend on a single node, or etcd in a cluster (cargo feature
//! `cluster`). Nothing above this module knows which backend it has.
//! [`Store::watch_prefix`] follows the changes under a prefix (etcd's watch;
//! the embedded store, a single node, never reports one).
//! [`SealKey`] and [`adopt_sealed`] keep the cluster's secrets in the shared
//! store as ciphertext (`seal.rs`). [`RecordMac`] authenticates every other
//! record: once start-up installed it ([`Store::adopt_record_macs`]), the
//! store MACs each record it writes, whatever its key, and refuses (logs and
//! counts) one whose MAC fails on any read: get, scan, compare-and-swap,
//! guarded change, journal, watch (`record_mac.rs`; docs/decisions.md
//! "Every store record authenticated").

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
    BLOB_PREFIX, MAC_MARKER, MAC_OVERHEAD, MAC_V1, MARKER_V1, MARKER_V2, MacError, RECORD_MAC_INFO,
    RecordMac, SEALED_PREFIX, V1_PREFIXES, blob_matches,
};
pub use seal::{Adopted, Adoption, SEAL_INFO, SEAL_V1, SealError, SealKey, adopt_sealed};
pub use sled_store::{SWEEP_INTERVAL, SledStore};

use std::borrow::Cow;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// A record whose MAC (`record_mac.rs`), or a blob whose hash, does not
    /// verify: refused, never trusted (logged at WARN with its key, counted
    /// in `meshgate_store_records_refused_total`).
    #[error("the record under {0} fails its MAC (edited in the store?); refused")]
    Tampered(String),
    /// Records without a MAC in a store not marked migrated, and no consent
    /// to MAC them ([`Store::adopt_record_macs`]).
    #[error(
        "{0} store records carry no MAC and the store is not marked migrated: if an older meshgate wrote this store, start once with [server] adopt_store_records = true (MESHGATE_SERVER_ADOPT_STORE_RECORDS=true); otherwise someone who can write the store stripped them, and nothing is adopted"
    )]
    Unmigrated(usize),
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
/// A put whose record fails its MAC is left out (refused and counted as
/// any read), so a forged record does not even make a watcher re-read.
pub struct PrefixWatch(
    WatchInner,
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))] Store,
);

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
            WatchInner::Etcd(w) => loop {
                let changes = w.next_with_values().await?;
                let changes: Vec<Change> = changes
                    .into_iter()
                    .filter(|(c, value)| match (c, value) {
                        // A large value is not in the event: its reader reads
                        // (and verifies) it.
                        (Change::Put(k), Some(v)) => self.1.verified(k, v).is_ok(),
                        _ => true,
                    })
                    .map(|(c, _)| c)
                    .collect();
                if !changes.is_empty() {
                    return Ok(changes);
                }
            },
        }
    }
}

/// The node's store handle (cheap to clone): a backend, and the MAC every
/// record carries once the node installed it ([`Store::adopt_record_macs`];
/// `record_mac.rs`).
#[derive(Clone)]
pub struct Store {
    backend: Backend,
    /// Shared by every clone; empty until start-up installs the key.
    mac: Arc<OnceLock<RecordMac>>,
    /// Records refused, shared by every clone.
    refused: Arc<Refusals>,
}

/// The count of refused records: kept here until the node hands the store
/// its metric ([`Store::count_refusals`]), then added to it.
#[derive(Default)]
struct Refusals {
    /// Refused before the metric was handed over.
    early: AtomicU64,
    /// `meshgate_store_records_refused_total`.
    counter: OnceLock<prometheus::IntCounter>,
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
            refused: Arc::default(),
        }
    }

    /// Counts refused records in `counter` from now on (and those refused
    /// before, at start-up).
    pub fn count_refusals(&self, counter: prometheus::IntCounter) {
        let early = self.refused.early.swap(0, Ordering::Relaxed);
        counter.inc_by(early);
        let _ = self.refused.counter.set(counter);
    }

    /// Logs and counts a refused record; the error for the caller.
    fn refuse(&self, key: &[u8], why: MacError) -> StoreError {
        match self.refused.counter.get() {
            Some(c) => c.inc(),
            None => {
                self.refused.early.fetch_add(1, Ordering::Relaxed);
            }
        }
        tampered(key, why)
    }

    /// Where the value starts in the record read under `key`, once it is
    /// verified: past the MAC of a covered record, 0 for a blob whose bytes
    /// hash to its key and for the other exceptions (`record_mac.rs`) or
    /// before the MAC is installed. A record that fails is refused.
    fn verified(&self, key: &[u8], record: &[u8]) -> StoreResult<usize> {
        let Some(m) = self.mac.get() else {
            return Ok(0);
        };
        if RecordMac::covers(key) {
            return match m.open(key, record) {
                Ok(_) => Ok(MAC_OVERHEAD),
                Err(e) => Err(self.refuse(key, e)),
            };
        }
        if key.starts_with(BLOB_PREFIX) && !blob_matches(key, record) {
            return Err(self.refuse(key, MacError::Content));
        }
        Ok(0)
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
        let at = self.verified(key, &record)?;
        record.drain(..at);
        Ok(record)
    }

    /// [`Store::value_in`] for the rows of a scan: a refused row is left out.
    fn rows_in(&self, rows: &mut Vec<(Vec<u8>, Vec<u8>)>) {
        if self.mac.get().is_none() {
            return;
        }
        rows.retain_mut(|(k, v)| match self.verified(k, v) {
            Ok(at) => {
                v.drain(..at);
                true
            }
            Err(_) => false,
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
                Ok(PrefixWatch(WatchInner::Never, self.clone()))
            }
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => Ok(PrefixWatch(
                WatchInner::Etcd(Box::new(s.watch_prefix(prefix).await?)),
                self.clone(),
            )),
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
            // Measured as written: with their MACs.
            #[cfg(feature = "cluster")]
            Backend::Etcd(_) => etcd_store::atomic_check(&self.ops_out(ops.to_vec())),
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
    /// values, unless `journal` is there (`None` then). Names only: with no
    /// value read there is no record to verify (nor to use); whoever reads
    /// a value under one of these keys gets it verified (a listing of large
    /// values must not read them: docs/decisions.md "Every store record
    /// authenticated").
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
        // `decide` sees the values verified (a refused record ends the
        // change: nothing written) and its writes are MAC'd.
        let decide = |raw: &[Option<Vec<u8>>]| {
            let mut vals = Vec::with_capacity(raw.len());
            for (k, r) in keys.iter().zip(raw) {
                match r {
                    Some(r) => match self.verified(k, r) {
                        Ok(at) => vals.push(Some(r[at..].to_vec())),
                        Err(e) => return Err(Decided::Refused(e)),
                    },
                    None => vals.push(None),
                }
            }
            decide(&vals)
                .map(|(ops, out)| (self.ops_out(ops), out))
                .map_err(Decided::No)
        };
        let r = match &self.backend {
            // One sled transaction: an import never leaves a journal here.
            Backend::Sled(s) => {
                let _ = journal;
                s.transact(keys, decide).await.map(Some)
            }
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => Box::pin(s.transact(keys, journal, decide)).await,
        }?;
        match r {
            None => Ok(None),
            Some(Ok(out)) => Ok(Some(Ok(out))),
            Some(Err(Decided::No(e))) => Ok(Some(Err(e))),
            Some(Err(Decided::Refused(e))) => Err(e),
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
            Backend::Etcd(s) => {
                let seal = |v: Vec<u8>| self.out(journal, &v).into_owned();
                let open = |r: Vec<u8>| self.value_in(journal, r);
                Box::pin(s.apply_journaled(journal, steps, last, seal, open)).await
            }
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
            Backend::Etcd(s) => {
                Box::pin(s.roll_forward(journal, |r| self.value_in(journal, r))).await
            }
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

/// What a guarded change's decision came to (`Store::transact`): the
/// caller's refusal, or a record read that failed its MAC.
enum Decided<E> {
    No(E),
    Refused(StoreError),
}

/// Logs a record refused for its MAC and names the error for the caller.
impl Store {
    /// Scans every key under a prefix like [`scan_all`](Self::scan_all),
    /// but a refused record (logged and counted as always) fails the whole
    /// scan instead of being left out: for a reader that must see every
    /// record or act on none. The blob sweep marks with it: a record a
    /// store writer spoiled would otherwise leave its blob unnamed, and the
    /// sweep would delete what the genuine record names.
    pub async fn scan_all_strict(&self, prefix: &[u8]) -> StoreResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut rows = delegate!(self, s => s.scan_prefix(prefix, usize::MAX).await)?;
        for (k, v) in rows.iter_mut() {
            let at = self.verified(k, v)?;
            v.drain(..at);
        }
        Ok(rows)
    }
}

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
    /// settled): from now on the store MACs every record it writes (all but
    /// the exceptions [`RecordMac::covers`] names) and refuses one whose MAC
    /// fails on any read.
    ///
    /// A store marked [`MARKER_V2`] is done: nothing is read (every read
    /// verifies). Otherwise every record is looked at once (keys first, then
    /// one value at a time). Records an older version wrote without a MAC are
    /// MAC'd in place, by compare-and-swap from the value read (time to live
    /// kept), only while the store was never migrated: no marker and no record
    /// with a valid MAC (a deleted marker does not make a migrated store look
    /// new); in a store marked [`MARKER_V1`] only the records outside
    /// [`V1_PREFIXES`], which carried MACs already. Then the marker is written.
    /// A record without a valid MAC that is not migrated is somebody's edit
    /// and stays refused. Two nodes starting at once agree: the MAC is
    /// deterministic, so both would write the same bytes, and the loser's
    /// compare-and-swap simply finds them there.
    ///
    /// `migrate`: the operator's consent (`[server] adopt_store_records`).
    /// Without it, records that would be MAC'd in place stop the start
    /// instead ([`StoreError::Unmigrated`]): a store whose every MAC a
    /// writer stripped, its marker deleted, looks just like an older
    /// version's, and adopting it would MAC the writer's forgeries.
    pub async fn adopt_record_macs(
        &self,
        mac: RecordMac,
        migrate: bool,
    ) -> StoreResult<MacAdoption> {
        let marker = delegate!(self, s => s.get(MAC_MARKER).await)?;
        let mut report = MacAdoption::default();
        if marker.as_deref() == Some(MARKER_V2) {
            let _ = self.mac.set(mac);
            return Ok(report);
        }
        let v1 = marker.as_deref() == Some(MARKER_V1);
        let keys = match &self.backend {
            Backend::Sled(s) => s.scan_keys(b"", usize::MAX)?,
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => Box::pin(s.scan_keys_unless(b"", usize::MAX, NO_JOURNAL))
                .await?
                .unwrap_or_default(),
        };
        // Keys whose record carries no valid MAC, and whether they may be
        // MAC'd in place (an older version's record).
        let mut unmacd = Vec::new();
        for k in keys.into_iter().filter(|k| RecordMac::covers(k)) {
            let Some(v) = delegate!(self, s => s.get(&k).await)? else {
                continue;
            };
            match mac.open(&k, &v) {
                Ok(_) => report.verified += 1,
                Err(e) => {
                    let older = !(v1 && V1_PREFIXES.iter().any(|p| k.starts_with(p)));
                    unmacd.push((k, e, older));
                }
            }
        }
        // A record of the first marker's prefixes with a MAC does not show a
        // migration to v2 ran; any other does.
        let migrated_before = match marker.as_deref() {
            None => report.verified > 0,
            Some(m) => m != MARKER_V1,
        };
        let to_migrate = unmacd
            .iter()
            .filter(|(_, _, older)| !migrated_before && *older)
            .count();
        if to_migrate > 0 && !migrate {
            return Err(StoreError::Unmigrated(to_migrate));
        }
        for (k, e, older) in unmacd {
            if migrated_before || !older {
                report.refused.push(self.refuse(&k, e).to_string());
                continue;
            }
            let Some(v) = delegate!(self, s => s.get(&k).await)? else {
                continue;
            };
            // MAC'd meanwhile by another node migrating too, or lapsed.
            if mac.open(&k, &v).is_ok() || lapsed(&k, &v) {
                continue;
            }
            let new = mac.wrap(&k, &v);
            let swapped = match &self.backend {
                Backend::Sled(s) => s.replace_keeping_ttl(&k, &v, &new).await?,
                #[cfg(feature = "cluster")]
                Backend::Etcd(s) => Box::pin(s.replace_keeping_ttl(&k, &v, &new)).await?,
            };
            // A lost swap: another node migrated it (the same bytes) or it changed.
            report.migrated += usize::from(swapped);
        }
        let _ = delegate!(self, s => s.compare_and_swap(MAC_MARKER, marker.as_deref(), Some(MARKER_V2), None).await)?;
        // A second install (a test reusing a store) keeps the first key.
        let _ = self.mac.set(mac);
        Ok(report)
    }
}

impl Store {
    /// Whether the store's records carry MACs already (under `mac`): the
    /// marker is there, or a record verifies (a deleted marker does not make
    /// a migrated store look like an older version's). Start-up asks before
    /// it adopts the sealed `_cluster/` records: a clear one is an older
    /// version's only in a store never migrated (`seal.rs`), else somebody's
    /// edit (a signing key of their own).
    pub async fn records_macd(&self, mac: &RecordMac) -> StoreResult<bool> {
        if delegate!(self, s => s.get(MAC_MARKER).await)?.is_some() {
            return Ok(true);
        }
        let keys = match &self.backend {
            Backend::Sled(s) => s.scan_keys(b"", usize::MAX)?,
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => Box::pin(s.scan_keys_unless(b"", usize::MAX, NO_JOURNAL))
                .await?
                .unwrap_or_default(),
        };
        for k in keys.into_iter().filter(|k| RecordMac::covers(k)) {
            if let Some(v) = delegate!(self, s => s.get(&k).await)?
                && mac.open(&k, &v).is_ok()
            {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// One page of a scan ([`Store::scan_page`]): its rows, and the key to
/// resume strictly after when more follow (the last key read, even when its
/// record was refused and left out; None on the last page).
pub type ScanPage<T> = (Vec<T>, Option<Vec<u8>>);

/// The first key a scan that resumes strictly after `after` reads from.
fn start_after(prefix: &[u8], after: Option<&[u8]>) -> Vec<u8> {
    match after {
        Some(a) => {
            let mut start = a.to_vec();
            start.push(0);
            start
        }
        None => prefix.to_vec(),
    }
}

impl Store {
    /// One page of the rows under `prefix`, in key order: those strictly
    /// after `after` (None: from the first), at most `limit`, and where the
    /// next page resumes. A range read from `after` of `limit + 1` rows:
    /// neither the rows before it nor the ones past the page are read
    /// (a listing at a million namespaces reads one page, not a million).
    /// Resuming after a key, not at an offset, keeps rows written or deleted
    /// between pages from making a reader see another row twice or miss it.
    pub async fn scan_page(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> StoreResult<ScanPage<(Vec<u8>, Vec<u8>)>> {
        let start = start_after(prefix, after);
        let want = limit.saturating_add(1);
        let mut rows = delegate!(self, s => s.scan_from(prefix, &start, want).await)?;
        let next = more_after(&mut rows, limit, |(k, _)| k);
        self.rows_in(&mut rows);
        Ok((rows, next))
    }

    /// [`Store::scan_page`] of the keys alone (values neither read nor
    /// verified, as [`Store::scan_keys_unless`]), unless `journal` is there
    /// (`None` then).
    pub async fn scan_keys_page_unless(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
        journal: &[u8],
    ) -> StoreResult<Option<ScanPage<Vec<u8>>>> {
        let start = start_after(prefix, after);
        let want = limit.saturating_add(1);
        let keys = match &self.backend {
            Backend::Sled(s) => {
                let _ = journal;
                Some(s.scan_keys_from(prefix, &start, want)?)
            }
            #[cfg(feature = "cluster")]
            Backend::Etcd(s) => {
                Box::pin(s.scan_keys_from_unless(prefix, &start, want, journal)).await?
            }
        };
        Ok(keys.map(|mut keys| {
            let next = more_after(&mut keys, limit, |k| k);
            (keys, next)
        }))
    }
}

/// Cuts `rows` (read `limit + 1` at most) to `limit`; when there were more,
/// the key of the last one kept, where the next page resumes.
fn more_after<T>(rows: &mut Vec<T>, limit: usize, key: impl Fn(&T) -> &Vec<u8>) -> Option<Vec<u8>> {
    if rows.len() <= limit {
        return None;
    }
    rows.truncate(limit);
    rows.last().map(|r| key(r).clone())
}

/// A journal key no change ever uses: a scan that names it is never held up.
#[cfg(feature = "cluster")]
const NO_JOURNAL: &[u8] = b"_store/no_journal";

/// Whether the clear record `value` under `key` is a refresh token (`rt/`)
/// past its `expires_at` (or without one): not MAC'd, left to lapse.
fn lapsed(key: &[u8], value: &[u8]) -> bool {
    if !key.starts_with(b"rt/") {
        return false;
    }
    let expires_at = serde_json::from_slice::<serde_json::Value>(value)
        .ok()
        .and_then(|v| v.get("expires_at")?.as_u64());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    expires_at.is_none_or(|at| at <= now)
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

#[cfg(test)]
mod page_tests {
    use super::*;

    /// Pages of three, each resuming strictly after the last key of the
    /// page before, reach every key under the prefix once and none outside
    /// it; the last page says no more follow; keys-only pages the same.
    #[tokio::test]
    async fn scan_pages_reach_every_key_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        for k in ["p", "p/0", "p/1", "p/10", "p/2", "p/3", "p/4", "p/5", "q/0"] {
            store.put(k.as_bytes(), b"v").await.unwrap();
        }
        let mut seen = Vec::new();
        let mut after: Option<Vec<u8>> = None;
        loop {
            let (rows, next) = store.scan_page(b"p/", after.as_deref(), 3).await.unwrap();
            assert!(rows.len() <= 3);
            seen.extend(rows.into_iter().map(|(k, _)| k));
            match next {
                Some(n) => after = Some(n),
                None => break,
            }
        }
        let want: Vec<Vec<u8>> = ["p/0", "p/1", "p/10", "p/2", "p/3", "p/4", "p/5"]
            .map(|k| k.as_bytes().to_vec())
            .to_vec();
        assert_eq!(seen, want);
        let (keys, next) = store
            .scan_keys_page_unless(b"p/", Some(b"p/10"), 10, b"_j")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(keys, want[3..].to_vec());
        assert_eq!(next, None);
        // Exactly `limit` left: the page is full and the last.
        let (rows, next) = store.scan_page(b"p/", Some(b"p/2"), 3).await.unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(next, None);
    }
}
