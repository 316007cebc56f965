//! The node's functions service: the engine, the module cache, the
//! invocation-record writer, and one invoker per namespace.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake};
use std::time::Duration;

use parking_lot::Mutex;
use prometheus::IntCounter;
use tokio::sync::mpsc;

use crate::functions::model::{InvocationRecord, log_key_under};
use crate::functions::{FnError, FnResult, SecretBox};
use crate::metrics::Metrics;
use crate::storage::{BatchOp, Store, StoreError, StoreResult};
use crate::wasm::{CompiledModule, WasmEngine};

/// Invocation records waiting for the writer; past this they are dropped (and counted).
pub const RECORD_QUEUE: usize = 1024;
/// Records the writer takes from the queue for one store batch at most.
pub(crate) const RECORD_BATCH: usize = 512;
/// Store entries written per batch at most (etcd takes 128 operations per
/// transaction by default).
pub(crate) const RECORD_ENTRIES_PER_BATCH: usize = 64;
/// Bytes of entries written per batch at most, past one entry (etcd refuses
/// a request above 1.5 MiB by default).
pub(crate) const RECORD_BATCH_BYTES: usize = 1 << 20;
/// One stored log entry holds a function's records of one batch up to about
/// this many bytes of JSON (etcd's request limit is 1.5 MiB).
pub(crate) const RECORD_ENTRY_BYTES: usize = 256 << 10;
/// How often the pool gauges and cache counters are refreshed.
const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// Records `GET /v1/functions/{name}/logs` returns at most.
pub const MAX_LOGS: usize = 100;

/// An invocation record on its way to the writer.
pub(crate) struct QueuedRecord {
    /// `log/<ns>/<name>/`: records of one function are stored together.
    pub(crate) prefix: Vec<u8>,
    /// The record, turned into JSON and given its key by the writer, and
    /// only if it is written: of a busy function's batch only the newest
    /// [`MAX_LOGS`] are ([`keep_newest`]), so the request thread
    /// does not serialize the ones left out.
    pub(crate) record: InvocationRecord,
    /// Its namespace's writer progress, counted on once it is written.
    pub(crate) progress: Arc<RecordProgress>,
}

/// The records of one stored log entry, oldest first: a JSON array of
/// records (what the writer stores: one entry per function per batch) or
/// one record (entries written before records were grouped). An entry that
/// does not decode yields nothing.
pub(crate) fn decode_log_entry(v: &[u8]) -> Vec<InvocationRecord> {
    if v.first() == Some(&b'[') {
        serde_json::from_slice(v).unwrap_or_default()
    } else {
        serde_json::from_slice(v)
            .map(|r| vec![r])
            .unwrap_or_default()
    }
}

/// How many records an entry holds, as [`decode_log_entry`] would return,
/// without building them (the writer's trim counts, it does not read).
pub(crate) fn count_log_entry(v: &[u8]) -> usize {
    use serde::de::IgnoredAny;
    /// An array's elements, each only checked to be a record's shape.
    #[derive(serde::Deserialize)]
    struct Shape {
        #[allow(dead_code)] // only its presence is checked
        request_id: IgnoredAny,
    }
    if v.first() == Some(&b'[') {
        serde_json::from_slice::<Vec<Shape>>(v).map_or(0, |r| r.len())
    } else {
        usize::from(serde_json::from_slice::<Shape>(v).is_ok())
    }
}

/// Unix milliseconds now.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// Polls a future to completion on the current (non-runtime) thread, parking
/// between polls. Only for sled, which does its work synchronously and needs
/// no runtime (see [`FunctionsService::store_wait`]).
pub(crate) fn poll_here<F: Future>(f: F) -> F::Output {
    struct ThreadWaker(std::thread::Thread);
    impl Wake for ThreadWaker {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Arc::new(ThreadWaker(std::thread::current())).into();
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        match f.as_mut().poll(&mut cx) {
            Poll::Ready(v) => return v,
            Poll::Pending => std::thread::park(),
        }
    }
}

