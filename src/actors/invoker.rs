//! The node's [`FunctionsService`] and each namespace's [`Invoker`].
//!
//! The invoker belongs to its namespace's supervisor: every path that runs a
//! function (HTTP, the public route, `/v1/ws`, pub/sub and cron triggers,
//! nested `invoke`) goes through the invoker of the function's own namespace,
//! whose [`HostApi`] reaches only that namespace's KV, topics and functions.
//! Guests run on the engine's worker pool, never on the actor's thread.

use crate::error::Code;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake};
use std::time::Duration;

use actix::Addr;
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use prometheus::IntCounter;
use serde::Serialize;
use tokio::sync::mpsc;

use super::{ActorStats, MAX_KV_KEY, NamespaceSupervisor, Publish};
use crate::functions::model::{
    FunctionRecord, InvocationRecord, LogEntry, MAX_VALUE_BYTES, MAX_VERSIONS, VersionMeta,
    blob_key, cron_claim_key, fn_key, fn_prefix, kv_prefix, log_key, log_prefix, parse_cron,
    secret_key, secret_prefix, topic_matches, valid_function_name, valid_secret_name, ver_key,
};
use crate::functions::{FnError, FnResult, SecretBox};
use crate::metrics::Metrics;
use crate::storage::{BatchOp, OrderedKv, Store, StoreError, StoreResult};
use crate::wasm::{
    CompiledModule, HostApi, HostError, Invocation, MAX_INPUT_BYTES, ResolvedFunction, WasmEngine,
};

/// Invocation records waiting for the writer; past this they are dropped (and counted).
pub const RECORD_QUEUE: usize = 1024;
/// Records written per store batch at most (etcd takes 128 operations per
/// transaction by default).
const RECORD_BATCH: usize = 64;
/// How often the pool gauges and cache counters are refreshed.
const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// Trigger chains (pub/sub publishes from triggered functions) stop at this depth.
pub const MAX_TRIGGER_DEPTH: u8 = 5;
/// Compiled modules kept per namespace before the cache is cleared.
const MAX_CACHED_MODULES: usize = 64;
/// Largest value a guest may write into the KV.
const MAX_KV_VALUE: usize = 1 << 20;
/// How long a claimed cron slot is remembered.
const CRON_CLAIM_TTL: Duration = Duration::from_secs(3600);
/// Records `GET /v1/functions/{name}/logs` returns at most.
pub const MAX_LOGS: usize = 100;

/// Unix milliseconds now.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// Polls a future to completion on the current (non-runtime) thread, parking
/// between polls. Only for sled, which does its work synchronously and needs
/// no runtime (see [`FunctionsService::store_wait`]).
fn poll_here<F: Future>(f: F) -> F::Output {
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

/// What started an invocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Trigger {
    /// `POST /v1/functions/{name}/invoke`.
    Http,
    /// `POST /v1/invoke/{namespace}/{name}`.
    Public,
    /// The `invoke` frame of `/v1/ws`.
    Ws,
    /// A pub/sub trigger.
    Pubsub,
    /// A cron trigger.
    Cron,
    /// The namespace's claims provider, when one of its tokens is issued.
    Claims,
}

impl Trigger {
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Http => "http",
            Trigger::Public => "public",
            Trigger::Ws => "ws",
            Trigger::Pubsub => "pubsub",
            Trigger::Cron => "cron",
            Trigger::Claims => "claims",
        }
    }
}

/// Who is calling, as the guest's `caller` import shows it.
#[derive(Debug, Clone, Default)]
pub struct CallerInfo {
    /// The credential's subject; None for anonymous callers and triggers.
    pub subject: Option<String>,
    /// The request id (generated for triggers).
    pub request_id: String,
}

/// A validated deploy.
#[derive(Debug, Clone)]
pub struct DeployRequest {
    pub name: String,
    pub wasm: Vec<u8>,
    pub memory_limit_mb: u32,
    pub timeout_seconds: u32,
    pub is_public: bool,
    pub env_vars: std::collections::BTreeMap<String, String>,
    pub pubsub_topics: Vec<String>,
    pub cron: Vec<String>,
}

/// What a deploy answers.
#[derive(Debug, Clone, Serialize)]
pub struct Deployed {
    pub name: String,
    pub version: u64,
    pub sha256: String,
    pub size_bytes: usize,
    pub is_public: bool,
    pub created_at: u64,
}

/// A successful invocation.
#[derive(Debug, Clone)]
pub struct Reply {
    pub output: Vec<u8>,
    pub duration: Duration,
    pub version: u64,
    pub request_id: String,
}

