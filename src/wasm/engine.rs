//! The engine: one wasmtime `Engine` per node, compilation with the artifact
//! cache, and running one invocation in a fresh `Store`.

#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use wasmtime::{
    Config, Engine, Extern, ExternType, InstanceAllocationStrategy, InstancePre, Linker, Module,
    ModuleExport, OptLevel, PoolingAllocationConfig, Store, Trap,
};

use super::cache::ArtifactCache;
use super::error::{HostError, Result, WasmError};
use super::gate::CompileGate;
use super::host::{HostApi, HostState, ResolvedFunction, build_linker};
use super::limits::{
    DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT, MAX_DEPTH, MAX_INPUT_BYTES, MAX_MEMORY_MB,
    MAX_OUTPUT_BYTES, MAX_TABLE_ELEMENTS, MAX_WASM_STACK,
};
use super::pool::{Pool, PoolStats};
use super::shape::{ModuleLimits, check_shape};

/// The entry point of a WASI command module.
const ENTRY_POINT: &str = "_start";
/// Most pooled instance slots, whatever the worker count.
const MAX_POOL_SLOTS: usize = 1_000;
/// Spare threads of the pool (see `pool.rs`).
pub const SPARE_WORKERS: usize = 1;
/// Bytes of each pool slot's linear memory kept resident between calls.
const KEEP_RESIDENT_BYTES: usize = 1 << 20;
/// Epoch ticks a speculative run on the caller's thread may take before it
/// is stopped and run again on the pool: at least one whole tick (5 ms at
/// the default), at most two.
const HERE_BUDGET_TICKS: u64 = 2;
/// Long runs in a row after which a module's calls go to the pool.
const HERE_STRIKES: u32 = 3;
/// A run longer than this is long: a guest that takes it is work for the
/// pool (its fair share, its lower priority), not for a request thread
/// (about ten times a chain request's own CPU).
const HERE_MAX_RUN: Duration = Duration::from_micros(200);
/// Largest input run on the caller's thread (a run that must start again
/// keeps its input; larger calls go to the pool at once).
const HERE_MAX_INPUT: usize = 64 << 10;
/// The `meshgate` imports a module run on the caller's thread may use: they
/// neither wait nor act outside the store.
const HERE_IMPORTS: &[&str] = &["caller", "log"];

/// Settings of the [`WasmEngine`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WasmConfig {
    /// Worker threads running guests; default: the number of CPUs.
    pub workers: usize,
    /// Threads beside the workers that only start the call of a namespace
    /// with nothing running, at the request path's priority, when no worker
    /// is free (a quiet tenant beside a flood); default [`SPARE_WORKERS`].
    pub spare_workers: usize,
    /// Invocations that may wait for a worker, node-wide; default 256.
    pub queue: usize,
    /// Invocations of one namespace that may wait for a worker (its queue
    /// bound; past it `Busy`); default 64. Running ones do not count: a
    /// namespace alone may use every worker, several share them fairly.
    pub namespace_concurrency: usize,
    /// How long an invocation may wait for a worker before it is refused
    /// with `Busy`; default 3 s.
    pub queue_wait: Duration,
    /// Largest module accepted, in bytes; default 16 MiB.
    pub max_module_bytes: usize,
    /// Largest module accepted as WAT text, in bytes; default 4 MiB. Text
    /// costs far more to parse than its size (a 16 MiB text of empty
    /// functions took +1 GiB), and it is parsed inside the compile gate.
    pub max_wat_bytes: usize,
    /// Epoch tick, in milliseconds: the granularity of deadlines; default 5.
    pub epoch_tick_ms: u64,
    /// The workers' nice value (0 to 19; 0 leaves them at the request
    /// path's priority); default [`WORKER_NICE`](super::priority::WORKER_NICE).
    pub worker_nice: i32,
    /// What a module may declare, checked before it is compiled.
    pub module_limits: ModuleLimits,
    /// Compiles that may run at once, node-wide (at most one per namespace,
    /// see `gate.rs`); default 2.
    pub compile_concurrency: usize,
    /// How long a bounded compile may take, waiting for a slot included;
    /// default 10 s.
    pub compile_timeout: Duration,
}

impl WasmConfig {
    /// Threads that run guests: the workers (at least one) and the spare
    /// threads. wasmtime's slots are sized for this many, and `Pool` starts
    /// this many.
    pub fn pool_threads(&self) -> usize {
        self.workers.max(1) + self.spare_workers
    }
}

impl Default for WasmConfig {
    fn default() -> Self {
        Self {
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            spare_workers: SPARE_WORKERS,
            queue: 256,
            namespace_concurrency: 64,
            queue_wait: Duration::from_secs(3),
            max_module_bytes: 16 << 20,
            max_wat_bytes: 4 << 20,
            worker_nice: super::priority::WORKER_NICE,
            epoch_tick_ms: 5,
            module_limits: ModuleLimits::default(),
            compile_concurrency: 2,
            compile_timeout: Duration::from_secs(10),
        }
    }
}