pub(crate) struct ServiceInner {
    /// The node's WASM engine: compiles modules and runs guests on its worker pool.
    pub(crate) engine: WasmEngine,
    /// The node's store: function records, versions, blobs, secrets and logs.
    pub(crate) store: Store,
    /// Node metrics: invocation counts and errors, pool gauges, dropped records.
    pub(crate) metrics: Metrics,
    /// Queue of invocation records to the writer task; bounded
    /// (`RECORD_QUEUE`), a full queue drops the record and counts it.
    pub(crate) records: mpsc::Sender<QueuedRecord>,
    /// The runtime the store was opened on (the node's), where the
    /// synchronous paths run their store operations (`store_wait`).
    pub(crate) store_runtime: tokio::runtime::Handle,
    /// Seals and opens secrets in the store, each bound to its key.
    pub(crate) secrets: SecretBox,
    /// `meshgate_wasm_cache_hits_total`, caught up to the engine's count by `sample`.
    pub(crate) cache_hits: IntCounter,
    /// `meshgate_wasm_cache_misses_total`, caught up to the engine's count by `sample`.
    pub(crate) cache_misses: IntCounter,
    /// Each namespace's record progress, while an invoker or a queued record
    /// holds it: an invoker recreated for the namespace (its supervisor
    /// restarted) takes over the records its predecessor queued.
    pub(crate) progress: Mutex<HashMap<String, std::sync::Weak<RecordProgress>>>,
}

/// The node's functions service: the engine, the record queue, the secret key.
#[derive(Clone)]
pub struct FunctionsService(pub(crate) Arc<ServiceInner>);