struct ServiceInner {
    engine: WasmEngine,
    store: Store,
    metrics: Metrics,
    records: mpsc::Sender<(Vec<u8>, Vec<u8>)>,
    /// The runtime the store was opened on (the node's), where the
    /// synchronous paths run their store operations (`store_wait`).
    store_runtime: tokio::runtime::Handle,
    secrets: SecretBox,
    cache_hits: IntCounter,
    cache_misses: IntCounter,
}

/// The node's functions service: the engine, the record queue, the secret key.
#[derive(Clone)]
pub struct FunctionsService(Arc<ServiceInner>);

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

    /// Validates and compiles a module off the event loop.
    pub async fn compile(&self, wasm: Vec<u8>) -> FnResult<Arc<CompiledModule>> {
        let svc = self.clone();
        let module = tokio::task::spawn_blocking(move || svc.0.engine.compile(&wasm))
            .await
            .map_err(|e| FnError::Internal(format!("compile task failed: {e}")))??;
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
        let hits = self.0.engine.cache_hits();
        let misses = self.0.engine.cache_misses();
        self.0
            .cache_hits
            .inc_by(hits.saturating_sub(self.0.cache_hits.get()));
        self.0
            .cache_misses
            .inc_by(misses.saturating_sub(self.0.cache_misses.get()));
    }

    /// The invoker of one namespace.
    pub fn invoker(&self, ns: &str) -> Invoker {
        Invoker {
            ns: ns.into(),
            svc: self.clone(),
            st: Arc::new(NsState {
                modules: Default::default(),
                resolved: Default::default(),
                triggers: Default::default(),
                deploy_lock: Default::default(),
                publisher: Default::default(),
                last_cron: Default::default(),
            }),
        }
    }

    /// Runs a store operation from a thread that is no runtime's and may block:
    /// a WASM worker (the guest's host calls) or a blocking task (`resolve_sync`).
    /// sled works synchronously, so its future is polled right here. etcd's
    /// client needs a runtime (its request deadlines are tokio timers) and its
    /// connection lives on the runtime that opened it, so the operation is
    /// spawned onto that runtime and this thread waits for the answer. Never
    /// call it on a runtime thread: it blocks.
    fn store_wait<T, F>(&self, op: impl FnOnce(Store) -> F) -> StoreResult<T>
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

    fn sync_compile(&self, wasm: &[u8]) -> FnResult<Arc<CompiledModule>> {
        let m = self.0.engine.compile(wasm)?;
        self.sample();
        Ok(m)
    }
}

/// How long the record writer waits for more records before it writes a
/// batch that is not full: one store batch (and one durable flush) then
/// carries the records of many calls instead of a few.
const RECORD_LINGER: Duration = Duration::from_millis(5);

/// Writes invocation records in batches until the node stops.
async fn write_records(store: Store, mut rx: mpsc::Receiver<(Vec<u8>, Vec<u8>)>) {
    let mut buf = Vec::with_capacity(RECORD_BATCH);
    while rx.recv_many(&mut buf, RECORD_BATCH).await > 0 {
        let until = tokio::time::Instant::now() + RECORD_LINGER;
        while buf.len() < RECORD_BATCH {
            // `recv_many` is cancel safe: a timeout loses no record.
            let room = RECORD_BATCH - buf.len();
            let more = rx.recv_many(&mut buf, room);
            match tokio::time::timeout_at(until, more).await {
                Ok(n) if n > 0 => {}
                _ => break,
            }
        }
        let ops = buf.drain(..).map(|(k, v)| BatchOp::Put(k, v)).collect();
        if let Err(e) = store.apply_batch(ops).await {
            tracing::warn!(error = %e, "Invocation records could not be written.");
        }
    }
}

/// The triggers of one function's current version.
struct TriggerEntry {
    name: String,
    topics: Vec<String>,
    crons: Vec<(String, cron::Schedule)>,
}

struct NsState {
    modules: Mutex<HashMap<(String, u64), Arc<CompiledModule>>>,
    /// Functions resolved once (record, version, module, environment), by
    /// name and requested version; see [`Invoker::cached`].
    resolved: Mutex<ResolvedCache>,
    triggers: RwLock<Vec<TriggerEntry>>,
    deploy_lock: tokio::sync::Mutex<()>,
    publisher: Mutex<Option<(Addr<NamespaceSupervisor>, Arc<ActorStats>)>>,
    last_cron: Mutex<Option<chrono::DateTime<chrono::Utc>>>,
}

/// One namespace's invoker: runs only that namespace's functions.
#[derive(Clone)]
pub struct Invoker {
    ns: Arc<str>,
    svc: FunctionsService,
    st: Arc<NsState>,
}