/// One call of a function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// The namespace the function belongs to (the unit of the fair share).
    pub namespace: String,
    /// The function's name.
    pub function: String,
    /// The function's version.
    pub version: u64,
    /// The guest's stdin (at most 1 MiB).
    pub input: Vec<u8>,
    /// Environment variables (env vars and secrets).
    pub env: Vec<(String, String)>,
    /// Memory cap, in MiB (1 to 256).
    pub memory_limit_mb: u32,
    /// Wall-clock deadline, counted from when a worker starts the call.
    pub timeout: Duration,
    /// What the `caller` import returns.
    pub caller_json: Vec<u8>,
    /// Nesting depth: 0 for a top-level call.
    pub depth: u32,
}

impl Invocation {
    /// A top-level call with the default limits (64 MiB, 10 s), no env.
    pub fn new(namespace: impl Into<String>, function: impl Into<String>, input: Vec<u8>) -> Self {
        Self {
            namespace: namespace.into(),
            function: function.into(),
            version: 1,
            input,
            env: Vec::new(),
            memory_limit_mb: DEFAULT_MEMORY_MB,
            timeout: DEFAULT_TIMEOUT,
            caller_json: b"{}".to_vec(),
            depth: 0,
        }
    }
}

/// What a successful invocation produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InvokeOutput {
    /// What the guest wrote to stdout.
    pub stdout: Vec<u8>,
    /// stderr lines and `log` calls, in order (nested calls' included).
    pub logs: Vec<LogLine>,
    /// Time from the start of the store to the end of the guest.
    pub duration: Duration,
    /// Publishes made, nested calls' included.
    pub publishes: u32,
}

/// One log line of a guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    /// `debug`, `info`, `warn` or `error`.
    pub level: String,
    /// The line, lossily decoded as UTF-8, at most 16 KiB.
    pub message: String,
}

/// A validated, compiled and linked module, ready to instantiate.
pub struct CompiledModule {
    /// Linked once at compile time, so each invocation only instantiates.
    pre: InstancePre<HostState>,
    /// The `_start` export, looked up once.
    entry: ModuleExport,
    /// The `memory` export, if the module exports a memory: looked up once
    /// per call and kept in the store's data, so that the host functions
    /// do not look it up by name on every WASI call.
    memory: Option<ModuleExport>,
    /// SHA-256 of the module's bytes (its blob key and cache name).
    sha256: [u8; 32],
    /// Whether the module imports nothing that waits or acts outside its
    /// own store (no sleep, no KV, publish or nested call): a run of it cut
    /// short leaves no trace and can start again elsewhere, so a call may
    /// run on its caller's thread ([`WasmEngine::invoke_here`]).
    pure: bool,
    /// Its last runs in a row (wherever they ran) that took longer than
    /// [`HERE_MAX_RUN`] or were stopped at the budget; from
    /// [`HERE_STRIKES`] on, calls go to the pool until a run there is short
    /// again. One slow run is a thread descheduled on a busy machine as
    /// often as a long guest; a long guest is slow every time.
    long_runs: AtomicU32,
}

impl CompiledModule {
    /// SHA-256 of the module's bytes.
    pub fn sha256(&self) -> [u8; 32] {
        self.sha256
    }

    /// SHA-256 of the module's bytes, as lowercase hex.
    pub fn sha256_hex(&self) -> String {
        hex::encode(self.sha256)
    }

    /// Whether a call may run on its caller's thread now.
    pub(crate) fn runs_here(&self) -> bool {
        self.pure && self.long_runs.load(Ordering::Relaxed) < HERE_STRIKES
    }

    /// The last runs in a row that were long (see `long_runs`).
    #[cfg(test)]
    pub(crate) fn long_runs(&self) -> u32 {
        self.long_runs.load(Ordering::Relaxed)
    }

    /// Notes how a run ended: its length when it answered, long when it
    /// was stopped at its deadline; other failures say nothing of length.
    fn note_outcome(&self, out: &Result<InvokeOutput>) {
        match out {
            Ok(o) => self.note_run(Some(o.duration)),
            Err(WasmError::Timeout) => self.note_run(None),
            Err(_) => {}
        }
    }

    /// Notes how long a run took (None: stopped at a budget or a deadline).
    fn note_run(&self, took: Option<Duration>) {
        if !self.pure {
            return;
        }
        match took {
            Some(d) if d <= HERE_MAX_RUN => {
                if self.long_runs.load(Ordering::Relaxed) != 0 {
                    self.long_runs.store(0, Ordering::Relaxed);
                }
            }
            _ => {
                let _ = self
                    .long_runs
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                        Some(n.saturating_add(1))
                    });
            }
        }
    }
}

impl std::fmt::Debug for CompiledModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledModule")
            .field("sha256", &self.sha256_hex())
            .finish_non_exhaustive()
    }
}

