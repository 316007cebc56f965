//! The embedded single-node backend: sled, flushed before a write is acknowledged.
//!
//! Values carry a one-byte header: `0` plain, `1` followed by an 8-byte big-endian
//! expiry (unix milliseconds). Expired values read as absent and are swept.

use super::{BatchOp, OrderedKv, StoreError, StoreResult};
use parking_lot::RwLock;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Header of a value without a time to live.
const PLAIN: u8 = 0;
/// Header of a value followed by its expiry (8 bytes, unix ms, big-endian).
const EXPIRING: u8 = 1;
/// How often expired keys are removed in the background.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// The embedded store of a single node (cheap to clone: clones share the database).
#[derive(Clone)]
pub struct SledStore {
    /// The open database under `data_dir/db`; sled's file lock keeps out a second process.
    db: sled::Db,
    /// The expiry index: `deadline (8 bytes, big-endian ms) ‖ key` for each
    /// expiring value written, so the sweep reads only what is due instead
    /// of every key of the node (which grew with the namespace count).
    expiry: sled::Tree,
    /// Queue of the group-commit thread: a write sends a waiter and is
    /// acknowledged when the fsync that follows answers it.
    flusher: std::sync::mpsc::Sender<FlushWaiter>,
    /// Write counters by key prefix ([`SledStore::write_counter`]).
    counters: Arc<RwLock<Vec<(Vec<u8>, Arc<AtomicU64>)>>>,
    /// The group-commit thread, joined by [`SledStore::close`] (it holds a
    /// handle on the database, so the folder stays locked while it runs).
    flusher_thread: Arc<parking_lot::Mutex<Option<std::thread::JoinHandle<()>>>>,
    /// Counts the flushes the group-commit thread made, once the node gave it
    /// its metric ([`SledStore::count_flushes`]).
    flushes: Arc<std::sync::OnceLock<prometheus::IntCounter>>,
    /// Content-addressed blobs, one file each (`blob_files.rs`).
    blobs: Arc<BlobFiles>,
}

use super::blob_files::BlobFiles;

fn blob_io(e: std::io::Error) -> StoreError {
    StoreError::Unavailable(format!("a blob file: {e}"))
}

/// Answered once the flush that covers the waiting write is done (or failed).
type FlushWaiter = tokio::sync::oneshot::Sender<Result<(), String>>;

/// Group commit: one thread runs sled's synchronous `flush` (fsync) for every
/// writer waiting at that moment, so concurrent writers share one fsync and a
/// write is acknowledged only once it is on disk. (sled's `flush_async` stalled
/// under concurrent writers.)
fn spawn_flusher(
    db: sled::Db,
    flushes: Arc<std::sync::OnceLock<prometheus::IntCounter>>,
) -> (
    std::sync::mpsc::Sender<FlushWaiter>,
    std::thread::JoinHandle<()>,
) {
    let (tx, rx) = std::sync::mpsc::channel::<FlushWaiter>();
    let handle = std::thread::Builder::new()
        .name("store-flusher".into())
        .spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut waiters = vec![first];
                while let Ok(w) = rx.try_recv() {
                    waiters.push(w);
                }
                let result = db.flush().map(|_| ()).map_err(|e| e.to_string());
                if let Some(c) = flushes.get() {
                    c.inc();
                }
                for w in waiters {
                    let _ = w.send(result.clone());
                }
            }
        })
        .expect("flusher thread");
    (tx, handle)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

fn encode(value: &[u8], ttl: Option<Duration>) -> Vec<u8> {
    match ttl {
        None => {
            let mut v = Vec::with_capacity(value.len() + 1);
            v.push(PLAIN);
            v.extend_from_slice(value);
            v
        }
        Some(ttl) => {
            let mut v = Vec::with_capacity(value.len() + 9);
            v.push(EXPIRING);
            v.extend_from_slice(&(now_ms() + ttl.as_millis() as u64).to_be_bytes());
            v.extend_from_slice(value);
            v
        }
    }
}

/// The expiry index's key of an expiring raw record under `key`; None for a plain one.
fn expiry_key(key: &[u8], raw: &[u8]) -> Option<Vec<u8>> {
    if raw.first() != Some(&EXPIRING) || raw.len() < 9 {
        return None;
    }
    let mut k = Vec::with_capacity(8 + key.len());
    k.extend_from_slice(&raw[1..9]);
    k.extend_from_slice(key);
    Some(k)
}

/// The expiry index's marker that it covers every expiring value (written
/// once the first open has indexed those of an older database). Longer than
/// no deadline and above every one (deadlines start with a zero byte until
/// the year 2^56 ms), so a sweep's range never reads it.
const EXPIRY_INDEXED: &[u8] = b"indexed-v1";