/// Resolved functions kept between calls. `generation` moves on every change
/// this invoker makes (deploy, delete, secrets, import): a resolution that
/// began under an older generation is not kept.
#[derive(Default)]
struct ResolvedCache {
    generation: u64,
    map: HashMap<(String, Option<u64>), Arc<Resolved>>,
}

/// Resolutions kept per namespace before the cache is cleared.
const MAX_CACHED_RESOLVED: usize = 256;

/// A resolved function: record, version, module, environment.
struct Resolved {
    /// The function record's stored bytes, compared on every use of a cached
    /// resolution (any change to the record, a delete included, misses).
    record_bytes: Vec<u8>,
    record: FunctionRecord,
    meta: VersionMeta,
    module: Arc<CompiledModule>,
    env: Vec<(String, String)>,
}

/// An invocation ready to run (the module resolved, the call built).
pub struct Prepared {
    inv: Invoker,
    module: Arc<CompiledModule>,
    call: Invocation,
    host: Arc<dyn HostApi>,
    request_id: String,
    trigger: Trigger,
    /// The version that will run.
    pub version: u64,
    /// Whether the function is public.
    pub is_public: bool,
}

impl Prepared {
    /// Runs the guest on the worker pool, counts it and queues its record.
    pub async fn run(self) -> FnResult<Reply> {
        let Prepared {
            inv,
            module,
            call,
            host,
            request_id,
            trigger,
            version,
            ..
        } = self;
        let name = call.function.clone();
        let engine = inv.svc.0.engine.clone();
        // The pool gauges are refreshed by the sampler (every second), not
        // per call: a snapshot takes the pool's lock and copies its queues.
        let result = engine.invoke(module, call, host).await;
        let m = &inv.svc.0.metrics;
        let label = m.ns_label(&inv.ns);
        m.invocations.with_label_values(&[label.as_str()]).inc();
        let (status, error, duration, logs) = match &result {
            Ok(out) => ("ok".to_string(), None, out.duration, out.logs.clone()),
            Err(e) => {
                m.invocation_errors
                    .with_label_values(&[label.as_str()])
                    .inc();
                (
                    crate::functions::wasm_error_code(e).to_string(),
                    Some(e.to_string()),
                    Duration::ZERO,
                    Vec::new(),
                )
            }
        };
        inv.record(InvocationRecord {
            request_id: request_id.clone(),
            function: name,
            version,
            trigger: trigger.as_str().into(),
            status,
            error,
            duration_ms: duration.as_millis() as u64,
            timestamp_ms: now_ms(),
            logs: logs
                .into_iter()
                .map(|l| LogEntry {
                    level: l.level,
                    message: l.message,
                })
                .collect(),
        });
        let out = result?;
        Ok(Reply {
            output: out.stdout,
            duration: out.duration,
            version,
            request_id,
        })
    }
}

impl Invoker {
    fn store(&self) -> &Store {
        &self.svc.0.store
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.ns
    }

    /// Gives the invoker its supervisor, the one way its guests publish.
    pub fn attach(&self, addr: Addr<NamespaceSupervisor>, stats: Arc<ActorStats>) {
        *self.st.publisher.lock() = Some((addr, stats));
    }

    fn record(&self, rec: InvocationRecord) {
        let key = log_key(&self.ns, &rec.function, rec.timestamp_ms, &rec.request_id);
        let value = serde_json::to_vec(&rec).expect("serializable");
        if self.svc.0.records.try_send((key, value)).is_err() {
            self.svc.0.metrics.invocation_records_dropped.inc();
        }
    }