/// What a running store needs from the engine.
pub(crate) struct Runtime {
    /// The node's one wasmtime engine (pooling allocator, epoch interruption).
    engine: Engine,
    /// Milliseconds per epoch tick: a deadline becomes a number of ticks.
    tick_ms: u64,
    /// The epoch ticker's state: it ticks only while a guest runs.
    ticker: Ticker,
}

/// What the epoch ticker thread shares with the runs. Epochs only matter
/// while a guest runs (they interrupt it at its deadline), so the ticker
/// ticks while at least one run is counted here and sleeps parked, with no
/// wake-ups, while none is: an idle node's ticker used to wake every tick
/// (200 times a second at the default 5 ms).
#[derive(Default)]
pub(crate) struct Ticker {
    /// Runs in progress (a nested call counts as one more).
    running: AtomicUsize,
    /// Ticks made since start.
    ticks: AtomicU64,
    /// The ticker thread, unparked when a run starts while none was running.
    thread: std::sync::OnceLock<std::thread::Thread>,
    /// Set when the engine is dropped: the thread ends.
    stop: AtomicBool,
}

impl Ticker {
    /// Counts a run until the guard drops, waking the ticker if it slept.
    /// Taken before the run's epoch deadline is set, so the ticker is
    /// awake for every tick of it.
    fn enter(&self) -> Running<'_> {
        if self.running.fetch_add(1, Ordering::AcqRel) == 0
            && let Some(t) = self.thread.get()
        {
            t.unpark();
        }
        Running(self)
    }

    /// Ends the ticker thread.
    fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// The ticker thread's loop: a tick every `tick` while a run is counted.
    fn run(&self, engine: &Engine, tick: Duration) {
        while !self.stop.load(Ordering::Acquire) {
            if self.running.load(Ordering::Acquire) == 0 {
                // Woken by `enter` or `stop` (or spuriously): look again.
                std::thread::park();
                continue;
            }
            // Audited: the epoch ticker is its own thread; it sleeps one tick.
            #[allow(clippy::disallowed_methods)]
            std::thread::sleep(tick);
            engine.increment_epoch();
            self.ticks.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A run counted by the [`Ticker`].
struct Running<'a>(&'a Ticker);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The state behind [`WasmEngine`], shared by its clones.
struct Inner {
    /// The engine and tick, shared with every running store.
    runtime: Arc<Runtime>,
    /// WASI preview 1 and the `meshgate` imports, linked into each module.
    linker: Linker<HostState>,
    /// Every import the linker satisfies, as `module::name`.
    known_imports: HashSet<String>,
    /// Compiled artifacts on disk, by module hash.
    cache: ArtifactCache,
    /// The worker threads and their per-namespace queues.
    pool: Pool,
    /// [`WasmConfig::max_module_bytes`].
    max_module_bytes: usize,
    /// [`WasmConfig::max_wat_bytes`].
    max_wat_bytes: usize,
    /// [`WasmConfig::module_limits`].
    module_limits: ModuleLimits,
    /// Bounds the compiles of [`WasmEngine::compile_bounded`].
    gate: CompileGate,
    /// [`WasmConfig::compile_timeout`].
    compile_timeout: Duration,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.runtime.ticker.stop();
    }
}

/// The node's WASM engine: compile modules, run invocations on the pool.
#[derive(Clone)]
pub struct WasmEngine {
    /// Shared by every clone; dropping the last stops the ticker.
    inner: Arc<Inner>,
}

impl std::fmt::Debug for WasmEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmEngine")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Serves no namespace: the store used to list the linker's imports.
/// A host that refuses everything: lists the linker's imports at start-up.
struct NoHost;

impl HostApi for NoHost {
    fn kv_get(&self, _: &[u8]) -> Result<Option<Vec<u8>>, HostError> {
        Err(HostError::Denied)
    }
    fn kv_put(&self, _: &[u8], _: &[u8]) -> Result<(), HostError> {
        Err(HostError::Denied)
    }
    fn kv_delete(&self, _: &[u8]) -> Result<(), HostError> {
        Err(HostError::Denied)
    }
    fn publish(&self, _: &str, _: &[u8]) -> Result<(), HostError> {
        Err(HostError::Denied)
    }
    fn resolve(&self, _: &str) -> Result<ResolvedFunction, HostError> {
        Err(HostError::NotFound)
    }
}