/// The live value inside a raw record, or None if it expired.
fn decode(raw: &[u8], now: u64) -> Option<&[u8]> {
    match *raw.first()? {
        PLAIN => Some(&raw[1..]),
        EXPIRING if raw.len() >= 9 => {
            let exp = u64::from_be_bytes(raw[1..9].try_into().ok()?);
            (exp > now).then_some(&raw[9..])
        }
        _ => None,
    }
}

fn unavailable(e: sled::Error) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

impl SledStore {
    /// Opens (creating if needed) the store under `data_dir/db`. A second process on
    /// the same folder gets [`StoreError::Locked`].
    pub fn open(data_dir: &Path) -> StoreResult<SledStore> {
        let unusable = |reason: String| StoreError::Unusable {
            path: data_dir.display().to_string(),
            reason,
        };
        std::fs::create_dir_all(data_dir).map_err(|e| unusable(e.to_string()))?;
        // Probe writability first so a read-only folder is reported as such.
        let probe = data_dir.join(".write-probe");
        std::fs::write(&probe, b"ok").map_err(|e| unusable(e.to_string()))?;
        let _ = std::fs::remove_file(&probe);
        let path = data_dir.join("db");
        let db = sled::Config::new()
            .path(&path)
            .open()
            .map_err(|e| match e {
                sled::Error::Io(io)
                    if io.kind() == std::io::ErrorKind::WouldBlock
                        || io.to_string().contains("lock") =>
                {
                    StoreError::Locked(data_dir.display().to_string())
                }
                other => unusable(other.to_string()),
            })?;
        let expiry = db
            .open_tree("expiry")
            .map_err(|e| unusable(e.to_string()))?;
        if !expiry
            .contains_key(EXPIRY_INDEXED)
            .map_err(|e| unusable(e.to_string()))?
        {
            // A database from before the index: index its expiring values once.
            for (k, v) in db.iter().flatten() {
                if let Some(x) = expiry_key(&k, &v) {
                    expiry.insert(x, &[]).map_err(|e| unusable(e.to_string()))?;
                }
            }
            expiry
                .insert(EXPIRY_INDEXED, &[])
                .map_err(|e| unusable(e.to_string()))?;
        }
        let blobs = Arc::new(BlobFiles::open(data_dir).map_err(|e| unusable(e.to_string()))?);
        let flushes = Arc::new(std::sync::OnceLock::new());
        let (flusher, thread) = spawn_flusher(db.clone(), flushes.clone());
        Ok(SledStore {
            blobs,
            db,
            expiry,
            flusher,
            counters: Arc::default(),
            flusher_thread: Arc::new(parking_lot::Mutex::new(Some(thread))),
            flushes,
        })
    }

    /// Closes the database and waits until its folder is free for another
    /// process (the last clone only: with other clones alive it only drops
    /// this one). For tools and tests that open a node's folder and then
    /// start the node on it.
    pub fn close(self) {
        let SledStore {
            db,
            flusher,
            flusher_thread,
            ..
        } = self;
        drop(db);
        drop(flusher);
        if let Ok(m) = Arc::try_unwrap(flusher_thread)
            && let Some(t) = m.into_inner()
        {
            let _ = t.join();
        }
    }

    /// Removes expired keys; returns how many. Reads the expiry index up to
    /// now only: the work is what expired, not the size of the database.
    pub fn sweep_expired(&self) -> usize {
        let now = now_ms();
        let mut removed = 0;
        let due = self.expiry.range(..=now.to_be_bytes().to_vec());
        for (x, _) in due.flatten() {
            let key = &x[8..];
            if let Ok(Some(v)) = self.db.get(key)
                && expiry_key(key, &v).as_deref() == Some(&x[..])
                && decode(&v, now).is_none()
            {
                // Only remove the exact expired value, never a fresh write.
                if let Ok(Ok(())) = self
                    .db
                    .compare_and_swap(key, Some(&v), None as Option<&[u8]>)
                {
                    self.wrote([key]);
                    removed += 1;
                }
            }
            // Due: its value is gone, rewritten (with an entry of its own) or removed now.
            let _ = self.expiry.remove(&x);
        }
        removed
    }

    /// Notes an expiring raw record in the expiry index, before it is
    /// written: a crash between the two leaves an entry the sweep drops,
    /// never an expiring value the sweep cannot find.
    fn index_expiry(&self, key: &[u8], raw: &[u8]) -> StoreResult<()> {
        if let Some(x) = expiry_key(key, raw) {
            self.expiry.insert(x, &[]).map_err(unavailable)?;
        }
        Ok(())
    }