    /// Deploys a compiled module as the function's next version: the blob
    /// first, then version and record in one atomic batch, so a crash leaves
    /// the function at its old version or its new one.
    pub async fn deploy(
        &self,
        req: DeployRequest,
        module: Arc<CompiledModule>,
    ) -> FnResult<Deployed> {
        let _g = self.st.deploy_lock.lock().await;
        let store = self.store();
        let sha = module.sha256_hex();
        let blob = blob_key(&sha);
        if store.get(&blob).await?.is_none() {
            store.put(&blob, &req.wasm).await?;
        }
        let key = fn_key(&self.ns, &req.name);
        let old: Option<FunctionRecord> = store.get_json(&key).await?;
        let now = crate::util::now();
        let (version, mut versions, created_at) = match &old {
            Some(r) => (
                r.versions
                    .iter()
                    .copied()
                    .max()
                    .unwrap_or(0)
                    .max(r.current_version)
                    + 1,
                r.versions.clone(),
                r.created_at,
            ),
            None => (1, Vec::new(), now),
        };
        versions.push(version);
        let mut ops = Vec::new();
        let mut evicted = Vec::new();
        while versions.len() > MAX_VERSIONS {
            let v = versions.remove(0);
            evicted.push(v);
            ops.push(BatchOp::Delete(ver_key(&self.ns, &req.name, v)));
        }
        let meta = VersionMeta {
            version,
            sha256: sha.clone(),
            size_bytes: req.wasm.len(),
            memory_limit_mb: req.memory_limit_mb,
            timeout_seconds: req.timeout_seconds,
            env_vars: req.env_vars,
            pubsub_topics: req.pubsub_topics,
            cron: req.cron,
            created_at: now,
        };
        let record = FunctionRecord {
            name: req.name.clone(),
            current_version: version,
            is_public: req.is_public,
            versions,
            created_at,
            updated_at: now,
        };
        ops.push(BatchOp::Put(
            ver_key(&self.ns, &req.name, version),
            serde_json::to_vec(&meta).expect("serializable"),
        ));
        ops.push(BatchOp::Put(
            key,
            serde_json::to_vec(&record).expect("serializable"),
        ));
        store.apply_batch(ops).await?;
        self.forget_resolutions();
        {
            let mut modules = self.st.modules.lock();
            for v in evicted {
                modules.remove(&(req.name.clone(), v));
            }
            if modules.len() >= MAX_CACHED_MODULES {
                modules.clear();
            }
            modules.insert((req.name.clone(), version), module);
        }
        self.set_triggers(&req.name, Some(&meta));
        tracing::info!(namespace = %self.ns, function = %req.name, version, "Function deployed.");
        Ok(Deployed {
            name: req.name,
            version,
            sha256: sha,
            size_bytes: meta.size_bytes,
            is_public: req.is_public,
            created_at: now,
        })
    }

    fn set_triggers(&self, name: &str, meta: Option<&VersionMeta>) {
        let mut t = self.st.triggers.write();
        t.retain(|e| e.name != name);
        if let Some(meta) = meta {
            let crons: Vec<_> = meta
                .cron
                .iter()
                .filter_map(|c| parse_cron(c).ok().map(|s| (c.clone(), s)))
                .collect();
            if !meta.pubsub_topics.is_empty() || !crons.is_empty() {
                t.push(TriggerEntry {
                    name: name.to_string(),
                    topics: meta.pubsub_topics.clone(),
                    crons,
                });
            }
        }
    }

    /// Loads the triggers of every function (at supervisor start and after an
    /// import), forgetting every kept resolution: the functions may all have changed.
    pub async fn load_triggers(&self) -> FnResult<()> {
        self.forget_resolutions();
        for rec in self.list().await? {
            let meta: Option<VersionMeta> = self
                .store()
                .get_json(&ver_key(&self.ns, &rec.name, rec.current_version))
                .await?;
            self.set_triggers(&rec.name, meta.as_ref());
        }
        Ok(())
    }

    /// Every function of the namespace, by name.
    pub async fn list(&self) -> FnResult<Vec<FunctionRecord>> {
        let rows = self.store().scan_all(&fn_prefix(&self.ns)).await?;
        Ok(rows
            .into_iter()
            .filter_map(|(_, v)| serde_json::from_slice(&v).ok())
            .collect())
    }

    async fn record_of(&self, name: &str) -> FnResult<FunctionRecord> {
        if !valid_function_name(name) {
            return Err(FnError::NotFound(format!("no function {name:?}")));
        }
        self.store()
            .get_json(&fn_key(&self.ns, name))
            .await?
            .ok_or_else(|| FnError::NotFound(format!("no function {name:?}")))
    }

    /// A function, its current version's settings, and the engine's cache counters.
    pub async fn show(&self, name: &str) -> FnResult<serde_json::Value> {
        let record = self.record_of(name).await?;
        let meta: Option<VersionMeta> = self
            .store()
            .get_json(&ver_key(&self.ns, name, record.current_version))
            .await?;
        Ok(serde_json::json!({
            "function": record,
            "current": meta,
            "engine": {
                "cache_hits": self.svc.0.engine.cache_hits(),
                "cache_misses": self.svc.0.engine.cache_misses(),
            },
        }))
    }

    /// The kept versions, oldest first.
    pub async fn versions(&self, name: &str) -> FnResult<Vec<VersionMeta>> {
        let record = self.record_of(name).await?;
        let mut out = Vec::new();
        for v in record.versions {
            if let Some(m) = self.store().get_json(&ver_key(&self.ns, name, v)).await? {
                out.push(m);
            }
        }
        Ok(out)
    }