impl FunctionsService {
    /// Starts the record writer and the sampler. Must run inside the node's
    /// runtime, the one the store was opened on.
    pub fn start(engine: WasmEngine, store: Store, metrics: Metrics, server_secret: &[u8]) -> Self {
        let (tx, rx) = mpsc::channel(RECORD_QUEUE);
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid metric");
            // A second service on the same registry (tests) keeps the first's counter.
            let _ = metrics.registry.register(Box::new(c.clone()));
            c
        };
        let cache_hits = counter(
            "meshgate_wasm_cache_hits_total",
            "Modules loaded from the compiled-artifact cache",
        );
        let cache_misses = counter(
            "meshgate_wasm_cache_misses_total",
            "Modules compiled because the artifact cache did not have them",
        );
        let svc = FunctionsService(Arc::new(ServiceInner {
            engine,
            store: store.clone(),
            metrics,
            records: tx,
            store_runtime: tokio::runtime::Handle::current(),
            secrets: SecretBox::new(server_secret),
            cache_hits,
            cache_misses,
            progress: Default::default(),
        }));
        actix_web::rt::spawn(write_records(store, rx));
        let sampler = svc.clone();
        actix_web::rt::spawn(async move {
            let mut tick = tokio::time::interval(SAMPLE_INTERVAL);
            loop {
                tick.tick().await;
                sampler.sample();
            }
        });
        svc
    }

    /// The node's engine.
    pub fn engine(&self) -> &WasmEngine {
        &self.0.engine
    }

    /// Validates and compiles a module of namespace `ns` off the event
    /// loop, through the engine's compile gate
    /// ([`WasmEngine::compile_bounded`]): answers `CompileTimeout` at the
    /// compile deadline even while the compile still runs on its blocking
    /// thread (it keeps its slot until it ends; its result is dropped).
    pub async fn compile(&self, ns: &str, wasm: Vec<u8>) -> FnResult<Arc<CompiledModule>> {
        let svc = self.clone();
        let ns = ns.to_string();
        let timeout = self.0.engine.compile_timeout();
        let task = tokio::task::spawn_blocking(move || svc.0.engine.compile_bounded(&ns, &wasm));
        let module = match tokio::time::timeout(timeout, task).await {
            Ok(joined) => {
                joined.map_err(|e| FnError::Internal(format!("compile task failed: {e}")))??
            }
            Err(_) => {
                return Err(crate::wasm::WasmError::CompileTimeout(format!(
                    "the compile took longer than {} ms",
                    timeout.as_millis()
                ))
                .into());
            }
        };
        self.sample();
        Ok(module)
    }

    /// Refreshes the pool gauges and the cache counters.
    pub fn sample(&self) {
        let s = self.0.engine.stats();
        let m = &self.0.metrics;
        m.wasm_pool_workers.set(s.workers as i64);
        m.wasm_pool_busy.set(s.busy as i64);
        m.wasm_pool_queued.set(s.queued as i64);
        if let Some(warm) = self.0.engine.warm_instance_slots() {
            m.wasm_instance_slots_warm.set(warm.into());
        }
        let hits = self.0.engine.cache_hits();
        let misses = self.0.engine.cache_misses();
        self.0
            .cache_hits
            .inc_by(hits.saturating_sub(self.0.cache_hits.get()));
        self.0
            .cache_misses
            .inc_by(misses.saturating_sub(self.0.cache_misses.get()));
    }

    /// The writer's progress on `ns`'s records: the one a previous invoker of
    /// the namespace still has records queued under (so `logs` on the new
    /// invoker waits for them too), else a new one.
    pub(crate) fn record_progress(&self, ns: &str) -> Arc<RecordProgress> {
        let mut all = self.0.progress.lock();
        all.retain(|_, p| p.strong_count() > 0);
        if let Some(p) = all.get(ns).and_then(std::sync::Weak::upgrade) {
            return p;
        }
        let p = Arc::new(RecordProgress::default());
        all.insert(ns.to_string(), Arc::downgrade(&p));
        p
    }

    /// Runs a store operation from a thread that is no runtime's and may block:
    /// a WASM worker (the guest's host calls) or a blocking task (`resolve_sync`).
    /// sled works synchronously, so its future is polled right here. etcd's
    /// client needs a runtime (its request deadlines are tokio timers) and its
    /// connection lives on the runtime that opened it, so the operation is
    /// spawned onto that runtime and this thread waits for the answer. Never
    /// call it on a runtime thread: it blocks.
    pub(crate) fn store_wait<T, F>(&self, op: impl FnOnce(Store) -> F) -> StoreResult<T>
    where
        F: Future<Output = StoreResult<T>> + Send + 'static,
        T: Send + 'static,
    {
        let store = self.0.store.clone();
        if store.as_sled().is_some() {
            return poll_here(op(store));
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let fut = op(store);
        self.0.store_runtime.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv().unwrap_or_else(|_| {
            Err(StoreError::Unavailable(
                "the node's runtime stopped before the store answered".into(),
            ))
        })
    }

    /// Compiles (or loads) a stored module of `ns` on this blocking thread,
    /// through the compile gate ([`WasmEngine::compile_stored`]).
    pub(crate) fn sync_compile(&self, ns: &str, wasm: &[u8]) -> FnResult<Arc<CompiledModule>> {
        let m = self.0.engine.compile_stored(ns, wasm)?;
        self.sample();
        Ok(m)
    }
}

/// How long the record writer waits for more records before it writes a
/// batch that is not full: one store batch then
/// carries the records of many calls instead of a few, and of a busy
/// function's records in it only the newest [`MAX_LOGS`] are written
/// ([`keep_newest`]). 20 ms: a function's log shows a call at most that much
/// (plus the write) after its answer.
pub(crate) const RECORD_LINGER: Duration = Duration::from_millis(20);