    /// Replaces the value under `key` with `new` only if it holds
    /// `expected`, keeping its time to live (the record MAC's migration,
    /// `Store::adopt_record_macs`). Returns whether it did.
    pub async fn replace_keeping_ttl(
        &self,
        key: &[u8],
        expected: &[u8],
        new: &[u8],
    ) -> StoreResult<bool> {
        loop {
            let Some(raw) = self.db.get(key).map_err(unavailable)? else {
                return Ok(false);
            };
            if decode(&raw, now_ms()) != Some(expected) {
                return Ok(false);
            }
            // The header (plain, or expiring with its deadline) stays: so
            // does the expiry index's entry, keyed by that deadline.
            let mut new_raw = raw[..raw.len() - expected.len()].to_vec();
            new_raw.extend_from_slice(new);
            match self
                .db
                .compare_and_swap(key, Some(&raw), Some(new_raw))
                .map_err(unavailable)?
            {
                Ok(()) => {
                    self.wrote([key]);
                    self.durable().await?;
                    return Ok(true);
                }
                Err(_) => continue,
            }
        }
    }

    /// The record sled holds under `key`, its time-to-live header included.
    #[cfg(test)]
    pub(crate) fn raw_record(&self, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        Ok(self.db.get(key).map_err(unavailable)?.map(|r| r.to_vec()))
    }

    /// Counts every flush from now on in `counter` (the node's
    /// `meshgate_store_flushes_total`); the first counter given stays.
    pub fn count_flushes(&self, counter: prometheus::IntCounter) {
        let _ = self.flushes.set(counter);
    }

    /// A counter of the writes to keys under `prefix` (the same counter for
    /// the same prefix), bumped once a write is applied (readable), before it
    /// is acknowledged. Every write to the database goes through this store
    /// and sled lets one process at a time open it, so a reader that kept a
    /// value read under the prefix knows it is still the stored one while
    /// the counter has not moved since it loaded it before the read: one
    /// atomic load instead of a store read (a kept function resolution, see
    /// `Invoker::cached`).
    pub fn write_counter(&self, prefix: &[u8]) -> Arc<AtomicU64> {
        let mut counters = self.counters.write();
        if let Some((_, c)) = counters.iter().find(|(p, _)| p == prefix) {
            return c.clone();
        }
        let c = Arc::new(AtomicU64::new(0));
        counters.push((prefix.to_vec(), c.clone()));
        c
    }