    /// Deletes a function with its versions and records (blobs are shared, kept).
    pub async fn delete(&self, name: &str) -> FnResult<()> {
        let _g = self.st.deploy_lock.lock().await;
        self.record_of(name).await?;
        let store = self.store();
        let mut ops = vec![BatchOp::Delete(fn_key(&self.ns, name))];
        let ver_prefix = format!("fnver/{}/{name}/", self.ns).into_bytes();
        for (k, _) in store.scan_all(&ver_prefix).await? {
            ops.push(BatchOp::Delete(k));
        }
        for (k, _) in store.scan_all(&log_prefix(&self.ns, name)).await? {
            ops.push(BatchOp::Delete(k));
        }
        store.apply_batch(ops).await?;
        self.forget_resolutions();
        self.st.modules.lock().retain(|(n, _), _| n != name);
        self.set_triggers(name, None);
        tracing::info!(namespace = %self.ns, function = %name, "Function deleted.");
        Ok(())
    }

    /// The newest invocation records of a function, newest first.
    pub async fn logs(&self, name: &str, limit: usize) -> FnResult<Vec<InvocationRecord>> {
        self.record_of(name).await?;
        let rows = self.store().scan_all(&log_prefix(&self.ns, name)).await?;
        Ok(rows
            .into_iter()
            .rev()
            .take(limit.clamp(1, MAX_LOGS))
            .filter_map(|(_, v)| serde_json::from_slice(&v).ok())
            .collect())
    }

    /// Seals and stores a secret.
    pub async fn put_secret(&self, key: &str, value: &str) -> FnResult<()> {
        if !valid_secret_name(key) {
            return Err(FnError::bad(
                Code::InvalidSecret,
                "a secret name is 1 to 128 of [A-Za-z0-9_], not starting with a digit",
            ));
        }
        if value.len() > MAX_VALUE_BYTES {
            return Err(FnError::bad(
                Code::InvalidSecret,
                format!("a secret value is at most {MAX_VALUE_BYTES} bytes"),
            ));
        }
        let k = secret_key(&self.ns, key);
        let sealed = self.svc.0.secrets.seal(&k, value.as_bytes());
        self.store().put(&k, &sealed).await?;
        self.forget_resolutions();
        Ok(())
    }

    /// Secret names (never values).
    pub async fn list_secrets(&self) -> FnResult<Vec<String>> {
        let p = secret_prefix(&self.ns);
        Ok(self
            .store()
            .scan_all(&p)
            .await?
            .into_iter()
            .map(|(k, _)| String::from_utf8_lossy(&k[p.len()..]).into_owned())
            .collect())
    }

    /// Deletes a secret.
    pub async fn delete_secret(&self, key: &str) -> FnResult<()> {
        if !valid_secret_name(key) || !self.store().delete(&secret_key(&self.ns, key)).await? {
            return Err(FnError::NotFound(format!("no secret {key:?}")));
        }
        self.forget_resolutions();
        Ok(())
    }

    /// Whether resolutions are kept: on the node's own sled store, where every
    /// write to a function, its versions or the namespace's secrets goes
    /// through this invoker (which forgets what it kept) or changes the
    /// function record (checked on every use). On etcd another node may
    /// change secrets unseen, so every call resolves afresh there.
    fn keeps_resolutions(&self) -> bool {
        self.store().as_sled().is_some()
    }

    /// A kept resolution of `name`, if the stored function record is still
    /// byte for byte the one it was resolved from (one local sled read, no
    /// blocking thread).
    async fn cached(&self, name: &str, version: Option<u64>) -> FnResult<Option<Arc<Resolved>>> {
        if !self.keeps_resolutions() {
            return Ok(None);
        }
        let hit = self
            .st
            .resolved
            .lock()
            .map
            .get(&(name.to_string(), version))
            .cloned();
        let Some(r) = hit else { return Ok(None) };
        let now = self.store().get(&fn_key(&self.ns, name)).await?;
        if now.as_deref() == Some(&r.record_bytes[..]) {
            return Ok(Some(r));
        }
        self.forget_resolutions();
        Ok(None)
    }

    /// Keeps a resolution made under `generation`, unless something changed since.
    fn keep(&self, name: &str, version: Option<u64>, generation: u64, r: &Arc<Resolved>) {
        if !self.keeps_resolutions() {
            return;
        }
        let mut c = self.st.resolved.lock();
        if c.generation != generation {
            return;
        }
        if c.map.len() >= MAX_CACHED_RESOLVED {
            c.map.clear();
        }
        c.map.insert((name.to_string(), version), r.clone());
    }

    /// Forgets every kept resolution (a deploy, a delete, a secret, an import).
    fn forget_resolutions(&self) {
        let mut c = self.st.resolved.lock();
        c.generation += 1;
        c.map.clear();
    }