fn wasmtime_config(workers: usize, here: usize) -> Config {
    // A worker holds at most MAX_DEPTH + 1 live instances (nested calls run
    // inline), a call on its caller's thread one (it makes no nested call),
    // so this many slots can never run out.
    let slots = (workers.max(1) * (MAX_DEPTH as usize + 1) + here + 4).min(MAX_POOL_SLOTS) as u32;
    let mut pool = PoolingAllocationConfig::new();
    pool.total_core_instances(slots)
        .total_memories(slots)
        .total_tables(slots)
        .total_stacks(slots)
        .max_memories_per_module(1)
        .max_tables_per_module(1)
        .table_elements(MAX_TABLE_ELEMENTS)
        .max_memory_size((MAX_MEMORY_MB as usize) << 20)
        // Reset an instance's memory in place instead of with madvise: the
        // kernel's PAGEMAP_SCAN (Linux 6.7+; skipped where missing) finds the
        // pages the call wrote and only those are reset, up to 1 MiB per slot
        // kept resident. madvise on every drop cost a TLB shootdown across
        // cores and a page fault per page on the next call (about 6% of an
        // HTTP invoke's CPU, see BENCHMARKS.md).
        .pagemap_scan(wasmtime::Enabled::Auto)
        .linear_memory_keep_resident(KEEP_RESIDENT_BYTES)
        .table_keep_resident(16 << 10);
    let mut config = Config::new();
    config
        .allocation_strategy(InstanceAllocationStrategy::Pooling(pool))
        .memory_init_cow(true)
        .epoch_interruption(true)
        .max_wasm_stack(MAX_WASM_STACK)
        .cranelift_opt_level(OptLevel::Speed)
        .parallel_compilation(true);
    config
}

impl WasmEngine {
    /// Starts the engine: wasmtime, the epoch ticker and the worker pool.
    pub fn new(cfg: WasmConfig, cache_dir: PathBuf) -> Result<Self> {
        let engine = Engine::new(&wasmtime_config(cfg.pool_threads(), cfg.workers.max(1)))
            .map_err(|e| WasmError::Internal(format!("cannot start wasmtime: {e:#}")))?;
        let tick_ms = cfg.epoch_tick_ms.max(1);
        let runtime = Arc::new(Runtime {
            engine: engine.clone(),
            tick_ms,
            ticker: Ticker::default(),
        });
        let linker = build_linker(&engine)
            .map_err(|e| WasmError::Internal(format!("cannot build the linker: {e:#}")))?;
        let known_imports = {
            let call = Invocation::new("", "", Vec::new());
            let state = HostState::new(
                runtime.clone(),
                call,
                Arc::new(NoHost),
                crate::util::mono_now(),
            );
            let mut store = Store::new(&engine, state);
            linker
                .iter(&mut store)
                .map(|(module, name, _)| format!("{module}::{name}"))
                .collect()
        };
        let cache = ArtifactCache::new(&engine, cache_dir)?;
        let pool = Pool::new(
            cfg.workers,
            cfg.spare_workers,
            cfg.queue,
            cfg.namespace_concurrency,
            cfg.queue_wait,
            cfg.worker_nice,
        )?;
        {
            let rt = runtime.clone();
            let tick = Duration::from_millis(tick_ms);
            let ticker = std::thread::Builder::new()
                .name("wasm-epoch".into())
                .spawn(move || rt.ticker.run(&rt.engine, tick))
                .map_err(|e| WasmError::Internal(format!("cannot spawn the epoch ticker: {e}")))?;
            let _ = runtime.ticker.thread.set(ticker.thread().clone());
        }
        Ok(Self {
            inner: Arc::new(Inner {
                runtime,
                linker,
                known_imports,
                cache,
                pool,
                max_module_bytes: cfg.max_module_bytes,
                max_wat_bytes: cfg.max_wat_bytes,
                module_limits: cfg.module_limits,
                gate: CompileGate::new(cfg.compile_concurrency),
                compile_timeout: cfg.compile_timeout,
            }),
        })
    }

    /// Validates, compiles (or loads from the artifact cache) and links a
    /// module, with the size and count limits checked first, outside the
    /// compile gate (the paths that load what a deploy already checked).
    /// WAT text is refused over `max_wat_bytes` before it is parsed.
    ///
    /// Compiling is CPU-bound (milliseconds to seconds): call it from a
    /// blocking context (`spawn_blocking`, `web::block`), not on an event loop.
    pub fn compile(&self, wasm: &[u8]) -> Result<Arc<CompiledModule>> {
        self.compile_inner(wasm, None)
    }

    /// [`WasmEngine::compile`] for a deploy of `namespace`: the limits are
    /// checked first, then a compile (not an artifact-cache load) takes a
    /// slot of the compile gate (at most `compile_concurrency` node-wide,
    /// one per namespace: `CompileBusy` for a second one) and must end
    /// within `compile_timeout` of this call, waiting included
    /// (`CompileTimeout`; a module compiled too late is not cached). Blocks:
    /// the async caller gives up at the same deadline (see
    /// [`WasmEngine::compile_timeout`]) while this thread runs to its end.
    pub fn compile_bounded(&self, namespace: &str, wasm: &[u8]) -> Result<Arc<CompiledModule>> {
        let deadline = crate::util::mono_now() + self.inner.compile_timeout;
        self.compile_inner(wasm, Some((namespace, deadline, false)))
    }