    /// Counts a write applied to `keys` in the counters of their prefixes.
    fn wrote<'k>(&self, keys: impl IntoIterator<Item = &'k [u8]> + Clone) {
        for (prefix, c) in self.counters.read().iter() {
            if keys.clone().into_iter().any(|k| k.starts_with(prefix)) {
                c.fetch_add(1, Ordering::Release);
            }
        }
    }

    /// Applies `ops` in one atomic sled batch without waiting for the disk:
    /// the first half of the durable `apply_batch`, which then waits for it.
    /// (Records, which need neither, go one by one: `apply_each_buffered`.)
    fn apply_batch_buffered(&self, ops: Vec<BatchOp>) -> StoreResult<()> {
        let mut batch = sled::Batch::default();
        let mut keys = Vec::with_capacity(ops.len());
        // Blob files are written before the batch (a record written with it
        // may name them) and deleted after it.
        let mut blob_deletes = Vec::new();
        for op in ops {
            match op {
                BatchOp::Put(k, v) if BlobFiles::name(&k).is_some() => {
                    let name = BlobFiles::name(&k).unwrap_or_default();
                    self.blobs.put(name, &v).map_err(blob_io)?;
                }
                BatchOp::Delete(k) if BlobFiles::name(&k).is_some() => {
                    // A blob an older version kept in the tree goes too.
                    batch.remove(&k[..]);
                    blob_deletes.push(k.clone());
                    keys.push(k);
                }
                BatchOp::Put(k, v) => {
                    batch.insert(&k[..], encode(&v, None));
                    keys.push(k);
                }
                BatchOp::Delete(k) => {
                    batch.remove(&k[..]);
                    keys.push(k);
                }
            }
        }
        self.db.apply_batch(batch).map_err(unavailable)?;
        for k in &blob_deletes {
            let name = BlobFiles::name(k).unwrap_or_default();
            self.blobs.delete(name).map_err(blob_io)?;
        }
        self.wrote(keys.iter().map(Vec::as_slice));
        Ok(())
    }

    /// Applies `ops` one by one, without waiting for the disk and not as one
    /// atomic batch (see `Store::apply_buffered`): a sled batch seals the
    /// log buffer and hands its write to sled's I/O threads, all seven of
    /// which wake for it; single writes join the buffer and go out with
    /// sled's own flush.
    pub(crate) fn apply_each_buffered(&self, ops: Vec<BatchOp>) -> StoreResult<()> {
        let mut keys = Vec::with_capacity(ops.len());
        for op in ops {
            match op {
                BatchOp::Put(k, v) => {
                    self.db
                        .insert(&k[..], encode(&v, None))
                        .map_err(unavailable)?;
                    keys.push(k);
                }
                BatchOp::Delete(k) => {
                    self.db.remove(&k[..]).map_err(unavailable)?;
                    keys.push(k);
                }
            }
        }
        self.wrote(keys.iter().map(Vec::as_slice));
        Ok(())
    }

    /// Reads `keys`, hands their values to `decide` and applies what it
    /// returns, as one sled transaction: serializable against every other
    /// `transact` (sled runs `decide` again on a conflict). Durable when it
    /// resolves. `Err` from `decide` writes nothing.
    pub async fn transact<T, E, F>(&self, keys: &[Vec<u8>], decide: F) -> StoreResult<Result<T, E>>
    where
        F: Fn(&[Option<Vec<u8>>]) -> Result<(Vec<BatchOp>, T), E>,
    {
        use sled::transaction::{ConflictableTransactionError, TransactionError};
        // Blob files change after the tree's transaction, under the blob
        // lock held from before it: the next guarded change sees both.
        let r = {
            let _guard = self.blobs.lock.lock();
            let r = self.db.transaction(|tx| {
                let now = now_ms();
                let mut values = Vec::with_capacity(keys.len());
                for k in keys {
                    let raw = tx.get(k)?;
                    values.push(raw.and_then(|r| decode(&r, now).map(<[u8]>::to_vec)));
                }
                let (ops, out) = decide(&values).map_err(ConflictableTransactionError::Abort)?;
                let mut keys_written = Vec::with_capacity(ops.len());
                let mut blob_ops = Vec::new();
                for op in ops {
                    match op {
                        BatchOp::Put(k, v) if BlobFiles::name(&k).is_some() => {
                            blob_ops.push(BatchOp::Put(k, v));
                        }
                        BatchOp::Delete(k) if BlobFiles::name(&k).is_some() => {
                            tx.remove(&k[..])?;
                            blob_ops.push(BatchOp::Delete(k.clone()));
                            keys_written.push(k);
                        }
                        BatchOp::Put(k, v) => {
                            tx.insert(&k[..], encode(&v, None))?;
                            keys_written.push(k);
                        }
                        BatchOp::Delete(k) => {
                            tx.remove(&k[..])?;
                            keys_written.push(k);
                        }
                    }
                }
                Ok((out, keys_written, blob_ops))
            });
            if let Ok((_, _, blob_ops)) = &r {
                for op in blob_ops {
                    match op {
                        BatchOp::Put(k, v) => self
                            .blobs
                            .put(BlobFiles::name(k).unwrap_or_default(), v)
                            .map_err(blob_io)?,
                        BatchOp::Delete(k) => {
                            self.blobs
                                .delete(BlobFiles::name(k).unwrap_or_default())
                                .map_err(blob_io)?;
                        }
                    }
                }
            }
            r
        };
        match r {
            Ok((out, keys_written, _)) => {
                self.wrote(keys_written.iter().map(Vec::as_slice));
                self.durable().await?;
                Ok(Ok(out))
            }
            Err(TransactionError::Abort(e)) => Ok(Err(e)),
            Err(TransactionError::Storage(e)) => Err(unavailable(e)),
        }
    }

    /// The live keys under `prefix` (at most `limit`), in order, without
    /// copying their values out (a listing must not cost what the values
    /// weigh).
    pub fn scan_keys(&self, prefix: &[u8], limit: usize) -> StoreResult<Vec<Vec<u8>>> {
        self.scan_keys_from(prefix, prefix, limit)
    }

    /// [`SledStore::scan_keys`] from `start` on (a key at or past `prefix`):
    /// the live keys under `prefix` not below `start`, the ones before it
    /// not even visited.
    pub fn scan_keys_from(
        &self,
        prefix: &[u8],
        start: &[u8],
        limit: usize,
    ) -> StoreResult<Vec<Vec<u8>>> {
        if BlobFiles::covers(prefix) {
            let mut keys = self.blobs.keys(prefix).map_err(blob_io)?;
            for r in self.live(prefix, now_ms()) {
                keys.push(r?.0.to_vec());
            }
            keys.retain(|k| k.as_slice() >= start);
            keys.sort();
            keys.dedup();
            keys.truncate(limit);
            return Ok(keys);
        }
        self.live_from(prefix, start, now_ms())
            .take(limit)
            .map(|r| r.map(|(k, _)| k.to_vec()))
            .collect()
    }

    /// The rows under `prefix` whose TTL has not passed at `now`, in key
    /// order, as sled holds them (raw values: [`decode`] at `now` opens them).
    fn live(
        &self,
        prefix: &[u8],
        now: u64,
    ) -> impl Iterator<Item = StoreResult<(sled::IVec, sled::IVec)>> + use<> {
        self.live_from(prefix, prefix, now)
    }

    /// [`SledStore::live`] from `start` on (a key at or past `prefix`): a
    /// range read that begins at `start`, so a page of a listing does not
    /// walk the keys before it.
    fn live_from(
        &self,
        prefix: &[u8],
        start: &[u8],
        now: u64,
    ) -> impl Iterator<Item = StoreResult<(sled::IVec, sled::IVec)>> + use<> {
        let prefix = prefix.to_vec();
        self.db
            .range(start.max(prefix.as_slice()).to_vec()..)
            .take_while(move |item| item.as_ref().map_or(true, |(k, _)| k.starts_with(&prefix)))
            .map(|item| item.map_err(unavailable))
            .filter(move |item| {
                item.as_ref()
                    .map_or(true, |(_, v)| decode(v, now).is_some())
            })
    }

    /// Waits until every write made so far is on disk.
    async fn durable(&self) -> StoreResult<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.flusher
            .send(tx)
            .map_err(|_| StoreError::Unavailable("the store flusher stopped".into()))?;
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(StoreError::Unavailable(e)),
            Err(_) => Err(StoreError::Unavailable("the store flusher stopped".into())),
        }
    }
}