    /// Resolves a function of THIS namespace synchronously (on a blocking or
    /// worker thread): record, version, module (cached or compiled), env.
    fn resolve_sync(&self, name: &str, version: Option<u64>) -> FnResult<Resolved> {
        if !valid_function_name(name) {
            return Err(FnError::NotFound(format!("no function {name:?}")));
        }
        let key = fn_key(&self.ns, name);
        let record_bytes = self
            .svc
            .store_wait(move |s| async move { s.get(&key).await })?
            .ok_or_else(|| FnError::NotFound(format!("no function {name:?}")))?;
        let record: FunctionRecord = serde_json::from_slice(&record_bytes).map_err(|e| {
            FnError::Internal(format!("function record {name:?} does not parse: {e}"))
        })?;
        let version = version.unwrap_or(record.current_version);
        if !record.versions.contains(&version) {
            return Err(FnError::NotFound(format!(
                "function {name:?} has no version {version}"
            )));
        }
        let key = ver_key(&self.ns, name, version);
        let meta: VersionMeta = self
            .svc
            .store_wait(move |s| async move { s.get_json(&key).await })?
            .ok_or_else(|| {
                FnError::NotFound(format!("function {name:?} has no version {version}"))
            })?;
        let cached = self
            .st
            .modules
            .lock()
            .get(&(name.to_string(), version))
            .cloned();
        let module = match cached {
            Some(m) => m,
            None => {
                let key = blob_key(&meta.sha256);
                let bytes = self
                    .svc
                    .store_wait(move |s| async move { s.get(&key).await })?
                    .ok_or_else(|| {
                        FnError::Internal(format!("module blob {} is missing", meta.sha256))
                    })?;
                let m = self.svc.sync_compile(&bytes)?;
                let mut modules = self.st.modules.lock();
                if modules.len() >= MAX_CACHED_MODULES {
                    modules.clear();
                }
                modules.insert((name.to_string(), version), m.clone());
                m
            }
        };
        let mut env: Vec<(String, String)> = meta
            .env_vars
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let p = secret_prefix(&self.ns);
        let prefix = p.clone();
        let sealed_secrets = self
            .svc
            .store_wait(move |s| async move { s.scan_all(&prefix).await })?;
        for (k, sealed) in sealed_secrets {
            let name = String::from_utf8_lossy(&k[p.len()..]).into_owned();
            match self.svc.0.secrets.open(&k, &sealed) {
                Some(v) => {
                    env.retain(|(n, _)| *n != name);
                    env.push((name, String::from_utf8_lossy(&v).into_owned()));
                }
                None => {
                    tracing::warn!(namespace = %self.ns, secret = %name, "Secret does not open; skipped.")
                }
            }
        }
        Ok(Resolved {
            record_bytes,
            record,
            meta,
            module,
            env,
        })
    }

    /// Resolves the function and builds the call; the guest does not run yet.
    pub async fn prepare(
        &self,
        name: String,
        version: Option<u64>,
        input: Vec<u8>,
        caller: CallerInfo,
        trigger: Trigger,
        depth: u8,
    ) -> FnResult<Prepared> {
        if input.len() > MAX_INPUT_BYTES {
            return Err(crate::wasm::WasmError::InputTooLarge.into());
        }
        let r = match self.cached(&name, version).await? {
            Some(r) => r,
            None => {
                let generation = self.st.resolved.lock().generation;
                let inv = self.clone();
                let n = name.clone();
                let r = tokio::task::spawn_blocking(move || inv.resolve_sync(&n, version))
                    .await
                    .map_err(|e| FnError::Internal(format!("resolve task failed: {e}")))??;
                let r = Arc::new(r);
                self.keep(&name, version, generation, &r);
                r
            }
        };
        let caller_json = serde_json::to_vec(&serde_json::json!({
            "subject": caller.subject,
            "namespace": &*self.ns,
            "request_id": caller.request_id,
            "trigger": trigger.as_str(),
        }))
        .expect("serializable");
        let call = Invocation {
            namespace: self.ns.to_string(),
            function: name,
            version: r.meta.version,
            input,
            env: r.env.clone(),
            memory_limit_mb: r.meta.memory_limit_mb,
            timeout: Duration::from_secs(r.meta.timeout_seconds.into()),
            caller_json,
            depth: 0,
        };
        Ok(Prepared {
            host: Arc::new(NsHost {
                inv: self.clone(),
                depth,
            }),
            inv: self.clone(),
            module: r.module.clone(),
            call,
            request_id: caller.request_id,
            trigger,
            version: r.meta.version,
            is_public: r.record.is_public,
        })
    }