    /// [`WasmEngine::compile_bounded`] for an invocation of a stored module
    /// of `namespace`: a compile (an artifact-cache miss) takes a slot of
    /// the gate, waiting behind the namespace's own compile instead of
    /// `CompileBusy`, within `compile_timeout`. Blocks.
    pub fn compile_stored(&self, namespace: &str, wasm: &[u8]) -> Result<Arc<CompiledModule>> {
        let deadline = crate::util::mono_now() + self.inner.compile_timeout;
        self.compile_inner(wasm, Some((namespace, deadline, true)))
    }

    /// The longest a bounded compile may take ([`WasmConfig::compile_timeout`]).
    pub fn compile_timeout(&self) -> Duration {
        self.inner.compile_timeout
    }

    /// Compiles running now (slots of the compile gate taken).
    pub fn compiles_running(&self) -> usize {
        self.inner.gate.running()
    }

    /// Fault injection (`[debug] fault_injection`, the route
    /// `debug/hold-compile`): takes a compile slot for `namespace` on a
    /// thread of its own and keeps it for `hold`, as a long compile would.
    /// Returns once the slot is taken, or the gate's refusal. Blocks: call
    /// it from a blocking thread.
    #[doc(hidden)]
    pub fn hold_compile_slot(&self, namespace: &str, hold: Duration) -> Result<()> {
        let inner = self.inner.clone();
        let ns = namespace.to_string();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("compile-hold".into())
            .spawn(move || {
                let deadline = crate::util::mono_now() + inner.compile_timeout;
                match inner.gate.enter(&ns, deadline, false) {
                    Ok(slot) => {
                        let _ = tx.send(Ok(()));
                        // Audited: a debug thread of its own that stands for
                        // a compile running on its blocking thread.
                        #[allow(clippy::disallowed_methods)]
                        std::thread::sleep(hold);
                        drop(slot);
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| WasmError::Internal(format!("cannot start the hold: {e}")))?;
        rx.recv()
            .map_err(|_| WasmError::Internal("the hold ended early".into()))?
    }

    /// Instance slots of the pooling allocator that held an instance before
    /// and are free now: the next instance of a module reuses one (its
    /// memory's copy-on-write image still mapped when it is the same
    /// module). None when the engine does not pool.
    pub fn warm_instance_slots(&self) -> Option<u32> {
        self.inner
            .runtime
            .engine
            .pooling_allocator_metrics()
            .map(|m| m.unused_warm_memories())
    }

    fn compile_inner(
        &self,
        wasm: &[u8],
        bounded: Option<(&str, Instant, bool)>,
    ) -> Result<Arc<CompiledModule>> {
        let inner = &*self.inner;
        if wasm.len() > inner.max_module_bytes {
            return Err(WasmError::ModuleTooLarge {
                size: wasm.len(),
                max: inner.max_module_bytes,
                key: "max_module_bytes",
            });
        }
        check_module_shape(wasm)?;
        let is_text = !wasm.starts_with(WASM_MAGIC);
        if is_text && wasm.len() > inner.max_wat_bytes {
            return Err(WasmError::ModuleTooLarge {
                size: wasm.len(),
                max: inner.max_wat_bytes,
                key: "max_wat_bytes",
            });
        }
        // A binary's counts are checked before it takes a compile slot (a
        // cheap read of its headers); WAT text is parsed only inside the
        // slot, since parsing it costs memory far out of proportion to its
        // size (see gate.rs), and its counts after.
        if !is_text {
            check_shape(wasm, &inner.module_limits)?;
        }
        let take_slot = || match bounded {
            Some((ns, deadline, queue)) => inner.gate.enter(ns, deadline, queue).map(Some),
            None => Ok(None),
        };
        let mut slot = None;
        let binary: std::borrow::Cow<'_, [u8]> = if is_text {
            slot = take_slot()?;
            let binary = wat::parse_bytes(wasm)
                .map_err(|e| WasmError::InvalidModule(format!("not valid WAT text: {e}")))?
                .into_owned();
            check_shape(&binary, &inner.module_limits)?;
            std::borrow::Cow::Owned(binary)
        } else {
            std::borrow::Cow::Borrowed(wasm)
        };
        let engine = &inner.runtime.engine;
        let digest = ring::digest::digest(&ring::digest::SHA256, wasm);
        let mut sha256 = [0u8; 32];
        sha256.copy_from_slice(digest.as_ref());

        let (module, cached) = match inner.cache.load(engine, &sha256) {
            Some(module) => (module, true),
            None => {
                if slot.is_none() {
                    slot = take_slot()?;
                }
                let module = Module::new(engine, &binary).map_err(|e| {
                    WasmError::InvalidModule(format!("not a valid WebAssembly binary: {e:#}"))
                })?;
                if let Some((_, deadline, _)) = bounded
                    && crate::util::mono_now() > deadline
                {
                    return Err(WasmError::CompileTimeout(format!(
                        "the compile took longer than {} ms",
                        inner.compile_timeout.as_millis()
                    )));
                }
                (module, false)
            }
        };
        drop(binary);
        drop(slot);
        for import in module.imports() {
            let key = format!("{}::{}", import.module(), import.name());
            if !inner.known_imports.contains(&key) {
                return Err(WasmError::UnknownImport(key));
            }
        }
        match module.get_export(ENTRY_POINT) {
            Some(ExternType::Func(f)) if f.params().len() == 0 && f.results().len() == 0 => {}
            _ => {
                return Err(WasmError::InvalidModule(format!(
                    "no `{ENTRY_POINT}: func()` export: not a WASI command module"
                )));
            }
        }
        let entry = module
            .get_export_index(ENTRY_POINT)
            .ok_or_else(|| WasmError::InvalidModule(format!("no `{ENTRY_POINT}` export")))?;
        let memory = match module.get_export("memory") {
            Some(ExternType::Memory(_)) => module.get_export_index("memory"),
            _ => None,
        };
        // Link once: every invocation of this module reuses the resolved imports.
        let pre = inner
            .linker
            .instantiate_pre(&module)
            .map_err(|e| WasmError::InvalidModule(format!("{e:#}")))?;
        if !cached {
            // Only modules that passed every check reach the cache.
            inner.cache.store(&module, &sha256);
        }
        let pure = module.imports().all(|i| match i.module() {
            "meshgate" => HERE_IMPORTS.contains(&i.name()),
            m if m == super::wasi::MODULE => !super::wasi::BLOCKING.contains(&i.name()),
            _ => false,
        });
        Ok(Arc::new(CompiledModule {
            pre,
            entry,
            memory,
            sha256,
            pure,
            long_runs: AtomicU32::new(0),
        }))
    }

    /// Runs `call` on the worker pool and waits for it.
    pub async fn invoke(
        &self,
        module: Arc<CompiledModule>,
        call: Invocation,
        host: Arc<dyn HostApi>,
    ) -> Result<InvokeOutput> {
        // The input and depth limits are checked once, in `execute`, which
        // every path (pool, inline, nested) runs.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let runtime = self.inner.runtime.clone();
        let namespace = call.namespace.clone();
        let job = Box::new(move |admitted: Result<()>| {
            if let Err(refused) = admitted {
                let _ = tx.send(Err(refused));
                return;
            }
            // The caller gave up while this waited in the queue.
            if tx.is_closed() {
                return;
            }
            let out = execute(&runtime, &module, call, host, None);
            module.note_outcome(&out);
            let _ = tx.send(out);
        });
        self.inner.pool.submit(&namespace, job)?;
        rx.await
            .map_err(|_| WasmError::Internal("the WASM worker dropped the invocation".into()))?
    }

    /// Runs `call` on this thread when that is safe and cheap, else on the
    /// pool as [`WasmEngine::invoke`]. On this thread: the module waits on
    /// nothing and acts on nothing outside its store (`CompiledModule::pure`)
    /// and its last runs were short (`CompiledModule::long_runs`),
    /// nothing waits for a pool worker (so no queued call is overtaken; the
    /// run counts as the namespace's for the fair share), and the input is
    /// at most [`HERE_MAX_INPUT`]. The run gets [`HERE_BUDGET_TICKS`]; a guest
    /// still running then is stopped, which nobody can observe (no effect
    /// left the store, its output is dropped), and runs again from the start
    /// on the pool. A module whose runs take longer than [`HERE_MAX_RUN`]
    /// [`HERE_STRIKES`] times in a row runs on the pool until a run there is
    /// short again. A request thread thus never runs a guest longer than two
    /// ticks, runs a long one a few times at most, and a short pure function
    /// costs no thread hop.
    pub async fn invoke_here(
        &self,
        module: Arc<CompiledModule>,
        call: Invocation,
        host: Arc<dyn HostApi>,
    ) -> Result<InvokeOutput> {
        let call = match self.try_here(&module, call, &host) {
            Ok(done) => return done,
            Err(call) => call,
        };
        self.invoke(module, call, host).await
    }

    /// The run on this thread, or the call back when it must go to the pool.
    fn try_here(
        &self,
        module: &CompiledModule,
        call: Invocation,
        host: &Arc<dyn HostApi>,
    ) -> std::result::Result<Result<InvokeOutput>, Invocation> {
        if !module.runs_here() || call.input.len() > HERE_MAX_INPUT {
            return Err(call);
        }
        let Some(_hold) = self.inner.pool.try_hold(&call.namespace) else {
            return Err(call);
        };
        match run(&self.inner.runtime, module, call, host.clone(), None, true) {
            Ran::Done(out) => {
                module.note_outcome(&out);
                Ok(out)
            }
            Ran::OverBudget(call) => {
                module.note_run(None);
                Err(call)
            }
        }
    }

    /// A snapshot of the worker pool.
    pub fn stats(&self) -> PoolStats {
        self.inner.pool.stats()
    }

    /// Removes the cached artifacts of modules not in `kept` (SHA-256 hex)
    /// written before `since`; returns how many files went. The node calls
    /// it after each blob sweep with the blobs the sweep kept.
    pub fn retain_artifacts(
        &self,
        kept: &std::collections::BTreeSet<String>,
        since: std::time::SystemTime,
    ) -> usize {
        self.inner.cache.retain(kept, since)
    }

    /// Modules loaded from the artifact cache since start.
    pub fn cache_hits(&self) -> u64 {
        self.inner.cache.hits()
    }

    /// Modules compiled (not found in the artifact cache) since start.
    pub fn cache_misses(&self) -> u64 {
        self.inner.cache.misses()
    }

    /// Runs `call` on the current thread, bypassing the pool: for benchmarks
    /// only (the node must use [`WasmEngine::invoke`]).
    #[doc(hidden)]
    pub fn invoke_inline_for_bench(
        &self,
        module: Arc<CompiledModule>,
        call: Invocation,
        host: Arc<dyn HostApi>,
    ) -> Result<InvokeOutput> {
        execute(&self.inner.runtime, &module, call, host, None)
    }

    /// Epoch ticks made since the engine started (the ticker ticks only
    /// while a guest runs).
    #[cfg(test)]
    pub(crate) fn epoch_ticks(&self) -> u64 {
        self.inner.runtime.ticker.ticks.load(Ordering::Relaxed)
    }

    /// The underlying wasmtime engine (for benchmarks against raw wasmtime).
    #[doc(hidden)]
    pub fn wasmtime_engine(&self) -> &Engine {
        &self.inner.runtime.engine
    }
}

/// Runs one invocation in a fresh store on the current thread.
///
/// `deadline_cap` is the caller's deadline for a nested call.
pub(crate) fn execute(
    runtime: &Arc<Runtime>,
    module: &CompiledModule,
    call: Invocation,
    host: Arc<dyn HostApi>,
    deadline_cap: Option<Instant>,
) -> Result<InvokeOutput> {
    match run(runtime, module, call, host, deadline_cap, false) {
        Ran::Done(out) => out,
        Ran::OverBudget(_) => unreachable!("a run without a budget is never over it"),
    }
}

/// How a run ended.
enum Ran {
    /// It ended (or failed) on its own, or at its deadline.
    Done(Result<InvokeOutput>),
    /// It was stopped at [`HERE_BUDGET_TICKS`] before its deadline; the call
    /// is handed back whole, to run again from the start.
    OverBudget(Invocation),
}

/// [`execute`], and with `budget` the speculative run of
/// [`WasmEngine::invoke_here`]: stopped after [`HERE_BUDGET_TICKS`].
fn run(
    runtime: &Arc<Runtime>,
    module: &CompiledModule,
    call: Invocation,
    host: Arc<dyn HostApi>,
    deadline_cap: Option<Instant>,
    budget: bool,
) -> Ran {
    if call.input.len() > MAX_INPUT_BYTES {
        return Ran::Done(Err(WasmError::InputTooLarge));
    }
    if call.depth > MAX_DEPTH {
        return Ran::Done(Err(WasmError::DepthExceeded));
    }
    if !Engine::same(module.pre.module().engine(), &runtime.engine) {
        return Ran::Done(Err(WasmError::Internal(
            "module compiled by another engine".into(),
        )));
    }
    let start = crate::util::mono_now();
    let mut deadline = start
        .checked_add(call.timeout)
        .unwrap_or(start + Duration::from_secs(3600));
    if let Some(cap) = deadline_cap {
        deadline = deadline.min(cap);
    }
    let mut ticks =
        deadline.saturating_duration_since(start).as_millis() as u64 / runtime.tick_ms + 1;
    let budgeted = budget && ticks > HERE_BUDGET_TICKS;
    if budgeted {
        ticks = HERE_BUDGET_TICKS;
    }
    let (function, version, memory_limit_mb, timeout) = (
        // Kept in the state too: the guest's `argv[0]`.
        call.function.clone(),
        call.version,
        call.memory_limit_mb,
        call.timeout,
    );

    let _running = runtime.ticker.enter();
    let state = HostState::new(runtime.clone(), call, host, deadline);
    let mut store = Store::new(&runtime.engine, state);
    store.limiter(|s| &mut s.limiter);
    store.set_epoch_deadline(ticks);

    let outcome = module.pre.instantiate(&mut store).and_then(|instance| {
        if let Some(export) = &module.memory
            && let Some(Extern::Memory(m)) = instance.get_module_export(&mut store, export)
        {
            store.data_mut().wasi.memory = Some(m);
        }
        match instance.get_module_export(&mut store, &module.entry) {
            Some(Extern::Func(f)) => f.typed::<(), ()>(&store)?.call(&mut store, ()),
            _ => Err(wasmtime::format_err!("`{ENTRY_POINT}` is not a function")),
        }
    });
    let duration = start.elapsed();
    if budgeted
        && let Err(e) = &outcome
        && e.downcast_ref::<Trap>() == Some(&Trap::Interrupt)
        && crate::util::mono_now() < deadline
    {
        let state = store.into_data();
        return Ran::OverBudget(state.into_call(function, version, memory_limit_mb, timeout));
    }
    let mut state = store.into_data();
    let stdout = state.take_stdout();
    let logs = state.logs.lock().finish();

    if stdout.len() > MAX_OUTPUT_BYTES {
        return Ran::Done(Err(WasmError::OutputTooLarge));
    }
    if let Err(err) = outcome
        && let Err(e) = classify(err, state.limiter.memory_refused)
    {
        return Ran::Done(Err(e));
    }
    Ran::Done(Ok(InvokeOutput {
        stdout,
        logs,
        duration,
        publishes: state.publishes.saturating_add(state.nested_publishes),
    }))
}

/// Maps a failed run to its error, or `Ok` for `proc_exit(0)`.
fn classify(err: wasmtime::Error, memory_refused: bool) -> Result<()> {
    if let Some(exit) = err.downcast_ref::<super::wasi::Exit>() {
        return match exit.0 {
            0 => Ok(()),
            _ if memory_refused => Err(WasmError::MemoryLimit),
            code => Err(WasmError::Trapped(format!("exit code {code}"))),
        };
    }
    if let Some(trap) = err.downcast_ref::<Trap>() {
        if *trap == Trap::Interrupt {
            return Err(WasmError::Timeout);
        }
        if memory_refused {
            return Err(WasmError::MemoryLimit);
        }
        return Err(WasmError::Trapped(trap.to_string()));
    }
    if memory_refused {
        return Err(WasmError::MemoryLimit);
    }
    Err(WasmError::Trapped(format!("{:#}", err)))
}

/// The four bytes every WebAssembly binary starts with.
const WASM_MAGIC: &[u8] = b"\0asm";

/// A module is a WebAssembly binary (`\0asm`) or WAT text (a `(` or a comment
/// first); anything else is named as such instead of with a parser's message.
fn check_module_shape(wasm: &[u8]) -> Result<()> {
    if wasm.starts_with(WASM_MAGIC) {
        return Ok(());
    }
    let text = std::str::from_utf8(wasm).map(str::trim_start);
    match text {
        Ok(t) if t.starts_with('(') || t.starts_with(";;") => Ok(()),
        _ => Err(WasmError::InvalidModule(
            "not a WebAssembly module (no \\0asm header, and not WAT text)".into(),
        )),
    }
}

#[cfg(test)]
mod wasi_tests {
    use super::*;

    /// The imports of `module` that `linker` defines, with their types.
    fn funcs<T>(
        linker: &Linker<T>,
        store: &mut Store<T>,
        module: &str,
    ) -> std::collections::BTreeMap<String, String> {
        let found: Vec<(String, Extern)> = linker
            .iter(&mut *store)
            .filter(|(m, _, _)| *m == module)
            .map(|(_, n, e)| (n.to_string(), e))
            .collect();
        found
            .into_iter()
            .map(|(n, e)| {
                let ty = match e {
                    Extern::Func(f) => format!("{:?}", f.ty(&*store)),
                    other => format!("not a function: {other:?}"),
                };
                (n, ty)
            })
            .collect()
    }

    /// Our WASI preview 1 defines every function wasmtime-wasi's does, each
    /// with the same type, so any module that linked before links now.
    #[test]
    fn our_preview1_links_as_wasmtime_wasi() {
        let engine = Engine::new(&wasmtime_config(1, 1)).unwrap();
        let mut theirs: Linker<wasmtime_wasi::p1::WasiP1Ctx> = Linker::new(&engine);
        wasmtime_wasi::p1::add_to_linker_sync(&mut theirs, |t| t).unwrap();
        let mut their_store = Store::new(&engine, wasmtime_wasi::WasiCtxBuilder::new().build_p1());
        let want = funcs(&theirs, &mut their_store, super::super::wasi::MODULE);

        let ours = build_linker(&engine).unwrap();
        let runtime = Arc::new(Runtime {
            engine: engine.clone(),
            tick_ms: 5,
            ticker: Ticker::default(),
        });
        let state = HostState::new(
            runtime,
            Invocation::new("", "", Vec::new()),
            Arc::new(NoHost),
            crate::util::mono_now(),
        );
        let mut store = Store::new(&engine, state);
        let got = funcs(&ours, &mut store, super::super::wasi::MODULE);
        assert_eq!(want.len(), 46, "preview 1 has 46 functions");
        assert_eq!(got, want);
    }
}
