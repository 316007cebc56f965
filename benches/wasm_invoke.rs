//! Warm no-op invocation: raw wasmtime vs `WasmEngine`.
//!
//! - `raw_wasmtime`: `InstancePre::instantiate` + call of `_start` in a minimal
//!   `Store<()>`, on the same wasmtime `Engine` (same pooling allocator and
//!   settings) as the `WasmEngine`.
//! - `engine_inline`: the `WasmEngine` path of one invocation (store, limiter,
//!   deadline, lazy WASI, instantiate, call, output collection) on the
//!   current thread: the cost the design bounds at 1.5x raw.
//! - `engine_invoke`: `WasmEngine::invoke` end to end: the above plus the
//!   queue hand-off to a worker thread and the oneshot back.
//!
//! Run: `CARGO_TARGET_DIR=/work/target-wasm cargo bench --bench wasm_invoke`

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use meshgate::wasm::{
    CompiledModule, HostApi, HostError, Invocation, ResolvedFunction, WasmConfig, WasmEngine,
};

const NOOP: &str = r#"(module (memory (export "memory") 1) (func (export "_start")))"#;

struct NoopHost;

impl HostApi for NoopHost {
    fn kv_get(&self, _: &[u8]) -> Result<Option<Vec<u8>>, HostError> {
        Ok(None)
    }
    fn kv_put(&self, _: &[u8], _: &[u8]) -> Result<(), HostError> {
        Ok(())
    }
    fn kv_delete(&self, _: &[u8]) -> Result<(), HostError> {
        Ok(())
    }
    fn publish(&self, _: &str, _: &[u8]) -> Result<(), HostError> {
        Ok(())
    }
    fn resolve(&self, _: &str) -> Result<ResolvedFunction, HostError> {
        Err(HostError::NotFound)
    }
}

/// Raw wasmtime: a fresh store holding `data`, instantiate, `_start`.
fn raw_start<T: 'static>(engine: &wasmtime::Engine, pre: &wasmtime::InstancePre<T>, data: T) {
    let mut store = wasmtime::Store::new(engine, data);
    store.set_epoch_deadline(1_000);
    let instance = pre.instantiate(&mut store).expect("instantiate");
    let start = instance
        .get_typed_func::<(), ()>(&mut store, "_start")
        .expect("_start");
    start.call(&mut store, ()).expect("call");
}

fn raw_call(engine: &wasmtime::Engine, pre: &wasmtime::InstancePre<()>) {
    raw_start(engine, pre, ());
}

fn mean_of(iters: u32, mut f: impl FnMut()) -> Duration {
    for _ in 0..iters / 10 {
        f();
    }
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    t.elapsed() / iters
}

/// An engine with one pool worker, its artifact cache under `dir`.
fn one_worker_engine(dir: &tempfile::TempDir) -> WasmEngine {
    let cfg = WasmConfig {
        workers: 1,
        ..WasmConfig::default()
    };
    WasmEngine::new(cfg, dir.path().to_path_buf()).expect("engine")
}