    /// Fires the pub/sub triggers matching `topic` (called by the supervisor
    /// for every accepted publish). `depth` is the publisher's trigger depth.
    pub fn on_published(&self, topic: &str, data: &Bytes, depth: u8) {
        if depth >= MAX_TRIGGER_DEPTH {
            return;
        }
        let names: Vec<String> = self
            .st
            .triggers
            .read()
            .iter()
            .filter(|e| e.topics.iter().any(|p| topic_matches(p, topic)))
            .map(|e| e.name.clone())
            .collect();
        if names.is_empty() {
            return;
        }
        use base64::Engine;
        let event = serde_json::to_vec(&serde_json::json!({
            "topic": topic,
            "data_base64": base64::engine::general_purpose::STANDARD.encode(data),
            "namespace": &*self.ns,
            "trigger_depth": depth + 1,
            "timestamp": crate::util::now(),
        }))
        .expect("serializable");
        for name in names {
            self.spawn_trigger(name, event.clone(), Trigger::Pubsub, depth + 1, None);
        }
    }

    /// Fires the cron slots that fell since the last tick (called each second).
    pub fn cron_tick(&self) {
        let now = chrono::Utc::now();
        let last = self.st.last_cron.lock().replace(now);
        let Some(last) = last else { return };
        let mut due = Vec::new();
        for e in self.st.triggers.read().iter() {
            for (expr, s) in &e.crons {
                if let Some(next) = s.after(&last).next()
                    && next <= now
                {
                    due.push((e.name.clone(), expr.clone(), next.timestamp()));
                }
            }
        }
        for (name, expr, slot) in due {
            let event = serde_json::to_vec(&serde_json::json!({
                "cron": expr,
                "scheduled_at": slot,
                "namespace": &*self.ns,
            }))
            .expect("serializable");
            self.spawn_trigger(name, event, Trigger::Cron, 1, Some(slot));
        }
    }

    fn spawn_trigger(
        &self,
        name: String,
        input: Vec<u8>,
        trigger: Trigger,
        depth: u8,
        slot: Option<i64>,
    ) {
        let inv = self.clone();
        actix::spawn(async move {
            if let Some(slot) = slot {
                // In a cluster every member ticks: the one that claims the slot runs it.
                let claim = cron_claim_key(&inv.ns, &name, slot);
                let claimed = inv
                    .store()
                    .compare_and_swap(&claim, None, Some(b"1"), Some(CRON_CLAIM_TTL))
                    .await;
                let outcome = match &claimed {
                    Ok(true) => "claimed",
                    Ok(false) => "lost",
                    Err(_) => "error",
                };
                inv.svc
                    .0
                    .metrics
                    .cron_slots
                    .with_label_values(&[outcome])
                    .inc();
                match claimed {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(e) => {
                        tracing::warn!(namespace = %inv.ns, function = %name, error = %e, "Cron slot could not be claimed.");
                        return;
                    }
                }
            }
            let caller = CallerInfo {
                subject: None,
                request_id: hex::encode(crate::util::random_bytes::<8>()),
            };
            let res = match inv
                .prepare(name.clone(), None, input, caller, trigger, depth)
                .await
            {
                Ok(p) => p.run().await.map(|_| ()),
                Err(e) => Err(e),
            };
            if let Err(e) = res {
                tracing::debug!(namespace = %inv.ns, function = %name, trigger = trigger.as_str(), error = %e, "Triggered invocation failed.");
            }
        });
    }
}

/// The host services of one invocation: everything scoped to the invoker's namespace.
struct NsHost {
    inv: Invoker,
    /// Trigger depth of the running function; its publishes carry it.
    depth: u8,
}

fn host_err(e: impl std::fmt::Display) -> HostError {
    HostError::Internal(e.to_string())
}

impl NsHost {
    fn kv_key(&self, key: &[u8]) -> Result<Vec<u8>, HostError> {
        if key.is_empty() || key.len() > MAX_KV_KEY {
            return Err(HostError::BadArgument);
        }
        let mut k = kv_prefix(&self.inv.ns);
        k.extend_from_slice(key);
        Ok(k)
    }
}

impl HostApi for NsHost {
    fn kv_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, HostError> {
        let k = self.kv_key(key)?;
        self.inv
            .svc
            .store_wait(move |s| async move { s.get(&k).await })
            .map_err(host_err)
    }

    fn kv_put(&self, key: &[u8], value: &[u8]) -> Result<(), HostError> {
        let k = self.kv_key(key)?;
        if value.len() > MAX_KV_VALUE {
            return Err(HostError::BadArgument);
        }
        let value = value.to_vec();
        self.inv
            .svc
            .store_wait(move |s| async move { s.put(&k, &value).await })
            .map_err(host_err)
    }