impl SledStore {
    /// The live rows under `prefix` not below `start` (a key at or past
    /// `prefix`), in key order, at most `limit`: a page of a listing
    /// resumes here without reading the keys before it.
    pub async fn scan_from(
        &self,
        prefix: &[u8],
        start: &[u8],
        limit: usize,
    ) -> StoreResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let now = now_ms();
        if BlobFiles::covers(prefix) {
            let mut rows = Vec::new();
            for k in self.scan_keys_from(prefix, start, limit)? {
                if let Some(v) = self.get(&k).await? {
                    rows.push((k, v));
                }
            }
            return Ok(rows);
        }
        self.live_from(prefix, start, now)
            .take(limit)
            .map(|r| {
                r.map(|(k, v)| {
                    let v = decode(&v, now).unwrap_or_default().to_vec();
                    (k.to_vec(), v)
                })
            })
            .collect()
    }
}

impl OrderedKv for SledStore {
    async fn get(&self, key: &[u8]) -> StoreResult<Option<Vec<u8>>> {
        if let Some(name) = BlobFiles::name(key)
            && let Some(bytes) = self.blobs.get(name).map_err(blob_io)?
        {
            return Ok(Some(bytes));
        }
        let raw = self.db.get(key).map_err(unavailable)?;
        Ok(raw.and_then(|r| decode(&r, now_ms()).map(<[u8]>::to_vec)))
    }

    async fn put(&self, key: &[u8], value: &[u8]) -> StoreResult<()> {
        if let Some(name) = BlobFiles::name(key) {
            return self.blobs.put(name, value).map_err(blob_io);
        }
        self.db
            .insert(key, encode(value, None))
            .map_err(unavailable)?;
        self.wrote([key]);
        self.durable().await
    }

    async fn put_ttl(&self, key: &[u8], value: &[u8], ttl: Duration) -> StoreResult<()> {
        let raw = encode(value, Some(ttl));
        self.index_expiry(key, &raw)?;
        self.db.insert(key, raw).map_err(unavailable)?;
        self.wrote([key]);
        self.durable().await
    }

    async fn delete(&self, key: &[u8]) -> StoreResult<bool> {
        let file = match BlobFiles::name(key) {
            Some(name) => self.blobs.delete(name).map_err(blob_io)?,
            None => false,
        };
        let old = self.db.remove(key).map_err(unavailable)?;
        self.wrote([key]);
        self.durable().await?;
        Ok(file || old.is_some_and(|r| decode(&r, now_ms()).is_some()))
    }

    async fn scan_prefix(
        &self,
        prefix: &[u8],
        limit: usize,
    ) -> StoreResult<Vec<(Vec<u8>, Vec<u8>)>> {
        self.scan_from(prefix, prefix, limit).await
    }

    async fn compare_and_swap(
        &self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
        ttl: Option<Duration>,
    ) -> StoreResult<bool> {
        loop {
            let raw = self.db.get(key).map_err(unavailable)?;
            let current = raw.as_deref().and_then(|r| decode(r, now_ms()));
            if current != expected {
                return Ok(false);
            }
            let new_raw = new.map(|v| encode(v, ttl));
            if let Some(r) = &new_raw {
                self.index_expiry(key, r)?;
            }
            match self
                .db
                .compare_and_swap(key, raw.as_deref(), new_raw)
                .map_err(unavailable)?
            {
                Ok(()) => {
                    self.wrote([key]);
                    self.durable().await?;
                    return Ok(true);
                }
                // Someone changed the raw record between our read and swap: look again.
                Err(_) => continue,
            }
        }
    }

    async fn apply_batch(&self, ops: Vec<BatchOp>) -> StoreResult<()> {
        self.apply_batch_buffered(ops)?;
        self.durable().await
    }

