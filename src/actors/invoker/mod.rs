//! The node's [`FunctionsService`] and each namespace's [`Invoker`].
//!
//! The invoker belongs to its namespace's supervisor: every path that runs a
//! function (HTTP, the public route, `/v1/ws`, pub/sub and cron triggers,
//! nested `invoke`) goes through the invoker of the function's own namespace,
//! whose [`HostApi`] reaches only that namespace's KV, topics and functions.
//! Guests run on the engine's worker pool, never on the actor's thread.
//!
//! The supervisor owns the state ([`FnOwner`]): limits, triggers, the
//! publish path. It changes it by its own messages only and publishes an
//! immutable [`Snapshot`] after each change; the invoker, shared with the
//! HTTP threads through `NsHandle`, reads that snapshot and its caches
//! without a lock.

use crate::error::Code;
use crate::quota::{Group, Resource, Usage, usage_key};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use crate::functions::model::{
    FunctionRecord, InvocationRecord, LogEntry, MAX_VALUE_BYTES, MAX_VERSIONS, VersionMeta,
    blob_key, cron_claim_key, fn_key, fn_prefix, kv_prefix, log_prefix, parse_cron, secret_key,
    secret_prefix, topic_matches, valid_function_name, valid_secret_name, ver_key,
};
use crate::functions::{FnError, FnResult};
use crate::metrics::NsCounter;
use crate::storage::{BatchOp, OrderedKv, Store};
use crate::wasm::{CompiledModule, HostApi, HostError, Invocation, ResolvedFunction};
use arc_swap::ArcSwap;
use bytes::Bytes;
use serde::Serialize;
#[cfg(test)]
use tokio::sync::mpsc;

mod host;
mod run;
mod service;
mod state;
mod triggers;

pub use service::{FunctionsService, MAX_LOGS};
use service::{QueuedRecord, RecordProgress, decode_log_entry, now_ms};
#[cfg(test)]
use service::{
    RECORD_BATCH_BYTES, RECORD_ENTRIES_PER_BATCH, RECORD_ENTRY_BYTES, RECORD_QUEUE, count_log_entry,
};
use state::TriggerEntry;
pub use state::{Publisher, Snapshot};

/// Trigger chains (pub/sub publishes from triggered functions) stop at this depth.
pub const MAX_TRIGGER_DEPTH: u8 = 5;
/// Compiled modules kept per namespace before the cache is cleared.
const MAX_CACHED_MODULES: usize = 64;
/// Largest value a guest may write into the KV.
const MAX_KV_VALUE: usize = 1 << 20;
/// How long a claimed cron slot is remembered.
const CRON_CLAIM_TTL: Duration = Duration::from_secs(3600);

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
    /// The request's W3C trace context; None starts a new trace (triggers).
    /// The guest reads it from its caller record (`traceparent`,
    /// `tracestate`), never from its environment; the record carries its
    /// trace id.
    pub trace: Option<crate::observe::trace::TraceContext>,
}

/// A validated deploy.
#[derive(Debug, Clone)]
pub struct DeployRequest {
    /// Function name in the namespace (already checked valid); keys its record and versions.
    pub name: String,
    /// The module's bytes, stored once as `blob/<sha256>` (shared by identical deploys).
    pub wasm: Vec<u8>,
    /// Guest memory limit in MiB for the new version, within `MEMORY_MB_RANGE`.
    pub memory_limit_mb: u32,
    /// Wall-clock limit of one invocation of the new version, within `TIMEOUT_RANGE`.
    pub timeout_seconds: u32,
    /// Whether the function may be called on its public route without a credential.
    pub is_public: bool,
    /// Plain environment the guest sees; secrets of the same name override it.
    pub env_vars: std::collections::BTreeMap<String, String>,
    /// Topic patterns whose publishes fire the new version (see `set_triggers`).
    pub pubsub_topics: Vec<String>,
    /// Cron expressions (UTC) that fire the new version; the cron tick reads them.
    pub cron: Vec<String>,
}

/// What a deploy answers.
#[derive(Debug, Clone, Serialize)]
pub struct Deployed {
    /// The deployed function's name, echoed back to the deployer.
    pub name: String,
    /// The version this deploy created, now the function's current one.
    pub version: u64,
    /// Hex SHA-256 of the module, its blob's key; lets the client verify what ran.
    pub sha256: String,
    /// Size of the uploaded module, in bytes.
    pub size_bytes: usize,
    /// Whether the deployed function is callable without a credential.
    pub is_public: bool,
    /// Unix seconds of this deploy (the new version's `created_at`).
    pub created_at: u64,
}

/// A successful invocation.
#[derive(Debug, Clone)]
pub struct Reply {
    /// What the guest wrote to stdout: the response body.
    pub output: Vec<u8>,
    /// Time the guest ran, as measured by the engine (not including queueing).
    pub duration: Duration,
    /// The version that ran (the current one when the call named none).
    pub version: u64,
}

/// Counts one invocation (prepared, queued, running) or trigger claim of a
/// namespace while it lives: a busy namespace does not passivate.
struct Busy(Arc<NsState>);