/// Criterion's `engine_inline`: the call run by the engine on this thread.
fn bench_inline(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    engine: &WasmEngine,
    module: &Arc<CompiledModule>,
    call: &Invocation,
    host: &Arc<dyn HostApi>,
) {
    group.bench_function("engine_inline", |b| {
        b.iter(|| {
            engine
                .invoke_inline_for_bench(module.clone(), call.clone(), host.clone())
                .expect("invoke")
        })
    });
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = one_worker_engine(&dir);
    let module: Arc<CompiledModule> = engine.compile(NOOP.as_bytes()).expect("compile");
    let host: Arc<dyn HostApi> = Arc::new(NoopHost);
    let call = Invocation::new("bench", "noop", Vec::new());

    let raw_engine = engine.wasmtime_engine().clone();
    let raw_module = wasmtime::Module::new(&raw_engine, NOOP).expect("raw module");
    let pre = wasmtime::Linker::<()>::new(&raw_engine)
        .instantiate_pre(&raw_module)
        .expect("raw pre");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio");

    let mut group = c.benchmark_group("noop_invoke");
    group.bench_function("raw_wasmtime", |b| b.iter(|| raw_call(&raw_engine, &pre)));
    bench_inline(&mut group, &engine, &module, &call, &host);
    group.bench_function("engine_invoke", |b| {
        b.iter(|| {
            rt.block_on(engine.invoke(module.clone(), call.clone(), host.clone()))
                .expect("invoke")
        })
    });
    group.finish();

    // The same three, measured back to back for a direct ratio.
    let n = 20_000;
    let raw = mean_of(n, || raw_call(&raw_engine, &pre));
    let inline = mean_of(n, || {
        engine
            .invoke_inline_for_bench(module.clone(), call.clone(), host.clone())
            .expect("invoke");
    });
    let pooled = mean_of(n / 4, || {
        rt.block_on(engine.invoke(module.clone(), call.clone(), host.clone()))
            .expect("invoke");
    });
    let ratio = |d: Duration| d.as_secs_f64() / raw.as_secs_f64();
    // A smoke run under `cargo test` keeps quiet unless it fails.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    println!(
        "\nnoop invoke, mean of {n}: raw wasmtime {raw:?}; WasmEngine inline {inline:?} ({:.2}x raw); \
         WasmEngine::invoke via the pool {pooled:?} ({:.2}x raw)",
        ratio(inline),
        ratio(pooled)
    );
}

/// The C echo module (`examples/functions/echo.c`): reads stdin, writes it back.
const ECHO: &[u8] = include_bytes!("../examples/functions/echo.wasm");
const ECHO_INPUT: &[u8] = br#"{"hello":"world"}"#;

/// Raw wasmtime running the echo module: a fresh store with a WASI context
/// on in-memory pipes, instantiate, `_start`; returns what it wrote.
fn raw_echo(
    engine: &wasmtime::Engine,
    pre: &wasmtime::InstancePre<wasmtime_wasi::p1::WasiP1Ctx>,
) -> Vec<u8> {
    use wasmtime_wasi::p2::pipe::{MemoryInputPipe, MemoryOutputPipe};
    let out = MemoryOutputPipe::new(1 << 20);
    let wasi = wasmtime_wasi::WasiCtxBuilder::new()
        .stdin(MemoryInputPipe::new(ECHO_INPUT))
        .stdout(out.clone())
        .build_p1();
    raw_start(engine, pre, wasi);
    out.contents().to_vec()
}

/// The echo guest: raw wasmtime with WASI against the engine run inline on
/// this thread (what a pool worker does per call), so the cost of the
/// guest's own run is seen apart from the HTTP path.
fn echo(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = one_worker_engine(&dir);
    let module: Arc<CompiledModule> = engine.compile(ECHO).expect("compile");
    let host: Arc<dyn HostApi> = Arc::new(NoopHost);
    let call = Invocation::new("bench", "echo", ECHO_INPUT.to_vec());

    let raw_engine = engine.wasmtime_engine().clone();
    let raw_module = wasmtime::Module::new(&raw_engine, ECHO).expect("raw module");
    let mut linker = wasmtime::Linker::new(&raw_engine);
    wasmtime_wasi::p1::add_to_linker_sync(&mut linker, |t| t).expect("wasi");
    let pre = linker.instantiate_pre(&raw_module).expect("raw pre");
    assert_eq!(raw_echo(&raw_engine, &pre), ECHO_INPUT);
    let out = engine
        .invoke_inline_for_bench(module.clone(), call.clone(), host.clone())
        .expect("invoke");
    assert_eq!(out.stdout, ECHO_INPUT);

    let mut group = c.benchmark_group("echo_invoke");
    group.bench_function("raw_wasmtime", |b| b.iter(|| raw_echo(&raw_engine, &pre)));
    bench_inline(&mut group, &engine, &module, &call, &host);
    // What an HTTP invoke runs: the call on the caller's thread, through the
    // pool's count (`WasmEngine::invoke_here`).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    group.bench_function("engine_here", |b| {
        b.iter(|| {
            rt.block_on(engine.invoke_here(module.clone(), call.clone(), host.clone()))
                .expect("invoke")
        })
    });
    group.finish();
}

criterion_group!(benches, bench, echo);
criterion_main!(benches);