    fn kv_delete(&self, key: &[u8]) -> Result<(), HostError> {
        let k = self.kv_key(key)?;
        self.inv
            .svc
            .store_wait(move |s| async move { s.delete(&k).await })
            .map(|_| ())
            .map_err(host_err)
    }

    fn publish(&self, topic: &str, data: &[u8]) -> Result<(), HostError> {
        crate::pubsub::check_topic(topic).map_err(|_| HostError::BadArgument)?;
        let Some((addr, stats)) = self.inv.st.publisher.lock().clone() else {
            return Err(HostError::Internal(
                "the namespace supervisor is not attached".into(),
            ));
        };
        // Bounded like any other sender: a full mailbox is LIMIT, never a wait.
        if !stats.admit() {
            return Err(HostError::LimitReached);
        }
        let msg = Publish {
            topic: topic.to_string(),
            data: Bytes::copy_from_slice(data),
            depth: self.depth,
        };
        match addr.try_send(msg) {
            Ok(()) => Ok(()),
            Err(_) => {
                stats.cancel();
                Err(HostError::LimitReached)
            }
        }
    }

    fn resolve(&self, name: &str) -> Result<ResolvedFunction, HostError> {
        match self.inv.resolve_sync(name, None) {
            Ok(r) => Ok(ResolvedFunction {
                module: r.module,
                version: r.meta.version,
                env: r.env,
                memory_limit_mb: r.meta.memory_limit_mb,
                timeout: Duration::from_secs(r.meta.timeout_seconds.into()),
            }),
            Err(FnError::NotFound(_)) => Err(HostError::NotFound),
            Err(e) => Err(host_err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOOP: &[u8] = br#"(module (func (export "_start")))"#;

    fn request(name: &str) -> DeployRequest {
        DeployRequest {
            name: name.into(),
            wasm: NOOP.to_vec(),
            memory_limit_mb: 16,
            timeout_seconds: 5,
            is_public: false,
            env_vars: [("MODE".to_string(), "plain".to_string())].into(),
            pubsub_topics: Vec::new(),
            cron: Vec::new(),
        }
    }

    async fn prepared(inv: &Invoker, name: &str) -> FnResult<Prepared> {
        let caller = CallerInfo {
            subject: None,
            request_id: "r".into(),
        };
        inv.prepare(name.into(), None, Vec::new(), caller, Trigger::Http, 0)
            .await
    }

    fn env_of(p: &Prepared, k: &str) -> Option<String> {
        p.call
            .env
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
    }

    /// A kept resolution is used while nothing changed, and every change a
    /// call must see (a secret set or deleted, a new version, a delete, a
    /// record written by another path such as an import) is seen by the next call.
    #[actix_rt::test]
    async fn kept_resolutions_follow_every_change() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        let engine =
            WasmEngine::new(crate::wasm::WasmConfig::default(), dir.path().join("cache")).unwrap();
        let svc = FunctionsService::start(engine, store.clone(), Metrics::new(), &[7u8; 32]);
        let inv = svc.invoker("ns");
        let module = svc.compile(NOOP.to_vec()).await.unwrap();
        inv.deploy(request("f"), module.clone()).await.unwrap();

        inv.put_secret("TOKEN", "a").await.unwrap();
        let p = prepared(&inv, "f").await.unwrap();
        assert_eq!((p.version, env_of(&p, "TOKEN").as_deref()), (1, Some("a")));
        assert_eq!(env_of(&p, "MODE").as_deref(), Some("plain"));
        assert_eq!(inv.st.resolved.lock().map.len(), 1, "kept");
        assert!(inv.cached("f", None).await.unwrap().is_some(), "used");

        inv.put_secret("TOKEN", "b").await.unwrap();
        let p = prepared(&inv, "f").await.unwrap();
        assert_eq!(env_of(&p, "TOKEN").as_deref(), Some("b"));

        inv.deploy(request("f"), module.clone()).await.unwrap();
        assert_eq!(prepared(&inv, "f").await.unwrap().version, 2);

        inv.delete_secret("TOKEN").await.unwrap();
        assert_eq!(env_of(&prepared(&inv, "f").await.unwrap(), "TOKEN"), None);

        // The record rewritten behind the invoker's back: the next call
        // resolves afresh (version 1 again).
        let key = fn_key("ns", "f");
        let mut rec: FunctionRecord = store.get_json(&key).await.unwrap().unwrap();
        rec.current_version = 1;
        store
            .put(&key, &serde_json::to_vec(&rec).unwrap())
            .await
            .unwrap();
        assert_eq!(prepared(&inv, "f").await.unwrap().version, 1);

        inv.delete("f").await.unwrap();
        assert!(matches!(
            prepared(&inv, "f").await,
            Err(FnError::NotFound(_))
        ));
    }
}