/// Writes invocation records in batches until the node stops. A batch's
/// records of one function go into one store entry (a JSON array, under the
/// newest record's key): one store write per function per batch, where a
/// write per record cost more than the guest's own run under load.
///
/// It also keeps each function's log bounded: once it has written
/// [`MAX_LOGS`] records of a function since it last looked, it deletes that
/// function's entries older than the newest `MAX_LOGS` records
/// ([`trim_records`]). A busy function's log used to grow without bound,
/// on sled and on etcd, while `logs` never returns more than `MAX_LOGS`.
pub(crate) async fn write_records(store: Store, mut rx: mpsc::Receiver<QueuedRecord>) {
    let mut buf = Vec::with_capacity(RECORD_BATCH);
    // Records written per function (`log/<ns>/<name>/`) since its last trim.
    let mut since_trim: HashMap<Vec<u8>, usize> = HashMap::new();
    while rx.recv_many(&mut buf, RECORD_BATCH).await > 0 {
        // Linger asleep, then take what came meanwhile: waiting on the queue
        // instead would wake this task once per record.
        if buf.len() < RECORD_BATCH {
            tokio::time::sleep(RECORD_LINGER).await;
            while buf.len() < RECORD_BATCH {
                match rx.try_recv() {
                    Ok(r) => buf.push(r),
                    Err(_) => break,
                }
            }
        }
        if since_trim.len() >= TRIM_TRACKED_FUNCTIONS {
            // Functions long gone (or very many): forget the counts; a
            // function still busy is trimmed after its next MAX_LOGS records.
            since_trim.clear();
        }
        for r in &buf {
            match since_trim.get_mut(&r.prefix) {
                Some(n) => *n += 1,
                None => {
                    since_trim.insert(r.prefix.clone(), 1);
                }
            }
        }
        // Each namespace's count of records taken, announced once written.
        let mut taken: Vec<(Arc<RecordProgress>, u64)> = Vec::new();
        for r in &buf {
            match taken.iter_mut().find(|(p, _)| Arc::ptr_eq(p, &r.progress)) {
                Some((_, n)) => *n += 1,
                None => taken.push((r.progress.clone(), 1)),
            }
        }
        keep_newest(&mut buf, MAX_LOGS);
        // Buffered: a record is written after its call was answered, and an
        // fsync per batch cost more CPU than the batch (sled's threads and
        // the flusher, a few µs per invoke); a crash may lose the last ones.
        // On sled one write at a time, not a sled batch, which would wake
        // all of sled's I/O threads (`Store::apply_buffered`).
        for ops in store_batches(group_records(buf.drain(..))) {
            if let Err(e) = store.apply_buffered(ops).await {
                tracing::warn!(error = %e, "Invocation records could not be written.");
            }
        }
        for (progress, n) in taken {
            progress.written.send_modify(|w| *w += n);
        }
        let due: Vec<Vec<u8>> = since_trim
            .iter()
            .filter(|(_, n)| **n >= MAX_LOGS)
            .map(|(p, _)| p.clone())
            .collect();
        for prefix in due {
            since_trim.remove(&prefix);
            if let Err(e) = trim_records(&store, &prefix).await {
                tracing::warn!(error = %e, "Old invocation records could not be deleted.");
            }
        }
    }
}

/// The record writer's progress on one namespace's records, counted since
/// its first invoker started (a recreated one takes it over while records
/// are queued under it): `logs` waits for its own namespace's records only,
/// so a neighbour flooding the writer does not hold it up.
pub(crate) struct RecordProgress {
    /// Records handed to the writer's queue.
    pub(crate) queued: std::sync::atomic::AtomicU64,
    /// Records the writer took from the queue and has written (or left out
    /// as older than a function's newest `MAX_LOGS`).
    pub(crate) written: tokio::sync::watch::Sender<u64>,
}

impl Default for RecordProgress {
    fn default() -> Self {
        RecordProgress {
            queued: std::sync::atomic::AtomicU64::new(0),
            written: tokio::sync::watch::Sender::new(0),
        }
    }
}

/// How long `logs` waits for the records queued before it to be written;
/// past it (a store that does not answer) it reads what is stored.
pub(crate) const RECORD_FLUSH_WAIT: Duration = Duration::from_secs(2);

/// Functions whose written-record counts the writer tracks at most.
const TRIM_TRACKED_FUNCTIONS: usize = 10_000;