    async fn flush(&self) -> StoreResult<()> {
        self.durable().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn store() -> (tempfile::TempDir, SledStore) {
        let dir = tempfile::tempdir().unwrap();
        let s = SledStore::open(dir.path()).unwrap();
        (dir, s)
    }

    /// Buffered writes, as one batch or one by one, are read back at once
    /// (puts and deletes), and once the store is flushed (as the node's drain
    /// does) they are there after the store is opened again.
    #[tokio::test]
    async fn a_buffered_batch_is_read_at_once_and_kept_after_a_flush() {
        let (dir, s) = store();
        s.put(b"old", b"1").await.unwrap();
        s.apply_batch_buffered(vec![
            BatchOp::Put(b"log/a".to_vec(), b"x".to_vec()),
            BatchOp::Put(b"log/b".to_vec(), b"y".to_vec()),
            BatchOp::Delete(b"old".to_vec()),
        ])
        .unwrap();
        assert_eq!(s.get(b"log/a").await.unwrap(), Some(b"x".to_vec()));
        assert_eq!(s.get(b"old").await.unwrap(), None);
        assert_eq!(s.scan_prefix(b"log/", 10).await.unwrap().len(), 2);
        s.apply_each_buffered(vec![
            BatchOp::Put(b"log/c".to_vec(), b"z".to_vec()),
            BatchOp::Delete(b"log/a".to_vec()),
        ])
        .unwrap();
        assert_eq!(s.get(b"log/c").await.unwrap(), Some(b"z".to_vec()));
        assert_eq!(s.get(b"log/a").await.unwrap(), None);
        s.flush().await.unwrap();
        drop(s);
        // The flusher thread lets go of the database when it sees the store gone.
        let end = std::time::Instant::now() + Duration::from_secs(10);
        let again = loop {
            match SledStore::open(dir.path()) {
                Ok(s) => break s,
                Err(_) if std::time::Instant::now() < end => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("reopen: {e}"),
            }
        };
        assert_eq!(again.get(b"log/b").await.unwrap(), Some(b"y".to_vec()));
        assert_eq!(again.get(b"old").await.unwrap(), None);
        assert_eq!(again.get(b"log/c").await.unwrap(), Some(b"z".to_vec()));
        assert_eq!(again.get(b"log/a").await.unwrap(), None);
    }

    /// A write counter moves once per applied write under its prefix (put,
    /// put with a time to live, delete, a won compare-and-swap, a batch,
    /// buffered or not) and never for another prefix or a lost swap; the
    /// same prefix gets the same counter.
    #[tokio::test]
    async fn a_write_counter_counts_the_writes_under_its_prefix() {
        let (_dir, s) = store();
        let c = s.write_counter(b"fn/");
        assert!(Arc::ptr_eq(&c, &s.write_counter(b"fn/")));
        let n = || c.load(Ordering::Acquire);
        s.put(b"fnver/a", b"x").await.unwrap();
        s.put(b"kv/fn/a", b"x").await.unwrap();
        assert_eq!(n(), 0, "other prefixes");
        s.put(b"fn/a", b"1").await.unwrap();
        s.put_ttl(b"fn/b", b"1", Duration::from_secs(60))
            .await
            .unwrap();
        assert!(s.delete(b"fn/b").await.unwrap());
        assert_eq!(n(), 3);
        assert!(
            !s.compare_and_swap(b"fn/a", Some(b"0"), Some(b"2"), None)
                .await
                .unwrap()
        );
        assert_eq!(n(), 3, "a lost swap writes nothing");
        assert!(
            s.compare_and_swap(b"fn/a", Some(b"1"), Some(b"2"), None)
                .await
                .unwrap()
        );
        s.apply_batch(vec![
            BatchOp::Put(b"kv/x".to_vec(), b"1".to_vec()),
            BatchOp::Delete(b"fn/a".to_vec()),
        ])
        .await
        .unwrap();
        s.apply_batch_buffered(vec![BatchOp::Put(b"fn/c".to_vec(), b"1".to_vec())])
            .unwrap();
        s.apply_batch_buffered(vec![BatchOp::Put(b"log/c".to_vec(), b"1".to_vec())])
            .unwrap();
        assert_eq!(n(), 6);
        s.apply_each_buffered(vec![
            BatchOp::Put(b"fn/d".to_vec(), b"1".to_vec()),
            BatchOp::Put(b"log/d".to_vec(), b"1".to_vec()),
        ])
        .unwrap();
        assert_eq!(n(), 7, "one-by-one writes are counted too");
    }

    /// Of many concurrent writers doing CAS from the same expected value, exactly one wins.
    /// Guarded changes that each write a key and count it on a shared
    /// counter, many at once: the counter ends exact, and a refused
    /// decision writes nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn transact_keeps_a_counter_exact_under_concurrent_writers() {
        let (_e, s) = store();
        let mut tasks = Vec::new();
        for t in 0..8u32 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..25u64 {
                    let key = format!("item/{t}/{i}").into_bytes();
                    let keys = [key.clone(), b"count".to_vec()];
                    let r = s
                        .transact(&keys, |vals: &[Option<Vec<u8>>]| {
                            let n: u64 = vals[1]
                                .as_deref()
                                .map_or(0, |v| String::from_utf8_lossy(v).parse().unwrap());
                            Ok::<_, ()>((
                                vec![
                                    BatchOp::Put(key.clone(), b"x".to_vec()),
                                    BatchOp::Put(
                                        b"count".to_vec(),
                                        (n + 1).to_string().into_bytes(),
                                    ),
                                ],
                                n + 1,
                            ))
                        })
                        .await
                        .unwrap();
                    assert!(r.is_ok());
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let count = s.get(b"count").await.unwrap().unwrap();
        assert_eq!(String::from_utf8(count).unwrap(), (8 * 25).to_string());
        assert_eq!(
            s.scan_prefix(b"item/", usize::MAX).await.unwrap().len(),
            8 * 25 as usize
        );
        let keys = [b"item/refused".to_vec(), b"count".to_vec()];
        let r = s
            .transact(&keys, |_: &[Option<Vec<u8>>]| {
                Err::<(Vec<BatchOp>, ()), _>("no")
            })
            .await
            .unwrap();
        assert_eq!(r, Err("no"));
        assert!(s.get(b"item/refused").await.unwrap().is_none());
        assert_eq!(
            String::from_utf8(s.get(b"count").await.unwrap().unwrap()).unwrap(),
            (8 * 25).to_string()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn cas_exactly_one_winner() {
        let (_d, s) = store();
        s.put(b"slot", b"free").await.unwrap();
        let s = Arc::new(s);
        let mut tasks = Vec::new();
        for i in 0..32u32 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                s.compare_and_swap(
                    b"slot",
                    Some(b"free"),
                    Some(format!("w{i}").as_bytes()),
                    None,
                )
                .await
                .unwrap()
            }));
        }
        let mut wins = 0;
        for t in tasks {
            wins += t.await.unwrap() as usize;
        }
        assert_eq!(wins, 1);
        assert!(s.get(b"slot").await.unwrap().unwrap().starts_with(b"w"));
    }

    /// CAS on an absent key succeeds once; CAS with the wrong expected value fails.
    #[tokio::test]
    async fn cas_absent_and_mismatch() {
        let (_d, s) = store();
        assert!(
            s.compare_and_swap(b"k", None, Some(b"1"), None)
                .await
                .unwrap()
        );
        assert!(
            !s.compare_and_swap(b"k", None, Some(b"2"), None)
                .await
                .unwrap()
        );
        assert!(
            !s.compare_and_swap(b"k", Some(b"9"), Some(b"2"), None)
                .await
                .unwrap()
        );
        assert!(
            s.compare_and_swap(b"k", Some(b"1"), None, None)
                .await
                .unwrap()
        );
        assert_eq!(s.get(b"k").await.unwrap(), None);
    }

    /// A value put with a TTL is readable before it expires and gone after; the sweep removes it.
    /// The sweep goes by the expiry index: it removes what expired, leaves a
    /// key rewritten without a TTL or with a later deadline, and empties the
    /// index of what was due (so its next run reads nothing).
    #[tokio::test]
    async fn sweep_reads_the_expiry_index() {
        let (_d, s) = store();
        let short = Duration::from_millis(30);
        s.put_ttl(b"gone", b"v", short).await.unwrap();
        s.put_ttl(b"made-plain", b"v", short).await.unwrap();
        s.put(b"made-plain", b"kept").await.unwrap();
        s.put_ttl(b"extended", b"v", short).await.unwrap();
        s.put_ttl(b"extended", b"v2", Duration::from_secs(3600))
            .await
            .unwrap();
        assert!(
            s.compare_and_swap(b"cas", None, Some(b"v"), Some(short))
                .await
                .unwrap()
        );
        for i in 0..100u32 {
            s.put(format!("plain/{i}").as_bytes(), b"v").await.unwrap();
        }
        // Four due entries (one per expiring write but the long one), the
        // long one, the marker.
        assert_eq!(s.expiry.len(), 6);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(s.sweep_expired(), 2, "gone and cas");
        assert_eq!(s.db.get(b"gone").unwrap(), None);
        assert_eq!(s.db.get(b"cas").unwrap(), None);
        assert_eq!(
            s.get(b"made-plain").await.unwrap().as_deref(),
            Some(&b"kept"[..])
        );
        assert_eq!(
            s.get(b"extended").await.unwrap().as_deref(),
            Some(&b"v2"[..])
        );
        // Left in the index: the long deadline and the marker.
        assert_eq!(s.expiry.len(), 2);
        assert_eq!(s.sweep_expired(), 0);
    }

    /// A database from before the index: its expiring values are indexed
    /// once at open, so the sweep still finds them.
    #[tokio::test]
    async fn an_older_database_is_indexed_at_open() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = SledStore::open(dir.path()).unwrap();
            s.put_ttl(b"old", b"v", Duration::from_millis(20))
                .await
                .unwrap();
            // As a database written before the index was.
            s.expiry.clear().unwrap();
            s.db.flush().unwrap();
            s.close();
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
        let s = SledStore::open(dir.path()).unwrap();
        assert!(s.expiry.contains_key(EXPIRY_INDEXED).unwrap());
        assert_eq!(s.sweep_expired(), 1);
        assert_eq!(s.db.get(b"old").unwrap(), None);
    }

    #[tokio::test]
    async fn ttl_expiry() {
        let (_d, s) = store();
        s.put_ttl(b"t", b"v", Duration::from_millis(150))
            .await
            .unwrap();
        s.put(b"keep", b"v").await.unwrap();
        assert_eq!(s.get(b"t").await.unwrap().as_deref(), Some(&b"v"[..]));
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(s.get(b"t").await.unwrap(), None);
        assert!(s.scan_prefix(b"t", 10).await.unwrap().is_empty());
        assert_eq!(s.sweep_expired(), 1);
        assert_eq!(s.get(b"keep").await.unwrap().as_deref(), Some(&b"v"[..]));
        // An expired key counts as absent for CAS.
        s.put_ttl(b"lease", b"a", Duration::from_millis(1))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            s.compare_and_swap(b"lease", None, Some(b"b"), None)
                .await
                .unwrap()
        );
    }

    /// A keys-only scan lists what a full scan lists (live keys under the
    /// prefix, in byte order, up to the limit), expired keys left out.
    #[tokio::test]
    async fn a_keys_scan_lists_the_live_keys_a_full_scan_does() {
        let (_d, s) = store();
        for k in [&b"p/b"[..], b"p/a", b"p/c", b"q/a"] {
            s.put(k, &[7u8; 4096]).await.unwrap();
        }
        s.put_ttl(b"p/gone", b"v", Duration::from_millis(1))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let full: Vec<Vec<u8>> = s
            .scan_prefix(b"p/", 10)
            .await
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        let keys = s.scan_keys(b"p/", 10).unwrap();
        assert_eq!(keys, full);
        assert_eq!(keys, [b"p/a".to_vec(), b"p/b".to_vec(), b"p/c".to_vec()]);
        assert_eq!(s.scan_keys(b"p/", 2).unwrap(), keys[..2]);
    }

    /// Prefix scans return keys in byte order and stop at the prefix's end and the limit.
    #[tokio::test]
    async fn prefix_scan_order() {
        let (_d, s) = store();
        for k in ["a/3", "a/1", "b/1", "a/2", "a/10", "a"] {
            s.put(k.as_bytes(), b"x").await.unwrap();
        }
        let keys: Vec<String> = s
            .scan_prefix(b"a/", 100)
            .await
            .unwrap()
            .into_iter()
            .map(|(k, _)| String::from_utf8(k).unwrap())
            .collect();
        assert_eq!(keys, ["a/1", "a/10", "a/2", "a/3"]);
        assert_eq!(s.scan_prefix(b"a/", 2).await.unwrap().len(), 2);
    }

    /// A batch applies all its writes together.
    #[tokio::test]
    async fn batch_is_applied_whole() {
        let (_d, s) = store();
        s.put(b"old", b"1").await.unwrap();
        s.apply_batch(vec![
            BatchOp::Put(b"new".to_vec(), b"2".to_vec()),
            BatchOp::Delete(b"old".to_vec()),
        ])
        .await
        .unwrap();
        assert_eq!(s.get(b"old").await.unwrap(), None);
        assert_eq!(s.get(b"new").await.unwrap().as_deref(), Some(&b"2"[..]));
    }

    /// Many concurrent durable writers all complete (group commit), none stalls.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_durable_writes_complete() {
        let (_d, s) = store();
        let s = Arc::new(s);
        let mut tasks = Vec::new();
        for i in 0..64u32 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                s.put(format!("k{i}").as_bytes(), b"v").await
            }));
        }
        // A hang detector, not a speed assertion.
        let all = tokio::time::timeout(
            Duration::from_secs(60),
            futures_util::future::join_all(tasks),
        )
        .await;
        let results = all.expect("durable writes stalled");
        assert!(results.into_iter().all(|r| r.unwrap().is_ok()));
        assert_eq!(s.scan_prefix(b"k", 100).await.unwrap().len(), 64);
    }

    /// A second open of the same folder is refused with a clear error.
    #[test]
    fn second_open_is_locked() {
        let (d, _s) = store();
        match SledStore::open(d.path()) {
            Err(StoreError::Locked(_)) => {}
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("second open succeeded"),
        }
    }
}