impl Busy {
    fn new(st: &Arc<NsState>) -> Self {
        st.busy.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Busy(st.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0
            .busy
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Compiled modules by (function, version).
type ModuleCache = HashMap<(String, u64), Arc<CompiledModule>>;

/// One namespace's shared state: what its supervisor published, the caches
/// the calls fill, the counters. Nothing here is locked: the snapshot and
/// the caches are swapped whole (`arc_swap`), the rest are atomics.
struct NsState {
    /// What the supervisor last published ([`FnOwner::publish`]): limits,
    /// triggers, the publish path, the resolutions' generation.
    snapshot: ArcSwap<Snapshot>,
    /// Compiled modules by (function, version), so a call skips the blob read
    /// and compile; cleared at `MAX_CACHED_MODULES`, evicted versions dropped
    /// on deploy. Filled by calls (copy on write: only on a compile).
    modules: ArcSwap<ModuleCache>,
    /// Functions resolved once (record, version, module, environment), by
    /// name and requested version; see [`Invoker::cached`].
    resolved: ArcSwap<ResolvedCache>,
    /// The embedded store's count of writes to function records (any
    /// namespace's); None on etcd, where no resolution is kept.
    fn_writes: Option<Arc<AtomicU64>>,
    /// Invocations prepared, queued or running (and triggers being claimed):
    /// while any is, the supervisor does not passivate ([`Busy`]).
    busy: std::sync::atomic::AtomicUsize,
    /// This namespace's invocation and error counters, looked up by label once.
    counters: std::sync::OnceLock<(NsCounter, NsCounter)>,
    /// This namespace's records queued for the writer and written by it.
    records: Arc<RecordProgress>,
}

impl FunctionsService {
    /// The invoker of one namespace (its supervisor owns the state it reads:
    /// [`FnOwner`]).
    pub fn invoker(&self, ns: &str) -> Invoker {
        Invoker {
            ns: ns.into(),
            svc: self.clone(),
            st: Arc::new(NsState {
                snapshot: Default::default(),
                modules: Default::default(),
                resolved: Default::default(),
                fn_writes: self
                    .0
                    .store
                    .as_sled()
                    .map(|s| s.write_counter(crate::functions::model::FN_RECORDS)),
                busy: Default::default(),
                counters: Default::default(),
                records: self.record_progress(ns),
            }),
        }
    }
}

/// What a change made through the supervisor did, for it to apply to the
/// state it owns ([`FnOwner::apply`]) once the store has it.
pub enum Change {
    /// A deploy: the new version is current, its module compiled.
    Deployed {
        /// The function.
        name: String,
        /// The new version.
        version: u64,
        /// Its meta (its triggers).
        meta: VersionMeta,
        /// Its module, kept for the calls.
        module: Arc<CompiledModule>,
        /// The versions past `MAX_VERSIONS` that went.
        evicted: Vec<u64>,
    },
    /// A function deleted.
    Deleted(String),
    /// A secret set or deleted: every resolution may have changed.
    Secrets,
    /// Every function's triggers read again (start, import).
    Reloaded(Vec<TriggerEntry>),
}

/// A namespace's function state, owned by its supervisor: deploys, deletes,
/// secrets and imports are its messages, handled one at a time; after each
/// it publishes a new [`Snapshot`] that the calls read lock-free.
pub struct FnOwner {
    /// The namespace's invoker: what calls and triggers go through.
    inv: Invoker,
    /// The quota limits from the namespace's record.
    limits: Option<crate::quota::Limits>,
    /// Every function's triggers.
    triggers: Arc<Vec<TriggerEntry>>,
    /// The guests' publish path, while the supervisor is attached.
    publisher: Option<Publisher>,
    /// Moves on every change; see [`Snapshot::generation`].
    generation: u64,
    /// Where this namespace's cron schedules go whenever its triggers change:
    /// the node's one cron timer (`NodeSupervisor`), set on members only.
    cron_sink: Option<actix::Recipient<super::cron::CronSet>>,
}

impl FnOwner {
    /// Takes over the state of `inv`'s namespace (as last published: none
    /// for a new invoker).
    pub fn new(inv: Invoker) -> Self {
        let now = inv.st.snapshot.load_full();
        FnOwner {
            limits: now.limits,
            triggers: now.triggers.clone(),
            publisher: now.publisher.clone(),
            generation: now.generation,
            cron_sink: None,
            inv,
        }
    }

    /// The invoker (a handle on the shared state: clone it for a future).
    pub fn invoker(&self) -> &Invoker {
        &self.inv
    }

    /// Publishes the state as it is now: the next call reads it.
    fn publish(&self) {
        self.inv.st.snapshot.store(Arc::new(Snapshot {
            limits: self.limits,
            triggers: self.triggers.clone(),
            publisher: self.publisher.clone(),
            generation: self.generation,
        }));
    }

    /// Sets the namespace's quota limits (on every record load or change).
    pub fn set_limits(&mut self, limits: crate::quota::Limits) {
        self.limits = Some(limits);
        self.publish();
    }

    /// Gives the guests their publish path (the supervisor, at start).
    pub fn attach(&mut self, publisher: Publisher) {
        self.publisher = Some(publisher);
        self.publish();
    }

    /// Lets go of the publish path and the cron timer (the supervisor stops
    /// for good): a guest's publish fails from then on.
    pub fn detach(&mut self) {
        self.publisher = None;
        self.cron_sink = None;
        self.publish();
    }

    /// Sends this namespace's cron schedules to `sink` now and after every
    /// change of its triggers (the node's cron timer; members only).
    pub fn schedule_crons_with(&mut self, sink: actix::Recipient<super::cron::CronSet>) {
        self.cron_sink = Some(sink);
        self.send_crons();
    }

    /// This namespace's cron schedules now: every (function, expression) of
    /// the functions' current versions, what the node's cron timer holds.
    pub fn crons(&self) -> Vec<super::cron::CronEntry> {
        self.triggers
            .iter()
            .flat_map(|e| {
                e.crons.iter().map(|(expr, s)| super::cron::CronEntry {
                    function: e.name.clone(),
                    expr: expr.clone(),
                    schedule: s.clone(),
                })
            })
            .collect()
    }

    /// Sends the cron schedules to the node's cron timer, when one is set.
    fn send_crons(&self) {
        if let Some(sink) = &self.cron_sink {
            sink.do_send(super::cron::CronSet {
                namespace: self.inv.ns.to_string(),
                entries: self.crons(),
            });
        }
    }

    /// Applies a change the store has (see [`Change`]) and publishes the
    /// state: every kept resolution is forgotten.
    pub fn apply(&mut self, change: Change) {
        self.generation += 1;
        self.inv.st.resolved.store(Default::default());
        let mut triggers_changed = true;
        match change {
            Change::Deployed {
                name,
                version,
                meta,
                module,
                evicted,
            } => {
                self.inv.st.modules.rcu(|m| {
                    let mut m = ModuleCache::clone(m);
                    for v in &evicted {
                        m.remove(&(name.clone(), *v));
                    }
                    if m.len() >= MAX_CACHED_MODULES {
                        m.clear();
                    }
                    m.insert((name.clone(), version), module.clone());
                    m
                });
                self.set_triggers(&name, Some(&meta));
            }
            Change::Deleted(name) => {
                self.inv.st.modules.rcu(|m| {
                    let mut m = ModuleCache::clone(m);
                    m.retain(|(n, _), _| *n != name);
                    m
                });
                self.set_triggers(&name, None);
            }
            Change::Secrets => triggers_changed = false,
            Change::Reloaded(all) => self.triggers = Arc::new(all),
        }
        self.publish();
        if triggers_changed {
            self.send_crons();
        }
    }

    /// Replaces the triggers of `name` with those of `meta` (None: none).
    fn set_triggers(&mut self, name: &str, meta: Option<&VersionMeta>) {
        let t = Arc::make_mut(&mut self.triggers);
        t.retain(|e| e.name != name);
        t.extend(meta.and_then(|m| Invoker::trigger_entry(name, m)));
    }
}

/// What a deploy writes, planned over the function's record as read.
struct DeployPlan {
    /// The function's record as read (None: a new function); the write
    /// lands only if it is still this.
    old_raw: Option<Vec<u8>>,
    /// The version meta and record puts, the evicted versions' deletes.
    ops: Vec<BatchOp>,
    /// The new version.
    version: u64,
    /// Its meta.
    meta: VersionMeta,
    /// The versions past `MAX_VERSIONS` that go.
    evicted: Vec<u64>,
    /// What it changes of `functions` and `module_bytes`.
    deltas: [(Resource, i64); 2],
}

/// One namespace's invoker: runs only that namespace's functions.
#[derive(Clone)]
pub struct Invoker {
    /// The namespace this invoker serves; every store key it builds is under it.
    ns: Arc<str>,
    /// The shared functions service: store, engine, secrets, metrics, record queue.
    svc: FunctionsService,
    /// This namespace's state, shared by every clone of the invoker.
    st: Arc<NsState>,
}

/// Resolved functions kept between calls, valid while the snapshot's
/// generation is `generation` (a change through the supervisor moves it):
/// a resolution that began under an older generation is not kept.
#[derive(Clone, Default)]
struct ResolvedCache {
    /// The snapshot's generation these were kept under.
    generation: u64,
    /// Kept resolutions by (function, requested version or None), at most
    /// `MAX_CACHED_RESOLVED` (see [`Invoker::cached`]).
    map: HashMap<(String, Option<u64>), Arc<Kept>>,
}

/// A kept resolution, with the store's count of function-record writes when
/// its record was last read.
struct Kept {
    /// The resolution.
    r: Arc<Resolved>,
    /// The write count of its last check; moved up by a check that found the
    /// record unchanged.
    stamp: AtomicU64,
}

/// Resolutions kept per namespace before the cache is cleared.
const MAX_CACHED_RESOLVED: usize = 256;

/// A resolved function: record, version, module, environment.
struct Resolved {
    /// The function record's stored bytes, compared on every use of a cached
    /// resolution (any change to the record, a delete included, misses).
    record_bytes: Vec<u8>,
    /// The parsed function record; gives the call's public flag.
    record: FunctionRecord,
    /// The resolved version's settings: limits, environment, triggers.
    meta: VersionMeta,
    /// The version's compiled module.
    module: Arc<CompiledModule>,
    /// Environment the guest gets: the version's variables with the opened secrets over them.
    env: Vec<(String, String)>,
}

/// An invocation ready to run (the module resolved, the call built).
pub struct Prepared {
    /// The invoker the call belongs to: its metrics and invocation record queue.
    inv: Invoker,
    /// The compiled module to run.
    module: Arc<CompiledModule>,
    /// The built call: input, environment, limits and the caller JSON.
    call: Invocation,
    /// Host imports for this call (KV, publish), carrying the trigger depth.
    host: Arc<dyn HostApi>,
    /// The caller's request id, written to the invocation record and the reply.
    request_id: String,
    /// The call's W3C trace id (hex), written to the invocation record.
    trace_id: String,
    /// What caused the call, recorded in the invocation record.
    trigger: Trigger,
    /// The version that will run.
    pub version: u64,
    /// Whether the function is public.
    pub is_public: bool,
}

#[cfg(test)]
impl Prepared {
    /// The environment the guest will get.
    pub(crate) fn env(&self) -> &[(String, String)] {
        &self.call.env
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

    /// What the supervisor last published (one atomic load, no lock).
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.st.snapshot.load_full()
    }

    /// The namespace's quota limits; the node's defaults until the supervisor set them.
    pub(crate) fn limits(&self) -> crate::quota::Limits {
        self.st
            .snapshot
            .load()
            .limits
            .unwrap_or_else(|| crate::quota::Limits::of(&Default::default(), &Default::default()))
    }

    /// Invocations of this namespace prepared, queued or running now.
    pub fn busy(&self) -> usize {
        self.st.busy.load(std::sync::atomic::Ordering::Acquire)
    }

    fn record(&self, rec: InvocationRecord) {
        let queued = QueuedRecord {
            prefix: log_prefix(&self.ns, &rec.function),
            record: rec,
            progress: self.st.records.clone(),
        };
        if self.svc.0.records.try_send(queued).is_err() {
            self.svc.0.metrics.invocation_records_dropped.inc();
        } else {
            self.st
                .records
                .queued
                .fetch_add(1, std::sync::atomic::Ordering::Release);
        }
    }

    /// Deploys a compiled module as the function's next version: the blob
    /// first, then version and record in one atomic batch, so a crash leaves
    /// the function at its old version or its new one. Only the namespace's
    /// supervisor calls it, one change at a time (so two deploys cannot both
    /// read the same old record and write the same version number), and
    /// applies the [`Change`] it returns.
    pub async fn deploy(
        &self,
        req: DeployRequest,
        module: Arc<CompiledModule>,
    ) -> FnResult<(Deployed, Change)> {
        let store = self.store();
        let sha = module.sha256_hex();
        let key = fn_key(&self.ns, &req.name);
        let limits = self.limits();
        crate::quota::ensure_usage(store, &self.ns, Group::Functions).await?;
        let ukey = usage_key(&self.ns, Group::Functions);
        // Refused before the module is stored when it cannot fit (the exact
        // check is the guarded change below), so a namespace at its quota
        // leaves no blobs behind.
        {
            let planned = self.plan_deploy(&req, &sha).await?;
            let mut u = Usage::decode(store.get(&ukey).await?.as_deref()).unwrap_or_default();
            u.apply(&limits, &planned.deltas)
                .map_err(FnError::Refused)?;
        }
        // Pinned before it is looked for, until the record naming it is
        // written: a blob sweep between the two would delete it
        // (`storage/blob_ledger.rs`).
        let pins = crate::storage::blob_ledger::pin(store, [sha.as_str()]).await?;
        let blob = blob_key(&sha);
        if store.get(&blob).await?.is_none() {
            store.put(&blob, &req.wasm).await?;
        }
        // Counted against `functions` and `module_bytes` in the same guarded
        // change as the record; read again if another node changed the
        // record meanwhile (its evicted versions would differ).
        let (version, meta, evicted) = loop {
            let DeployPlan {
                old_raw,
                ops,
                version,
                meta,
                evicted,
                deltas,
            } = self.plan_deploy(&req, &sha).await?;
            let keys = [key.clone(), ukey.clone()];
            let r = store
                .transact(&keys, None, |vals| {
                    if vals[0] != old_raw {
                        return Err(None);
                    }
                    let mut u = Usage::decode(vals[1].as_deref()).unwrap_or_default();
                    u.apply(&limits, &deltas).map_err(Some)?;
                    let mut all = ops.clone();
                    all.push(BatchOp::Put(ukey.clone(), u.encode()));
                    Ok((all, ()))
                })
                .await?;
            match r {
                Some(Ok(())) => break (version, meta, evicted),
                Some(Err(Some(refused))) => return Err(FnError::Refused(refused)),
                Some(Err(None)) | None => continue,
            }
        };
        pins.release().await;
        tracing::info!(namespace = %self.ns, function = %req.name, version, "Function deployed.");
        let deployed = Deployed {
            name: req.name.clone(),
            version,
            sha256: sha,
            size_bytes: meta.size_bytes,
            is_public: req.is_public,
            created_at: meta.created_at,
        };
        let change = Change::Deployed {
            name: req.name,
            version,
            meta,
            module,
            evicted,
        };
        Ok((deployed, change))
    }

    /// What a deploy of `req` would write over the function's current
    /// record, and what it changes of the namespace's usage.
    async fn plan_deploy(&self, req: &DeployRequest, sha: &str) -> FnResult<DeployPlan> {
        let store = self.store();
        let old_raw = store.get(&fn_key(&self.ns, &req.name)).await?;
        let old: Option<FunctionRecord> = old_raw
            .as_deref()
            .and_then(|b| serde_json::from_slice(b).ok());
        let (ops, version, meta, evicted) = self.deploy_ops(req, sha, old.as_ref());
        let mut evicted_bytes = 0u64;
        for v in &evicted {
            if let Some(m) = store
                .get_json::<VersionMeta>(&ver_key(&self.ns, &req.name, *v))
                .await?
            {
                evicted_bytes += m.size_bytes as u64;
            }
        }
        let deltas = [
            (Resource::Functions, i64::from(old.is_none())),
            (
                Resource::ModuleBytes,
                req.wasm.len() as i64 - evicted_bytes as i64,
            ),
        ];
        Ok(DeployPlan {
            old_raw,
            ops,
            version,
            meta,
            evicted,
            deltas,
        })
    }

    /// The writes of a deploy over `old` (the function's record, if any):
    /// the new version's meta and the record, and the deletes of the
    /// versions past `MAX_VERSIONS`; with the new version, its meta and
    /// the evicted version numbers.
    fn deploy_ops(
        &self,
        req: &DeployRequest,
        sha: &str,
        old: Option<&FunctionRecord>,
    ) -> (Vec<BatchOp>, u64, VersionMeta, Vec<u64>) {
        let now = crate::util::now();
        let (version, mut versions, created_at) = match old {
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
            sha256: sha.to_string(),
            size_bytes: req.wasm.len(),
            memory_limit_mb: req.memory_limit_mb,
            timeout_seconds: req.timeout_seconds,
            env_vars: req.env_vars.clone(),
            pubsub_topics: req.pubsub_topics.clone(),
            cron: req.cron.clone(),
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
            fn_key(&self.ns, &req.name),
            serde_json::to_vec(&record).expect("serializable"),
        ));
        (ops, version, meta, evicted)
    }

    /// One page of the namespace's functions, by name: those named strictly
    /// after `after` (None: from the first), at most `limit`, and the name
    /// the next page resumes after (None on the last page).
    pub async fn list(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> FnResult<(Vec<FunctionRecord>, Option<Vec<u8>>)> {
        let prefix = fn_prefix(&self.ns);
        let after = after.map(|a| [prefix.as_slice(), a].concat());
        let (rows, last) = self
            .store()
            .scan_page(&prefix, after.as_deref(), limit)
            .await?;
        let list = rows
            .into_iter()
            .filter_map(|(_, v)| serde_json::from_slice(&v).ok())
            .collect();
        Ok((list, last.map(|k| k[prefix.len()..].to_vec())))
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

    /// Deletes a function with its versions and records (its module blobs
    /// are shared: the blob sweep deletes those no record names any more,
    /// `storage/blob_ledger.rs`), giving back its `functions` and `module_bytes` quota in the
    /// same guarded change.
    /// As [`Invoker::deploy`], through the supervisor only.
    pub async fn delete(&self, name: &str) -> FnResult<Change> {
        self.record_of(name).await?;
        let store = self.store();
        let key = fn_key(&self.ns, name);
        crate::quota::ensure_usage(store, &self.ns, Group::Functions).await?;
        let ukey = usage_key(&self.ns, Group::Functions);
        let limits = self.limits();
        loop {
            let old_raw = store.get(&key).await?;
            if old_raw.is_none() {
                return Err(FnError::NotFound(format!("no function {name:?}")));
            }
            let mut ops = vec![BatchOp::Delete(key.clone())];
            let mut bytes = 0u64;
            let ver_prefix = format!("fnver/{}/{name}/", self.ns).into_bytes();
            for (k, v) in store.scan_all(&ver_prefix).await? {
                if let Ok(m) = serde_json::from_slice::<VersionMeta>(&v) {
                    bytes += m.size_bytes as u64;
                }
                ops.push(BatchOp::Delete(k));
            }
            for (k, _) in store.scan_all(&log_prefix(&self.ns, name)).await? {
                ops.push(BatchOp::Delete(k));
            }
            let deltas = [
                (Resource::Functions, -1),
                (Resource::ModuleBytes, -(bytes as i64)),
            ];
            // The logs may be more than one transaction holds: they go first.
            let (records, logs): (Vec<_>, Vec<_>) = ops.into_iter().partition(|op| match op {
                BatchOp::Delete(k) | BatchOp::Put(k, _) => {
                    !k.starts_with(&log_prefix(&self.ns, name))
                }
            });
            let keys = [key.clone(), ukey.clone()];
            let r = store
                .transact(&keys, None, |vals| {
                    if vals[0] != old_raw {
                        return Err(());
                    }
                    let mut u = Usage::decode(vals[1].as_deref()).unwrap_or_default();
                    let _ = u.apply(&limits, &deltas);
                    let mut all = records.clone();
                    all.push(BatchOp::Put(ukey.clone(), u.encode()));
                    Ok((all, ()))
                })
                .await?;
            if let Some(Ok(())) = r {
                store.apply_batch(logs).await?;
                break;
            }
        }
        tracing::info!(namespace = %self.ns, function = %name, "Function deleted.");
        Ok(Change::Deleted(name.to_string()))
    }

    /// The newest invocation records of a function, newest first.
    pub async fn logs(&self, name: &str, limit: usize) -> FnResult<Vec<InvocationRecord>> {
        self.record_of(name).await?;
        // Read your writes: a call answered before this request is in its
        // log, not 20 ms later (the writer lingers to batch records). The
        // records of this namespace queued so far on this node are waited
        // for, boundedly; another namespace's backlog is not.
        let progress = &self.st.records;
        let queued = progress.queued.load(std::sync::atomic::Ordering::Acquire);
        let mut written = progress.written.subscribe();
        let _ = tokio::time::timeout(
            service::RECORD_FLUSH_WAIT,
            written.wait_for(|w| *w >= queued),
        )
        .await;
        let limit = limit.clamp(1, MAX_LOGS);
        let rows = self.store().scan_all(&log_prefix(&self.ns, name)).await?;
        // Entries sort by their newest record, and a record finished late may
        // sit in a newer entry than one that started after it: read one entry
        // past `limit` records, then order the records by their own time.
        let mut out = Vec::new();
        let mut past_limit = false;
        for (_, v) in rows.iter().rev() {
            out.extend(decode_log_entry(v));
            if past_limit {
                break;
            }
            past_limit = out.len() >= limit;
        }
        out.sort_by(|a, b| (b.timestamp_ms, &b.request_id).cmp(&(a.timestamp_ms, &a.request_id)));
        out.truncate(limit);
        Ok(out)
    }

    /// Seals and stores a secret (through the supervisor, which applies the change).
    pub async fn put_secret(&self, key: &str, value: &str) -> FnResult<Change> {
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
        Ok(Change::Secrets)
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

    /// Deletes a secret (through the supervisor, which applies the change).
    pub async fn delete_secret(&self, key: &str) -> FnResult<Change> {
        if !valid_secret_name(key) || !self.store().delete(&secret_key(&self.ns, key)).await? {
            return Err(FnError::NotFound(format!("no secret {key:?}")));
        }
        Ok(Change::Secrets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::functions::model::{FN_RECORDS, log_key, ver_key};
    use crate::metrics::Metrics;
    use crate::storage::BatchOp;
    use crate::wasm::WasmEngine;
    use std::sync::atomic::Ordering;

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
            trace: None,
        };
        inv.prepare(name.into(), None, Vec::new(), caller, Trigger::Http, 0)
            .await
    }

    /// A node's functions service on a fresh sled store, and namespace
    /// `ns`'s invoker with the no-op module deployed as `f` (version 1).
    async fn deployed_f() -> (tempfile::TempDir, Store, Invoker, Arc<CompiledModule>) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sled(dir.path()).unwrap();
        let (store, inv, module) = deployed_f_on(&dir, store).await;
        (dir, store, inv, module)
    }

    /// As [`deployed_f`], on `store` (sled or etcd), caches under `dir`.
    pub(super) async fn deployed_f_on(
        dir: &tempfile::TempDir,
        store: Store,
    ) -> (Store, Invoker, Arc<CompiledModule>) {
        let engine =
            WasmEngine::new(crate::wasm::WasmConfig::default(), dir.path().join("cache")).unwrap();
        let svc = FunctionsService::start(engine, store.clone(), Metrics::new(), &[7u8; 32]);
        let inv = svc.invoker("ns");
        let module = svc.compile("ns", NOOP.to_vec()).await.unwrap();
        let (_, c) = inv.deploy(request("f"), module.clone()).await.unwrap();
        owned(&inv, c);
        (store, inv, module)
    }

    /// Applies a change as the namespace's supervisor does.
    fn owned(inv: &Invoker, c: Change) {
        FnOwner::new(inv.clone()).apply(c);
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
        let (_dir, store, inv, module) = deployed_f().await;

        owned(&inv, inv.put_secret("TOKEN", "a").await.unwrap());
        let p = prepared(&inv, "f").await.unwrap();
        assert_eq!((p.version, env_of(&p, "TOKEN").as_deref()), (1, Some("a")));
        assert_eq!(env_of(&p, "MODE").as_deref(), Some("plain"));
        assert_eq!(inv.st.resolved.load().map.len(), 1, "kept");
        assert!(inv.cached("f", None).await.unwrap().is_some(), "used");

        owned(&inv, inv.put_secret("TOKEN", "b").await.unwrap());
        let p = prepared(&inv, "f").await.unwrap();
        assert_eq!(env_of(&p, "TOKEN").as_deref(), Some("b"));

        let (_, c) = inv.deploy(request("f"), module.clone()).await.unwrap();
        owned(&inv, c);
        assert_eq!(prepared(&inv, "f").await.unwrap().version, 2);

        owned(&inv, inv.delete_secret("TOKEN").await.unwrap());
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

        owned(&inv, inv.delete("f").await.unwrap());
        assert!(matches!(
            prepared(&inv, "f").await,
            Err(FnError::NotFound(_))
        ));
    }

    /// A kept resolution carries the store's function-record write count of
    /// its last check: writes elsewhere (KV, versions, records) leave it as
    /// it is, so calls use it without a read; a write to another function's
    /// record moves the count, and the next call reads f's record once,
    /// finds it unchanged and stamps it with the new count.
    #[actix_rt::test]
    async fn a_kept_resolution_is_checked_only_after_a_function_record_write() {
        let (_dir, store, inv, _module) = deployed_f().await;
        let writes = store.as_sled().unwrap().write_counter(FN_RECORDS);
        let stamp = || {
            inv.st
                .resolved
                .load()
                .map
                .get(&("f".to_string(), None))
                .map(|k| k.stamp.load(Ordering::Acquire))
        };
        prepared(&inv, "f").await.unwrap();
        let first = stamp().expect("kept");
        assert_eq!(first, writes.load(Ordering::Acquire));

        store.put(b"kv/ns/a", b"1").await.unwrap();
        store.put(&ver_key("ns", "f", 9), b"{}").await.unwrap();
        store
            .apply_buffered(vec![BatchOp::Put(b"log/ns/f/1".to_vec(), b"[]".to_vec())])
            .await
            .unwrap();
        assert_eq!(
            writes.load(Ordering::Acquire),
            first,
            "no function record written"
        );
        assert!(inv.cached("f", None).await.unwrap().is_some());

        store.put(&fn_key("ns", "g"), b"{}").await.unwrap();
        let moved = writes.load(Ordering::Acquire);
        assert!(moved > first, "another record's write counts");
        assert!(
            inv.cached("f", None).await.unwrap().is_some(),
            "f unchanged: still used"
        );
        assert_eq!(stamp(), Some(moved), "stamped with the count of its check");

        store.delete(&fn_key("ns", "f")).await.unwrap();
        assert!(
            inv.cached("f", None).await.unwrap().is_none(),
            "f deleted: dropped"
        );
        assert!(stamp().is_none());
    }

    fn rec(name: &str, ts: u64, id: &str) -> InvocationRecord {
        InvocationRecord {
            request_id: id.into(),
            function: name.into(),
            version: 1,
            trigger: "http".into(),
            status: "ok".into(),
            error: None,
            duration_ms: 0,
            timestamp_ms: ts,
            logs: Vec::new(),
            trace_id: None,
        }
    }

    fn queued(ns: &str, r: &InvocationRecord) -> QueuedRecord {
        QueuedRecord {
            prefix: log_prefix(ns, &r.function),
            record: r.clone(),
            progress: Default::default(),
        }
    }

    /// Of a batch, only each function's newest records up to the cap are
    /// written, in arrival order; a function under the cap keeps them all.
    #[test]
    fn a_batch_keeps_each_functions_newest_records() {
        let mut buf: Vec<QueuedRecord> = (0..7u64)
            .map(|i| {
                let f = if i % 2 == 0 { "busy" } else { "quiet" };
                queued("ns", &rec(f, i, &format!("r{i}")))
            })
            .collect();
        buf.push(queued("other", &rec("busy", 9, "r9")));
        service::keep_newest(&mut buf, 2);
        let left: Vec<String> = buf.iter().map(|q| q.record.request_id.clone()).collect();
        // busy: r0 r2 r4 r6 -> r4 r6; quiet: r1 r3 r5 -> r3 r5; other ns: r9.
        assert_eq!(left, ["r3", "r4", "r5", "r6", "r9"]);
    }

    /// The trim's count of an entry's records is what `logs` would decode
    /// from it: a grouped entry, a single-record one, an array holding
    /// something that is not a record, and bytes that are not JSON.
    #[test]
    fn an_entrys_count_is_its_decoded_records() {
        let grouped = service::group_records(
            [rec("a", 1, "r1"), rec("a", 2, "r2"), rec("a", 3, "r3")]
                .iter()
                .map(|r| queued("ns", r)),
        );
        let single = serde_json::to_vec(&rec("a", 4, "r4")).unwrap();
        let mixed = br#"[{"request_id":"x"},{"not":"a record"}]"#.to_vec();
        for (v, n) in [
            (grouped[0].1.clone(), 3),
            (single, 1),
            (mixed, 0),
            (b"not json".to_vec(), 0),
            (b"[]".to_vec(), 0),
        ] {
            assert_eq!(
                decode_log_entry(&v).len(),
                n,
                "{}",
                String::from_utf8_lossy(&v)
            );
            assert_eq!(count_log_entry(&v), n, "{}", String::from_utf8_lossy(&v));
        }
    }

    /// One batch's records become one entry per function, under the key of
    /// its newest record, and each entry decodes back to its records in order.
    #[test]
    fn a_batch_is_one_entry_per_function() {
        let (a1, b1, a2, a3) = (
            rec("a", 10, "r1"),
            rec("b", 11, "r2"),
            rec("a", 14, "r4"),
            rec("a", 12, "r3"),
        );
        let entries =
            service::group_records([&a1, &b1, &a2, &a3].into_iter().map(|r| queued("ns", r)));
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].0, log_key("ns", "a", 14, "r4"), "newest key");
        assert_eq!(decode_log_entry(&entries[0].1), vec![a1.clone(), a2, a3]);
        assert_eq!(entries[1].0, log_key("ns", "b", 11, "r2"));
        assert_eq!(decode_log_entry(&entries[1].1), vec![b1]);
        assert!(decode_log_entry(b"not json").is_empty());
        // The same function name in another namespace never shares an entry.
        let other = rec("a", 15, "r5");
        let entries =
            service::group_records([queued("ns", &a1), queued("other", &other)].into_iter());
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[1].0, log_key("other", "a", 15, "r5"));
        assert_eq!(decode_log_entry(&entries[1].1), vec![other]);
    }

    /// A function's records stay in entries of bounded size.
    #[test]
    fn entries_are_bounded_in_size() {
        let mut big = rec("a", 1, "x");
        big.logs = vec![LogEntry {
            level: "info".into(),
            message: "y".repeat(16 << 10),
        }];
        let n = 3 * RECORD_ENTRY_BYTES / (16 << 10);
        let entries = service::group_records((0..n).map(|i| {
            let mut r = big.clone();
            r.request_id = format!("r{i:04}");
            queued("ns", &r)
        }));
        assert!(entries.len() >= 3, "{} entries", entries.len());
        assert!(
            entries
                .iter()
                .all(|(_, v)| v.len() <= RECORD_ENTRY_BYTES + (17 << 10))
        );
        let total: usize = entries.iter().map(|(_, v)| decode_log_entry(v).len()).sum();
        assert_eq!(total, n);
    }

    /// Store batches stay within etcd's limits: at most 64 entries and about
    /// 1 MiB each, an entry larger than that alone, every entry once, in order.
    #[test]
    fn store_batches_are_bounded() {
        let entry = |i: usize, n: usize| (format!("k{i:04}").into_bytes(), vec![b'x'; n]);
        let mut entries: Vec<_> = (0..200).map(|i| entry(i, 10)).collect();
        entries.extend((200..206).map(|i| entry(i, 300 << 10)));
        entries.push(entry(206, 2 << 20));
        entries.push(entry(207, 10));
        let batches = service::store_batches(entries);
        let mut keys = Vec::new();
        for b in &batches {
            assert!(!b.is_empty() && b.len() <= RECORD_ENTRIES_PER_BATCH);
            let size: usize = b
                .iter()
                .map(|op| match op {
                    BatchOp::Put(k, v) => k.len() + v.len(),
                    BatchOp::Delete(k) => k.len(),
                })
                .sum();
            assert!(
                b.len() == 1 || size <= RECORD_BATCH_BYTES,
                "{size} bytes in {}",
                b.len()
            );
            keys.extend(b.iter().map(|op| match op {
                BatchOp::Put(k, _) | BatchOp::Delete(k) => k.clone(),
            }));
        }
        let want: Vec<_> = (0..208).map(|i| format!("k{i:04}").into_bytes()).collect();
        assert_eq!(keys, want);
        assert!(
            batches
                .iter()
                .any(|b| b.len() == 1 && matches!(&b[0], BatchOp::Put(_, v) if v.len() == 2 << 20))
        );
    }

    /// `logs` reads grouped entries and entries of one record (as written
    /// before grouping) alike, newest first by the records' own time.
    #[actix_rt::test]
    async fn logs_read_grouped_and_single_entries_newest_first() {
        let (_dir, store, inv, _) = deployed_f().await;
        // An old single-record entry, then a grouped one whose newest record
        // finished after a record that started later (r3 sits in the older entry).
        let old = rec("f", 5, "r0");
        store
            .put(
                &log_key("ns", "f", 5, "r0"),
                &serde_json::to_vec(&old).unwrap(),
            )
            .await
            .unwrap();
        let first = [rec("f", 20, "r3"), rec("f", 7, "r1")];
        let second = [rec("f", 9, "r2"), rec("f", 30, "r4")];
        for batch in [&first, &second] {
            for (k, v) in service::group_records(batch.iter().map(|r| queued("ns", r))) {
                store.put(&k, &v).await.unwrap();
            }
        }
        let ids =
            |v: Vec<InvocationRecord>| v.into_iter().map(|r| r.request_id).collect::<Vec<_>>();
        assert_eq!(
            ids(inv.logs("f", 100).await.unwrap()),
            ["r4", "r3", "r2", "r1", "r0"]
        );
        assert_eq!(ids(inv.logs("f", 2).await.unwrap()), ["r4", "r3"]);
    }

    /// Records stored for function `name` of namespace `ns`.
    async fn stored_records(store: &Store, name: &str) -> usize {
        store
            .scan_all(&log_prefix("ns", name))
            .await
            .unwrap()
            .iter()
            .map(|(_, v)| decode_log_entry(v).len())
            .sum()
    }

    /// Trimming keeps the entries that hold the newest `MAX_LOGS` records and
    /// one entry more, deletes the older ones, and leaves other functions'
    /// logs alone; `logs` answers the same after it as before.
    #[actix_rt::test]
    async fn trimming_keeps_the_newest_records_and_one_entry_more() {
        let (_dir, store, inv, _) = deployed_f().await;
        // 30 entries of 10 records each, oldest first.
        for e in 0..30u64 {
            let batch: Vec<_> = (0..10u64)
                .map(|i| rec("f", 1000 + e * 10 + i, &format!("r{:03}", e * 10 + i)))
                .collect();
            for (k, v) in service::group_records(batch.iter().map(|r| queued("ns", r))) {
                store.put(&k, &v).await.unwrap();
            }
        }
        // Another function, one whose name starts with f's, and f in another
        // namespace: none of them is f's log.
        for (ns, r) in [
            ("ns", rec("g", 5, "g0")),
            ("ns", rec("f2", 5, "h0")),
            ("other", rec("f", 5, "o0")),
        ] {
            for (k, v) in service::group_records(std::iter::once(queued(ns, &r))) {
                store.put(&k, &v).await.unwrap();
            }
        }
        let before = inv.logs("f", MAX_LOGS).await.unwrap();
        assert_eq!(before.len(), MAX_LOGS);

        let deleted = service::trim_records(&store, &log_prefix("ns", "f"))
            .await
            .unwrap();
        assert_eq!(deleted, 30 - (MAX_LOGS / 10 + 1));
        let left = store.scan_all(&log_prefix("ns", "f")).await.unwrap();
        assert_eq!(left.len(), MAX_LOGS / 10 + 1);
        assert_eq!(stored_records(&store, "f").await, MAX_LOGS + 10);
        assert_eq!(inv.logs("f", MAX_LOGS).await.unwrap(), before);
        assert_eq!(stored_records(&store, "g").await, 1);
        assert_eq!(stored_records(&store, "f2").await, 1);
        let in_other = store.scan_all(&log_prefix("other", "f")).await.unwrap();
        assert_eq!(in_other.len(), 1);
        // A log already short enough is left as it is.
        assert_eq!(
            service::trim_records(&store, &log_prefix("ns", "f"))
                .await
                .unwrap(),
            0
        );
    }

    /// `logs` waits for its own namespace's records only: a neighbour's
    /// backlog in the shared writer (records queued, not yet written) does
    /// not hold it up (with one node-wide count it waited the whole
    /// `RECORD_FLUSH_WAIT`, and the timeout below fired first), and its own
    /// record is read back, counted written in its own progress.
    #[actix_rt::test]
    async fn logs_wait_for_their_own_namespaces_records_only() {
        use std::sync::atomic::Ordering;
        let (_dir, _store, inv, _) = deployed_f().await;
        let other = inv.svc.invoker("other");
        assert!(!Arc::ptr_eq(&inv.st.records, &other.st.records));
        // The neighbour has a thousand records the writer has not written.
        other.st.records.queued.fetch_add(1_000, Ordering::Release);
        inv.record(rec("f", 42, "mine"));
        assert_eq!(inv.st.records.queued.load(Ordering::Acquire), 1);
        let logs = tokio::time::timeout(service::RECORD_FLUSH_WAIT, inv.logs("f", 10))
            .await
            .expect("held up by the neighbour's backlog")
            .unwrap();
        let ids: Vec<&str> = logs.iter().map(|r| r.request_id.as_str()).collect();
        assert_eq!(ids, ["mine"]);
        assert_eq!(*inv.st.records.written.borrow(), 1);
        assert_eq!(*other.st.records.written.borrow(), 0);
    }

    /// An invoker recreated for a namespace (its supervisor restarted) takes
    /// over the records its predecessor queued: they are counted in its
    /// progress, and its `logs` waits for them and reads them back (with a
    /// fresh count it answered before the writer's linger was over).
    #[actix_rt::test]
    async fn a_recreated_invoker_waits_for_its_predecessors_records() {
        use std::sync::atomic::Ordering;
        let (_dir, _store, inv, _) = deployed_f().await;
        inv.record(rec("f", 42, "before-restart"));
        let svc = inv.svc.clone();
        drop(inv);
        let again = svc.invoker("ns");
        assert_eq!(again.st.records.queued.load(Ordering::Acquire), 1);
        let logs = again.logs("f", 10).await.unwrap();
        let ids: Vec<&str> = logs.iter().map(|r| r.request_id.as_str()).collect();
        assert_eq!(ids, ["before-restart"]);
        assert_eq!(*again.st.records.written.borrow(), 1);
        // Another namespace's invoker has its own.
        assert!(!Arc::ptr_eq(
            &again.st.records,
            &svc.invoker("other").st.records
        ));
    }

    /// Sends 400 records of `f` in 8 waves of 50 (20 ms apart, so they land
    /// in many entries), spread over `writers` in turn; returns them in order.
    async fn send_400_in_waves(writers: &[&mpsc::Sender<QueuedRecord>]) -> Vec<InvocationRecord> {
        let mut all = Vec::new();
        for wave in 0..8u64 {
            for i in 0..50u64 {
                let n = wave * 50 + i;
                let r = rec("f", 10_000 + n, &format!("r{n:03}"));
                let tx = writers[n as usize % writers.len()];
                tx.send(queued("ns", &r)).await.unwrap();
                all.push(r);
            }
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
        all
    }

    /// The newest `MAX_LOGS` of `all` (sent oldest first), newest first: what
    /// `logs` must answer.
    fn newest(mut all: Vec<InvocationRecord>) -> Vec<InvocationRecord> {
        all.reverse();
        all.truncate(MAX_LOGS);
        all
    }

    /// The writer keeps a busy function's log bounded: after 400 records
    /// (in waves, so in many entries) at most twice `MAX_LOGS` are stored,
    /// and `logs` still returns the newest `MAX_LOGS`; a quiet function's
    /// records are all kept.
    #[actix_rt::test]
    async fn the_writer_keeps_a_busy_functions_log_bounded() {
        let (_dir, store, inv, _) = deployed_f().await;
        let (tx, rx) = mpsc::channel(RECORD_QUEUE);
        let writer = actix_rt::spawn(service::write_records(store.clone(), rx));
        let all = send_400_in_waves(&[&tx]).await;
        for i in 0..3u64 {
            tx.send(queued("ns", &rec("g", 5 + i, &format!("g{i}"))))
                .await
                .unwrap();
        }
        drop(tx);
        writer.await.unwrap();

        let stored = stored_records(&store, "f").await;
        assert!(
            (MAX_LOGS..=2 * MAX_LOGS).contains(&stored),
            "{stored} of 400 records stored"
        );
        assert_eq!(inv.logs("f", MAX_LOGS).await.unwrap(), newest(all));
        let quiet = stored_records(&store, "g").await;
        assert_eq!(quiet, 3);
    }

    /// On etcd, as in a cluster: two nodes' writers record calls of the same
    /// function at once, each trimming after its own `MAX_LOGS`. The log
    /// stays bounded (the newest `MAX_LOGS`, plus what each writer wrote
    /// since its last trim, plus the kept entries), and `logs` answers the
    /// newest `MAX_LOGS` of both nodes' records.
    #[cfg(feature = "cluster")]
    #[actix_rt::test]
    async fn two_nodes_writers_keep_a_functions_log_bounded_on_etcd() {
        let etcd = crate::storage::etcd_process::EtcdProcess::start();
        let cfg: crate::config::ClusterConfig = toml::from_str(&etcd.cluster_toml()).unwrap();
        let access = crate::storage::EtcdAccess::from_config(&cfg).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_etcd(&[etcd.url()], &access).await.unwrap();
        let (store, inv, _) = deployed_f_on(&dir, store).await;
        let other = Store::open_etcd(&[etcd.url()], &access).await.unwrap();
        let (tx_a, rx_a) = mpsc::channel(RECORD_QUEUE);
        let (tx_b, rx_b) = mpsc::channel(RECORD_QUEUE);
        let writer_a = actix_rt::spawn(service::write_records(store.clone(), rx_a));
        let writer_b = actix_rt::spawn(service::write_records(other, rx_b));
        let all = send_400_in_waves(&[&tx_a, &tx_b]).await;
        drop((tx_a, tx_b));
        writer_a.await.unwrap();
        writer_b.await.unwrap();

        let stored = stored_records(&store, "f").await;
        assert!(
            (MAX_LOGS..=3 * MAX_LOGS).contains(&stored),
            "{stored} of 400 records stored on etcd"
        );
        assert_eq!(inv.logs("f", MAX_LOGS).await.unwrap(), newest(all));
    }
}