/// Deletes a function's log entries (`prefix` is `log/<ns>/<name>/`) older
/// than those holding its newest [`MAX_LOGS`] records, keeping one entry
/// more: `logs` reads that one too, since a record that finished late can
/// sit in an older entry than a record that started after it. Returns the
/// entries deleted. Another node's writer trimming the same function at
/// the same time deletes the same old entries; nothing newer is touched.
pub(crate) async fn trim_records(store: &Store, prefix: &[u8]) -> StoreResult<usize> {
    let rows = store.scan_all(prefix).await?;
    let mut kept_records = 0;
    let mut keep = rows.len();
    for (i, (_, v)) in rows.iter().enumerate().rev() {
        if kept_records >= MAX_LOGS {
            keep = rows.len() - i; // this entry is the one kept past the limit
            break;
        }
        kept_records += count_log_entry(v);
    }
    let old = rows.len() - keep;
    let deletes: Vec<BatchOp> = rows
        .into_iter()
        .take(old)
        .map(|(k, _)| BatchOp::Delete(k))
        .collect();
    for chunk in deletes.chunks(RECORD_ENTRIES_PER_BATCH) {
        store.apply_buffered(chunk.to_vec()).await?;
    }
    Ok(old)
}

/// Drops every record of `buf` (in arrival order) but the newest `n` of
/// each function: the older ones are past what `logs` answers and what the
/// trim keeps, so writing them only to delete them was sled's and etcd's
/// busiest work under load (a third of an invoke's store threads' CPU,
/// BENCHMARKS.md).
pub(crate) fn keep_newest(buf: &mut Vec<QueuedRecord>, n: usize) {
    let mut seen: HashMap<&[u8], usize> = HashMap::new();
    let mut keep: Vec<bool> = buf
        .iter()
        .rev()
        .map(|r| {
            let c = seen.entry(&r.prefix[..]).or_default();
            *c += 1;
            *c <= n
        })
        .collect();
    drop(seen);
    keep.reverse();
    let mut flags = keep.into_iter();
    buf.retain(|_| flags.next().unwrap_or(true));
}

/// Splits entries into store batches of at most `RECORD_ENTRIES_PER_BATCH`
/// entries and `RECORD_BATCH_BYTES` bytes (a larger entry goes alone).
pub(crate) fn store_batches(entries: Vec<(Vec<u8>, Vec<u8>)>) -> Vec<Vec<BatchOp>> {
    let mut batches: Vec<Vec<BatchOp>> = Vec::new();
    let mut bytes = 0;
    for (k, v) in entries {
        let size = k.len() + v.len();
        match batches.last_mut() {
            Some(b) if b.len() < RECORD_ENTRIES_PER_BATCH && bytes + size <= RECORD_BATCH_BYTES => {
                bytes += size;
                b.push(BatchOp::Put(k, v));
            }
            _ => {
                bytes = size;
                batches.push(vec![BatchOp::Put(k, v)]);
            }
        }
    }
    batches
}

/// Groups records by function, in queue order, into (key, JSON array)
/// entries of at most about `RECORD_ENTRY_BYTES` each.
pub(crate) fn group_records(
    records: impl Iterator<Item = QueuedRecord>,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    // Index of each function's open entry in `out`.
    let mut open: HashMap<Vec<u8>, usize> = HashMap::new();
    let mut out: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    // One record's JSON at a time, the buffer reused.
    let mut json = Vec::new();
    for r in records {
        json.clear();
        serde_json::to_writer(&mut json, &r.record).expect("serializable");
        let key = log_key_under(&r.prefix, r.record.timestamp_ms, &r.record.request_id);
        match open.get(&r.prefix) {
            Some(&i) if out[i].1.len() + json.len() < RECORD_ENTRY_BYTES => {
                let (newest, value) = &mut out[i];
                value.pop(); // the closing `]`
                value.push(b',');
                value.extend_from_slice(&json);
                value.push(b']');
                // The entry sorts by its newest record.
                if key > *newest {
                    *newest = key;
                }
            }
            _ => {
                let mut value = Vec::with_capacity(json.len() + 2);
                value.push(b'[');
                value.extend_from_slice(&json);
                value.push(b']');
                open.insert(r.prefix, out.len());
                out.push((key, value));
            }
        }
    }
    out
}
