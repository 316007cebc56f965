//! Every limit as an obeyed/violated pair, the guest ABI and the C examples.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::*;

const ECHO: &[u8] = include_bytes!("../../examples/functions/echo.wasm");
const COUNTER: &[u8] = include_bytes!("../../examples/functions/counter.wasm");
const PUBLISHER: &[u8] = include_bytes!("../../examples/functions/publisher.wasm");
const CALLER: &[u8] = include_bytes!("../../examples/functions/caller.wasm");

const NOOP: &str = r#"(module (memory (export "memory") 1) (func (export "_start")))"#;
const INFINITE_LOOP: &str = r#"(module (func (export "_start") (loop (br 0))))"#;

/// An in-memory namespace: KV, published messages and resolvable functions.
#[derive(Default)]
struct FakeHost {
    kv: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    published: Mutex<Vec<(String, Vec<u8>)>>,
    functions: Mutex<HashMap<String, Arc<CompiledModule>>>,
}

impl FakeHost {
    fn with_function(self, name: &str, module: Arc<CompiledModule>) -> Self {
        self.functions.lock().insert(name.to_owned(), module);
        self
    }

    fn get(&self, key: &str) -> Option<Vec<u8>> {
        self.kv.lock().get(key.as_bytes()).cloned()
    }

    fn get_i64(&self, key: &str) -> i64 {
        let v = self.get(key).unwrap_or_else(|| panic!("no key {key}"));
        i64::from_le_bytes(v.try_into().expect("8 bytes"))
    }
}

impl HostApi for FakeHost {
    fn kv_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, HostError> {
        Ok(self.kv.lock().get(key).cloned())
    }
    fn kv_put(&self, key: &[u8], value: &[u8]) -> Result<(), HostError> {
        self.kv.lock().insert(key.to_vec(), value.to_vec());
        Ok(())
    }
    fn kv_delete(&self, key: &[u8]) -> Result<(), HostError> {
        self.kv.lock().remove(key);
        Ok(())
    }
    fn publish(&self, topic: &str, data: &[u8]) -> Result<(), HostError> {
        self.published
            .lock()
            .push((topic.to_owned(), data.to_vec()));
        Ok(())
    }
    fn resolve(&self, name: &str) -> Result<ResolvedFunction, HostError> {
        let module = self
            .functions
            .lock()
            .get(name)
            .cloned()
            .ok_or(HostError::NotFound)?;
        Ok(ResolvedFunction {
            module,
            version: 1,
            env: Vec::new(),
            memory_limit_mb: 16,
            timeout: Duration::from_secs(5),
        })
    }
}

/// A pool of exactly `workers` threads (no spare one): the queue tests count
/// on every thread being one a namespace may fill.
fn config(workers: usize, queue: usize, namespace_concurrency: usize) -> WasmConfig {
    WasmConfig {
        workers,
        spare_workers: 0,
        queue,
        namespace_concurrency,
        ..WasmConfig::default()
    }
}

fn engine_with(cfg: WasmConfig) -> (WasmEngine, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = WasmEngine::new(cfg, dir.path().join("cache")).expect("engine");
    (engine, dir)
}

fn engine() -> (WasmEngine, tempfile::TempDir) {
    engine_with(config(2, 16, 4))
}

/// WAT source: wasmtime's `wat` feature lets `compile` take the text as is.
fn wat(src: &str) -> Vec<u8> {
    src.as_bytes().to_vec()
}

async fn run(
    engine: &WasmEngine,
    module: &Arc<CompiledModule>,
    call: Invocation,
    host: Arc<FakeHost>,
) -> Result<InvokeOutput> {
    engine.invoke(module.clone(), call, host).await
}

fn call(input: &[u8]) -> Invocation {
    Invocation::new("ns", "f", input.to_vec())
}

/// A guest that writes `len` bytes to stdout with one `fd_write`.
fn writer(len: usize) -> String {
    let pages = len / 65536 + 2;
    format!(
        r#"(module
          (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") {pages})
          (func (export "_start")
            (i32.store (i32.const 0) (i32.const 64))
            (i32.store (i32.const 4) (i32.const {len}))
            (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"#
    )
}

/// Waits (up to 5 s) until the engine's epoch ticks stay the same for
/// 100 ms (twenty ticks of 5 ms), and returns them; panics if they never do.
async fn ticks_at_rest(engine: &WasmEngine) -> u64 {
    for _ in 0..50 {
        let before = engine.epoch_ticks();
        tokio::time::sleep(Duration::from_millis(100)).await;
        if engine.epoch_ticks() == before {
            return before;
        }
    }
    panic!("the epoch ticker kept ticking with no guest running");
}

/// The epoch ticker sleeps while no guest runs (an idle node does not wake
/// every tick), wakes for a run and stops it at its deadline as before,
/// and sleeps again after it.
#[tokio::test]
async fn epoch_ticker_ticks_only_while_a_guest_runs() {
    let (engine, _dir) = engine();
    assert_eq!(ticks_at_rest(&engine).await, 0, "no tick before any run");
    let spin = engine
        .compile(&wat(r#"(module (memory (export "memory") 1)
          (func (export "_start") (loop (br 0))))"#))
        .unwrap();
    let mut c = call(b"");
    c.timeout = Duration::from_millis(50);
    let err = run(&engine, &spin, c, Arc::default()).await.unwrap_err();
    assert_eq!(err, WasmError::Timeout);
    let after_run = ticks_at_rest(&engine).await;
    assert!(
        after_run >= 10,
        "a 50 ms run took {after_run} ticks of 5 ms"
    );
    // And again: the ticker woke for the second run too.
    let mut c = call(b"");
    c.timeout = Duration::from_millis(50);
    let err = run(&engine, &spin, c, Arc::default()).await.unwrap_err();
    assert_eq!(err, WasmError::Timeout);
    assert!(ticks_at_rest(&engine).await >= after_run + 10);
}

/// A short guest within its deadline succeeds.
#[tokio::test]
async fn timeout_obeyed() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(r#"(module (func (export "_start") (local i32)
            (loop (local.set 0 (i32.add (local.get 0) (i32.const 1)))
                  (br_if 0 (i32.lt_u (local.get 0) (i32.const 100000))))))"#))
        .unwrap();
    let mut c = call(b"");
    c.timeout = Duration::from_secs(1);
    run(&engine, &m, c, Arc::default()).await.unwrap();
}

/// An infinite loop is stopped at its deadline.
#[tokio::test]
async fn timeout_violated() {
    let (engine, _dir) = engine();
    let m = engine.compile(&wat(INFINITE_LOOP)).unwrap();
    let mut c = call(b"");
    c.timeout = Duration::from_millis(100);
    let started = std::time::Instant::now();
    let err = run(&engine, &m, c, Arc::default()).await.unwrap_err();
    assert_eq!(err, WasmError::Timeout);
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// Growing memory within the cap works.
#[tokio::test]
async fn memory_limit_obeyed() {
    let (engine, _dir) = engine();
    // 1 page + 16 pages = 1.06 MiB, under a 2 MiB cap.
    let m = engine
        .compile(&wat(r#"(module (memory (export "memory") 1)
            (func (export "_start")
              (if (i32.eq (memory.grow (i32.const 16)) (i32.const -1)) (then unreachable))))"#))
        .unwrap();
    let mut c = call(b"");
    c.memory_limit_mb = 2;
    run(&engine, &m, c, Arc::default()).await.unwrap();
}

/// A memory bomb is refused past the cap and reported as MemoryLimit.
#[tokio::test]
async fn memory_limit_violated() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(r#"(module (memory (export "memory") 1)
            (func (export "_start")
              (loop
                (if (i32.eq (memory.grow (i32.const 16)) (i32.const -1)) (then unreachable))
                (br 0))))"#))
        .unwrap();
    let mut c = call(b"");
    c.memory_limit_mb = 4;
    let err = run(&engine, &m, c, Arc::default()).await.unwrap_err();
    assert_eq!(err, WasmError::MemoryLimit);
}

/// A module whose initial memory is over the cap does not start.
#[tokio::test]
async fn memory_limit_violated_at_start() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(
            r#"(module (memory (export "memory") 100) (func (export "_start")))"#,
        ))
        .unwrap();
    let mut c = call(b"");
    c.memory_limit_mb = 2;
    let err = run(&engine, &m, c, Arc::default()).await.unwrap_err();
    assert_eq!(err, WasmError::MemoryLimit);
}

/// Unbounded recursion traps with a stack overflow, the worker survives.
#[tokio::test]
async fn stack_overflow_traps() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(r#"(module (func $f (export "_start") (call $f)))"#))
        .unwrap();
    let err = run(&engine, &m, call(b""), Arc::default())
        .await
        .unwrap_err();
    match err {
        WasmError::Trapped(msg) => assert!(msg.contains("stack"), "{msg}"),
        other => panic!("expected a trap, got {other:?}"),
    }
    let noop = engine.compile(&wat(NOOP)).unwrap();
    run(&engine, &noop, call(b""), Arc::default())
        .await
        .unwrap();
}

/// Exactly 1 MiB of output is accepted.
#[tokio::test]
async fn output_limit_obeyed() {
    let (engine, _dir) = engine();
    let m = engine.compile(&wat(&writer(MAX_OUTPUT_BYTES))).unwrap();
    let out = run(&engine, &m, call(b""), Arc::default()).await.unwrap();
    assert_eq!(out.stdout.len(), MAX_OUTPUT_BYTES);
}

/// More than 1 MiB of output is OutputTooLarge.
#[tokio::test]
async fn output_limit_violated() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(&writer(MAX_OUTPUT_BYTES + 4096)))
        .unwrap();
    let err = run(&engine, &m, call(b""), Arc::default())
        .await
        .unwrap_err();
    assert_eq!(err, WasmError::OutputTooLarge);
}

/// 1 MiB of input is echoed back.
#[tokio::test]
async fn input_limit_obeyed() {
    let (engine, _dir) = engine();
    let m = engine.compile(ECHO).unwrap();
    let input: Vec<u8> = (0..MAX_INPUT_BYTES).map(|i| (i % 251) as u8).collect();
    let out = run(&engine, &m, call(&input), Arc::default())
        .await
        .unwrap();
    assert_eq!(out.stdout, input);
}

/// More than 1 MiB of input is refused before running.
#[tokio::test]
async fn input_limit_violated() {
    let (engine, _dir) = engine();
    let m = engine.compile(ECHO).unwrap();
    let input = vec![0u8; MAX_INPUT_BYTES + 1];
    let err = run(&engine, &m, call(&input), Arc::default())
        .await
        .unwrap_err();
    assert_eq!(err, WasmError::InputTooLarge);
}

/// 1,000 publishes succeed, the 1,001st gets LIMIT.
#[tokio::test]
async fn publish_limit() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(r#"(module
          (import "meshgate" "publish" (func $p (param i32 i32 i32 i32) (result i32)))
          (import "meshgate" "kv_put" (func $put (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (data (i32.const 0) "topic")
          (data (i32.const 16) "last")
          (func (export "_start") (local $i i32)
            (loop
              (if (i32.ne (call $p (i32.const 0) (i32.const 5) (i32.const 0) (i32.const 1)) (i32.const 0))
                (then unreachable))
              (local.set $i (i32.add (local.get $i) (i32.const 1)))
              (br_if 0 (i32.lt_u (local.get $i) (i32.const 1000))))
            (i64.store (i32.const 32)
              (i64.extend_i32_s (call $p (i32.const 0) (i32.const 5) (i32.const 0) (i32.const 1))))
            (drop (call $put (i32.const 16) (i32.const 4) (i32.const 32) (i32.const 8)))))"#))
        .unwrap();
    let host = Arc::new(FakeHost::default());
    let out = run(&engine, &m, call(b""), host.clone()).await.unwrap();
    assert_eq!(out.publishes, MAX_PUBLISHES);
    assert_eq!(host.published.lock().len(), 1000);
    assert_eq!(host.get_i64("last"), codes::LIMIT as i64);
}

/// A guest that invokes "chain" (itself) and logs "ok" or "limit" by the result.
const CHAIN: &str = r#"(module
  (import "meshgate" "invoke" (func $inv (param i32 i32 i32 i32 i32 i32) (result i64)))
  (import "meshgate" "log" (func $log (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "chain")
  (data (i32.const 16) "ok")
  (data (i32.const 32) "limit")
  (func (export "_start")
    (if (i64.eq (call $inv (i32.const 0) (i32.const 5) (i32.const 0) (i32.const 0) (i32.const 64) (i32.const 64))
                (i64.const -4))
      (then (drop (call $log (i32.const 1) (i32.const 32) (i32.const 5))))
      (else (drop (call $log (i32.const 1) (i32.const 16) (i32.const 2)))))))"#;

/// Nested invokes reach depth 5; the call that would be depth 6 gets LIMIT.
#[tokio::test]
async fn nested_depth_obeyed_and_violated() {
    let (engine, _dir) = engine();
    let m = engine.compile(&wat(CHAIN)).unwrap();
    let host = Arc::new(FakeHost::default().with_function("chain", m.clone()));
    let out = run(&engine, &m, call(b""), host).await.unwrap();
    let messages: Vec<&str> = out.logs.iter().map(|l| l.message.as_str()).collect();
    // Depth 5 logs "limit"; depths 4..0 each log "ok" after it.
    assert_eq!(messages, ["limit", "ok", "ok", "ok", "ok", "ok"]);
}

/// A top-level call at depth 6 is refused; at depth 5 it runs.
#[tokio::test]
async fn depth_field_checked() {
    let (engine, _dir) = engine();
    let m = engine.compile(&wat(NOOP)).unwrap();
    let mut c = call(b"");
    c.depth = MAX_DEPTH;
    run(&engine, &m, c.clone(), Arc::default()).await.unwrap();
    c.depth = MAX_DEPTH + 1;
    let err = run(&engine, &m, c, Arc::default()).await.unwrap_err();
    assert_eq!(err, WasmError::DepthExceeded);
}

async fn wait_until(engine: &WasmEngine, pred: impl Fn(&PoolStats) -> bool) {
    for _ in 0..500 {
        if pred(&engine.stats()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("pool never reached the state: {:?}", engine.stats());
}

/// A namespace whose queue is full gets Busy while another namespace is still
/// admitted and served (before the full namespace's own waiting call).
#[tokio::test]
async fn namespace_cap_busy_while_other_namespace_runs() {
    let (engine, _dir) = engine_with(config(2, 16, 1));
    let looping = engine.compile(&wat(INFINITE_LOOP)).unwrap();
    let noop = engine.compile(&wat(NOOP)).unwrap();
    let spawn = |ns: &str, m: &Arc<CompiledModule>, timeout: Duration| {
        let (engine, m) = (engine.clone(), m.clone());
        let mut c = Invocation::new(ns, "f", Vec::new());
        c.timeout = timeout;
        tokio::spawn(async move { engine.invoke(m, c, Arc::new(FakeHost::default())).await })
    };
    // Alone, "a" takes both workers; one more call of it waits (its queue: 1).
    let loops = [
        spawn("a", &looping, Duration::from_millis(500)),
        spawn("a", &looping, Duration::from_millis(500)),
    ];
    wait_until(&engine, |s| s.busy == 2).await;
    let waiting = spawn("a", &noop, Duration::from_secs(5));
    wait_until(&engine, |s| s.queued == 1).await;
    assert_eq!(
        engine.stats().namespaces,
        [NamespaceStats {
            namespace: "a".into(),
            running: 2,
            queued: 1
        }]
    );
    let busy = engine
        .invoke(
            noop.clone(),
            Invocation::new("a", "f", Vec::new()),
            Arc::new(FakeHost::default()),
        )
        .await;
    assert_eq!(busy.unwrap_err(), WasmError::Busy);
    engine
        .invoke(
            noop,
            Invocation::new("b", "f", Vec::new()),
            Arc::new(FakeHost::default()),
        )
        .await
        .unwrap();
    for l in loops {
        assert_eq!(l.await.unwrap().unwrap_err(), WasmError::Timeout);
    }
    waiting.await.unwrap().unwrap();
    wait_until(&engine, |s| s.namespaces.is_empty() && s.busy == 0).await;
}

/// A full node queue answers Overloaded.
#[tokio::test]
async fn queue_full_overloaded() {
    let (engine, _dir) = engine_with(config(1, 1, 10));
    let looping = engine.compile(&wat(INFINITE_LOOP)).unwrap();
    let spawn = |ns: &str| {
        let (engine, m) = (engine.clone(), looping.clone());
        let mut c = Invocation::new(ns, "loop", Vec::new());
        c.timeout = Duration::from_millis(300);
        tokio::spawn(async move { engine.invoke(m, c, Arc::new(FakeHost::default())).await })
    };
    let running = spawn("a");
    wait_until(&engine, |s| s.busy == 1).await;
    let queued = spawn("b");
    wait_until(&engine, |s| s.queued == 1).await;
    let err = engine
        .invoke(
            looping.clone(),
            Invocation::new("c", "f", Vec::new()),
            Arc::new(FakeHost::default()),
        )
        .await
        .unwrap_err();
    assert_eq!(err, WasmError::Overloaded);
    assert_eq!(running.await.unwrap().unwrap_err(), WasmError::Timeout);
    assert_eq!(queued.await.unwrap().unwrap_err(), WasmError::Timeout);
}

/// An import the host does not provide is named in the error.
#[test]
fn unknown_import_named() {
    let (engine, _dir) = engine();
    let err = engine
        .compile(&wat(
            r#"(module (import "env" "foo" (func)) (func (export "_start")))"#,
        ))
        .unwrap_err();
    assert_eq!(err, WasmError::UnknownImport("env::foo".into()));
    let err = engine
        .compile(&wat(
            r#"(module (import "meshgate" "nope" (func)) (func (export "_start")))"#,
        ))
        .unwrap_err();
    assert_eq!(err, WasmError::UnknownImport("meshgate::nope".into()));
}

/// A truncated module is InvalidModule with the compiler's reason.
#[test]
fn truncated_module_invalid() {
    let (engine, _dir) = engine();
    let err = engine.compile(&ECHO[..ECHO.len() / 2]).unwrap_err();
    assert!(
        matches!(err, WasmError::InvalidModule(ref r) if !r.is_empty()),
        "{err:?}"
    );
    let err = engine.compile(b"not wasm at all").unwrap_err();
    assert!(matches!(err, WasmError::InvalidModule(_)), "{err:?}");
}

/// A module without `_start` is not a command module.
#[test]
fn module_without_start_invalid() {
    let (engine, _dir) = engine();
    let err = engine.compile(&wat("(module)")).unwrap_err();
    assert!(matches!(err, WasmError::InvalidModule(_)), "{err:?}");
}

/// A module over max_module_bytes is refused before compiling.
#[test]
fn module_too_large() {
    let (engine, _dir) = engine_with(WasmConfig {
        max_module_bytes: 1024,
        ..config(1, 1, 1)
    });
    let err = engine.compile(ECHO).unwrap_err();
    assert_eq!(
        err,
        WasmError::ModuleTooLarge {
            size: ECHO.len(),
            max: 1024,
            key: "max_module_bytes",
        }
    );
}

/// kv_get with a short buffer returns the length and writes nothing; a big enough one gets the value.
#[tokio::test]
async fn kv_get_buffer_protocol() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(r#"(module
          (import "meshgate" "kv_get" (func $get (param i32 i32 i32 i32) (result i64)))
          (import "meshgate" "kv_put" (func $put (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (data (i32.const 0) "k")
          (data (i32.const 8) "n1n2n3b1b2")
          (data (i32.const 100) "\aa\aa\aa\aa\aa\aa\aa\aa")
          (func (export "_start")
            (i64.store (i32.const 200) (call $get (i32.const 0) (i32.const 1) (i32.const 100) (i32.const 2)))
            (drop (call $put (i32.const 8) (i32.const 2) (i32.const 200) (i32.const 8)))
            (drop (call $put (i32.const 14) (i32.const 2) (i32.const 100) (i32.const 5)))
            (i64.store (i32.const 208) (call $get (i32.const 0) (i32.const 1) (i32.const 100) (i32.const 5)))
            (drop (call $put (i32.const 10) (i32.const 2) (i32.const 208) (i32.const 8)))
            (drop (call $put (i32.const 16) (i32.const 2) (i32.const 100) (i32.const 5)))
            (i64.store (i32.const 216) (call $get (i32.const 8) (i32.const 2) (i32.const 100) (i32.const 5)))
            (drop (call $put (i32.const 12) (i32.const 2) (i32.const 216) (i32.const 8)))))"#))
        .unwrap();
    let host = Arc::new(FakeHost::default());
    host.kv.lock().insert(b"k".to_vec(), b"hello".to_vec());
    run(&engine, &m, call(b""), host.clone()).await.unwrap();
    assert_eq!(host.get_i64("n1"), 5, "short buffer: the length");
    assert_eq!(
        host.get("b1").unwrap(),
        [0xaa; 5],
        "short buffer: nothing written"
    );
    assert_eq!(host.get_i64("n2"), 5);
    assert_eq!(host.get("b2").unwrap(), b"hello");
    // "n1" holds 8 bytes: more than the 5-byte buffer, so just the length.
    assert_eq!(host.get_i64("n3"), 8);
}

/// Out-of-bounds pointers and bad arguments get BAD_ARGUMENT, never a host panic.
#[tokio::test]
async fn out_of_bounds_pointers_bad_argument() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(r#"(module
          (import "meshgate" "publish" (func $pub (param i32 i32 i32 i32) (result i32)))
          (import "meshgate" "kv_get" (func $get (param i32 i32 i32 i32) (result i64)))
          (import "meshgate" "kv_put" (func $put (param i32 i32 i32 i32) (result i32)))
          (import "meshgate" "kv_delete" (func $del (param i32 i32) (result i32)))
          (import "meshgate" "invoke" (func $inv (param i32 i32 i32 i32 i32 i32) (result i64)))
          (import "meshgate" "caller" (func $caller (param i32 i32) (result i64)))
          (import "meshgate" "log" (func $log (param i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (data (i32.const 0) "r")
          (data (i32.const 16) "\ff\fe")
          (func $rec (param $slot i32) (param $v i64)
            (i64.store (i32.add (i32.const 1024) (i32.mul (local.get $slot) (i32.const 8))) (local.get $v)))
          (func (export "_start")
            (call $rec (i32.const 0) (i64.extend_i32_s (call $pub (i32.const -16) (i32.const 100) (i32.const 0) (i32.const 1))))
            (call $rec (i32.const 1) (i64.extend_i32_s (call $pub (i32.const 16) (i32.const 2) (i32.const 0) (i32.const 1))))
            (call $rec (i32.const 2) (call $get (i32.const 0) (i32.const 1) (i32.const 65530) (i32.const 100)))
            (call $rec (i32.const 3) (i64.extend_i32_s (call $put (i32.const 0) (i32.const -1) (i32.const 0) (i32.const 1))))
            (call $rec (i32.const 4) (i64.extend_i32_s (call $del (i32.const 65536) (i32.const 1))))
            (call $rec (i32.const 5) (call $inv (i32.const 0) (i32.const 1) (i32.const -1) (i32.const -1) (i32.const 0) (i32.const 0)))
            (call $rec (i32.const 6) (call $caller (i32.const 65535) (i32.const 2)))
            (call $rec (i32.const 7) (i64.extend_i32_s (call $log (i32.const 1) (i32.const -1) (i32.const 10))))
            (call $rec (i32.const 8) (i64.extend_i32_s (call $log (i32.const 9) (i32.const 0) (i32.const 1))))
            (drop (call $put (i32.const 0) (i32.const 1) (i32.const 1024) (i32.const 72)))))"#))
        .unwrap();
    let host = Arc::new(FakeHost::default());
    run(&engine, &m, call(b""), host.clone()).await.unwrap();
    let record = host.get("r").unwrap();
    let codes: Vec<i64> = record
        .chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(codes, [codes::BAD_ARGUMENT as i64; 9]);
    assert!(host.published.lock().is_empty());
}

/// A second engine on the same cache dir loads the artifact instead of compiling.
#[tokio::test]
async fn cache_hit_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let first = WasmEngine::new(config(1, 4, 4), cache.clone()).unwrap();
    let m = first.compile(ECHO).unwrap();
    assert_eq!((first.cache_hits(), first.cache_misses()), (0, 1));
    drop((m, first));

    let second = WasmEngine::new(config(1, 4, 4), cache).unwrap();
    let m = second.compile(ECHO).unwrap();
    assert_eq!((second.cache_hits(), second.cache_misses()), (1, 0));
    assert_eq!(m.sha256_hex().len(), 64);
    let out = run(&second, &m, call(b"cached"), Arc::default())
        .await
        .unwrap();
    assert_eq!(out.stdout, b"cached");
}

/// `proc_exit(0)` is success, a non-zero exit code is Trapped.
#[tokio::test]
async fn proc_exit_codes() {
    let (engine, _dir) = engine();
    let exit = |code: i32| {
        wat(&format!(
            r#"(module
              (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
              (memory (export "memory") 1)
              (func (export "_start") (call $exit (i32.const {code}))))"#
        ))
    };
    let ok = engine.compile(&exit(0)).unwrap();
    run(&engine, &ok, call(b""), Arc::default()).await.unwrap();
    let bad = engine.compile(&exit(3)).unwrap();
    let err = run(&engine, &bad, call(b""), Arc::default())
        .await
        .unwrap_err();
    assert_eq!(err, WasmError::Trapped("exit code 3".into()));
}

/// The host functions reach the guest's memory both from a start function
/// (run while the instance is made, before the engine keeps its memory) and
/// from `_start` (through the memory kept in the store); a module without a
/// memory export gets an error code from them, no crash.
#[tokio::test]
async fn host_calls_reach_memory_from_start_and_entry() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(r#"(module
          (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (data (i32.const 64) "start,")
          (data (i32.const 80) "entry")
          (func $init
            (i32.store (i32.const 0) (i32.const 64))
            (i32.store (i32.const 4) (i32.const 6))
            (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8))))
          (start $init)
          (func (export "_start")
            (i32.store (i32.const 0) (i32.const 80))
            (i32.store (i32.const 4) (i32.const 5))
            (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"#))
        .unwrap();
    for _ in 0..2 {
        let out = run(&engine, &m, call(b""), Arc::default()).await.unwrap();
        assert_eq!(out.stdout, b"start,entry");
    }
    // No memory export: fd_write's result (stored in the guest's own
    // unexported memory and written out as the exit code) is an error code.
    let m = engine
        .compile(&wat(r#"(module
          (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
          (memory 1)
          (func (export "_start")
            (call $exit (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"#))
        .unwrap();
    let err = run(&engine, &m, call(b""), Arc::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, WasmError::Trapped(m) if m.starts_with("exit code ") && m != "exit code 0"),
        "{err:?}"
    );
}

/// `fd_write` gathers its iovecs in order, two or six; one entry outside
/// memory among six fails the whole call with EFAULT (21) and writes
/// nothing of it.
#[tokio::test]
async fn fd_write_gathers_few_and_many_iovecs() {
    let (engine, _dir) = engine();
    // Iovec arrays: two at 0, six at 100, six with the fifth past memory at
    // 200; then the third call's errno is written out as one byte (iovec at 300).
    let m = engine
        .compile(&wat(r#"(module
          (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (data (i32.const 1000) "abcdef")
          (data (i32.const 0) "\e8\03\00\00\02\00\00\00\ea\03\00\00\01\00\00\00")
          (data (i32.const 100) "\e8\03\00\00\01\00\00\00\e9\03\00\00\01\00\00\00\ea\03\00\00\01\00\00\00\eb\03\00\00\01\00\00\00\ec\03\00\00\01\00\00\00\ed\03\00\00\01\00\00\00")
          (data (i32.const 200) "\e8\03\00\00\01\00\00\00\e9\03\00\00\01\00\00\00\ea\03\00\00\01\00\00\00\eb\03\00\00\01\00\00\00\00\00\01\00\10\00\00\00\ed\03\00\00\01\00\00\00")
          (data (i32.const 300) "\f4\01\00\00\01\00\00\00")
          (func (export "_start")
            (drop (call $w (i32.const 1) (i32.const 0) (i32.const 2) (i32.const 400)))
            (drop (call $w (i32.const 1) (i32.const 100) (i32.const 6) (i32.const 404)))
            (i32.store8 (i32.const 500)
              (call $w (i32.const 1) (i32.const 200) (i32.const 6) (i32.const 408)))
            (drop (call $w (i32.const 1) (i32.const 300) (i32.const 1) (i32.const 412)))))"#))
        .unwrap();
    let out = run(&engine, &m, call(b""), Arc::default()).await.unwrap();
    assert_eq!(
        out.stdout, b"abcabcdef\x15",
        "two, six, then EFAULT (21) and nothing"
    );
}

/// stderr lines and `log` calls become log lines, in order.
#[tokio::test]
async fn stderr_and_log_become_log_lines() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(r#"(module
          (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
          (import "meshgate" "log" (func $log (param i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (data (i32.const 64) "one\ntw")
          (data (i32.const 80) "careful")
          (data (i32.const 96) "o\n")
          (func (export "_start")
            (i32.store (i32.const 0) (i32.const 64))
            (i32.store (i32.const 4) (i32.const 6))
            (drop (call $w (i32.const 2) (i32.const 0) (i32.const 1) (i32.const 8)))
            (drop (call $log (i32.const 2) (i32.const 80) (i32.const 7)))
            (i32.store (i32.const 0) (i32.const 96))
            (i32.store (i32.const 4) (i32.const 2))
            (drop (call $w (i32.const 2) (i32.const 0) (i32.const 1) (i32.const 8)))))"#))
        .unwrap();
    let out = run(&engine, &m, call(b""), Arc::default()).await.unwrap();
    let lines: Vec<(&str, &str)> = out
        .logs
        .iter()
        .map(|l| (l.level.as_str(), l.message.as_str()))
        .collect();
    assert_eq!(
        lines,
        [("info", "one"), ("warn", "careful"), ("info", "two")]
    );
}

/// The `caller` import returns the invocation's caller JSON.
#[tokio::test]
async fn caller_json_returned() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(r#"(module
          (import "meshgate" "caller" (func $caller (param i32 i32) (result i64)))
          (import "meshgate" "kv_put" (func $put (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (data (i32.const 0) "c")
          (func (export "_start")
            (drop (call $put (i32.const 0) (i32.const 1) (i32.const 100)
              (i32.wrap_i64 (call $caller (i32.const 100) (i32.const 256)))))))"#))
        .unwrap();
    let host = Arc::new(FakeHost::default());
    let mut c = call(b"");
    c.caller_json = br#"{"subject":"alice","trigger":"http"}"#.to_vec();
    run(&engine, &m, c.clone(), host.clone()).await.unwrap();
    assert_eq!(host.get("c").unwrap(), c.caller_json);
}

/// The C examples: echo, a KV counter, a publisher and a nested caller.
#[tokio::test]
async fn c_examples() {
    let (engine, _dir) = engine();
    let echo = engine.compile(ECHO).unwrap();
    let counter = engine.compile(COUNTER).unwrap();
    let publisher = engine.compile(PUBLISHER).unwrap();
    let caller = engine.compile(CALLER).unwrap();
    let host = Arc::new(FakeHost::default().with_function("echo", echo.clone()));

    let out = run(&engine, &echo, call(b"hi"), host.clone())
        .await
        .unwrap();
    assert_eq!(out.stdout, b"hi");

    for expected in ["1\n", "2\n"] {
        let out = run(&engine, &counter, call(b""), host.clone())
            .await
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    }
    assert_eq!(host.get("count").unwrap(), b"2");

    let out = run(&engine, &publisher, call(b"evt"), host.clone())
        .await
        .unwrap();
    assert_eq!(out.publishes, 1);
    assert_eq!(
        *host.published.lock(),
        [("events".to_owned(), b"evt".to_vec())]
    );
    assert_eq!(out.logs[0].message, "published to events");

    let big: Vec<u8> = (0..10_000u32).map(|i| (i % 200) as u8).collect();
    let out = run(&engine, &caller, call(&big), host.clone())
        .await
        .unwrap();
    assert_eq!(out.stdout, big, "nested invoke with a buffer retry");
}

/// The environment reaches the guest; no directory is preopened.
#[tokio::test]
async fn env_and_no_preopens() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(r#"(module
          (import "wasi_snapshot_preview1" "environ_sizes_get" (func $sizes (param i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "fd_prestat_get" (func $prestat (param i32 i32) (result i32)))
          (import "meshgate" "kv_put" (func $put (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (data (i32.const 0) "ep")
          (func (export "_start")
            (drop (call $sizes (i32.const 100) (i32.const 104)))
            (i32.store (i32.const 108) (call $prestat (i32.const 3) (i32.const 200)))
            (drop (call $put (i32.const 0) (i32.const 2) (i32.const 100) (i32.const 12)))))"#))
        .unwrap();
    let host = Arc::new(FakeHost::default());
    let mut c = call(b"");
    c.env = vec![("A".into(), "1".into()), ("SECRET".into(), "xyz".into())];
    run(&engine, &m, c, host.clone()).await.unwrap();
    let v = host.get("ep").unwrap();
    let word = |i: usize| u32::from_le_bytes(v[i..i + 4].try_into().unwrap());
    assert_eq!(word(0), 2, "two env vars");
    assert_eq!(word(4), "A=1\0SECRET=xyz\0".len() as u32);
    assert_eq!(word(8), 8, "fd 3 is not preopened: EBADF");
}

proptest::proptest! {
    /// Guest (ptr, len) pairs never panic the host and never leave the memory.
    #[test]
    fn guest_range_stays_in_bounds(ptr: i32, len: i32, size in 0usize..(1 << 33)) {
        if let Some(r) = super::wasi::guest_range(ptr, len, size) {
            proptest::prop_assert!(r.start <= r.end && r.end <= size);
            proptest::prop_assert_eq!(r.start, ptr as u32 as usize);
            proptest::prop_assert_eq!(r.len(), len as u32 as usize);
        } else {
            proptest::prop_assert!(ptr as u32 as u64 + len as u32 as u64 > size as u64);
        }
    }
}

/// The guest-ABI fuzzer's guest: reads its stdin (a selector word and six
/// argument words) and calls one host import with those raw arguments, so the
/// host sees every (pointer, length, capacity) a hostile guest could pass.
const ABI_FUZZER: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_read" (func $read (param i32 i32 i32 i32) (result i32)))
  (import "meshgate" "publish" (func $pub (param i32 i32 i32 i32) (result i32)))
  (import "meshgate" "kv_get" (func $get (param i32 i32 i32 i32) (result i64)))
  (import "meshgate" "kv_put" (func $put (param i32 i32 i32 i32) (result i32)))
  (import "meshgate" "kv_delete" (func $del (param i32 i32) (result i32)))
  (import "meshgate" "invoke" (func $inv (param i32 i32 i32 i32 i32 i32) (result i64)))
  (import "meshgate" "caller" (func $caller (param i32 i32) (result i64)))
  (import "meshgate" "log" (func $log (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func $arg (param $i i32) (result i32)
    (i32.load (i32.add (i32.const 36) (i32.mul (local.get $i) (i32.const 4)))))
  (func (export "_start")
    ;; iovec at 0: 28 bytes of stdin into 32..60 (selector + six words)
    (i32.store (i32.const 0) (i32.const 32))
    (i32.store (i32.const 4) (i32.const 28))
    (drop (call $read (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 8)))
    (block $done
      (block $b6 (block $b5 (block $b4 (block $b3 (block $b2 (block $b1 (block $b0
        (br_table $b0 $b1 $b2 $b3 $b4 $b5 $b6 $b6
          (i32.and (i32.load (i32.const 32)) (i32.const 7))))
        (drop (call $pub (call $arg (i32.const 0)) (call $arg (i32.const 1)) (call $arg (i32.const 2)) (call $arg (i32.const 3))))
        (br $done))
        (drop (call $get (call $arg (i32.const 0)) (call $arg (i32.const 1)) (call $arg (i32.const 2)) (call $arg (i32.const 3))))
        (br $done))
        (drop (call $put (call $arg (i32.const 0)) (call $arg (i32.const 1)) (call $arg (i32.const 2)) (call $arg (i32.const 3))))
        (br $done))
        (drop (call $del (call $arg (i32.const 0)) (call $arg (i32.const 1))))
        (br $done))
        (drop (call $inv (call $arg (i32.const 0)) (call $arg (i32.const 1)) (call $arg (i32.const 2))
                         (call $arg (i32.const 3)) (call $arg (i32.const 4)) (call $arg (i32.const 5))))
        (br $done))
        (drop (call $caller (call $arg (i32.const 0)) (call $arg (i32.const 1))))
        (br $done))
      (drop (call $log (call $arg (i32.const 0)) (call $arg (i32.const 1)) (call $arg (i32.const 2)))))))"#;

/// An argument word biased toward the edges: in and around the one page of
/// memory, the sign bit, zero and the maximum.
fn abi_word() -> impl proptest::strategy::Strategy<Value = i32> {
    use proptest::prelude::*;
    prop_oneof![
        0i32..128,
        65_400i32..65_600,
        Just(-1),
        Just(i32::MIN),
        Just(i32::MAX),
        any::<i32>(),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(3000))]
    /// Thousands of generated host calls with hostile arguments: each
    /// invocation ends (success or a guest error), the host never panics, and
    /// the engine still runs a well-behaved guest afterwards (checked below).
    #[test]
    fn guest_abi_arguments_never_panic_the_host(
        selector in 0u32..8,
        args in proptest::collection::vec(abi_word(), 6),
    ) {
        let (rt, engine, module, host) = &*ABI_FUZZ;
        let mut input = selector.to_le_bytes().to_vec();
        for a in &args {
            input.extend_from_slice(&a.to_le_bytes());
        }
        let out = rt.block_on(run(engine, module, call(&input), host.clone()));
        // A guest's bad argument is answered inside the guest (a code), so the
        // invocation itself succeeds; only a panic or a dead worker would fail.
        proptest::prop_assert!(out.is_ok(), "selector {selector} args {args:?}: {:?}", out.err());
    }
}

static ABI_FUZZ: std::sync::LazyLock<(
    tokio::runtime::Runtime,
    WasmEngine,
    Arc<CompiledModule>,
    Arc<FakeHost>,
)> = std::sync::LazyLock::new(|| {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (engine, dir) = rt.block_on(async { engine() });
    // The cache folder lives as long as the test binary.
    std::mem::forget(dir);
    let module = engine.compile(&wat(ABI_FUZZER)).unwrap();
    (rt, engine, module, Arc::new(FakeHost::default()))
});

/// After the fuzzer's calls the same engine still runs the echo guest.
#[test]
fn engine_survives_the_abi_fuzzer() {
    let (rt, engine, module, host) = &*ABI_FUZZ;
    for selector in 0u32..8 {
        let mut input = selector.to_le_bytes().to_vec();
        for a in [-1i32, i32::MAX, 65_535, 1 << 20, 0, -7] {
            input.extend_from_slice(&a.to_le_bytes());
        }
        rt.block_on(run(engine, module, call(&input), host.clone()))
            .unwrap();
    }
    let echo = engine.compile(ECHO).unwrap();
    let out = rt
        .block_on(run(engine, &echo, call(b"still here"), host.clone()))
        .unwrap();
    assert_eq!(out.stdout, b"still here");
}

/// A file that is neither a WebAssembly binary nor WAT text is named as such,
/// not with a WAT parser's message; bad WAT and a bad binary say which.
#[test]
fn non_module_named_plainly() {
    let (engine, _dir) = engine();
    let msg = |bytes: &[u8]| match engine.compile(bytes) {
        Err(WasmError::InvalidModule(m)) => m,
        other => panic!("expected INVALID_MODULE, got {:?}", other.map(|_| ())),
    };
    let m = msg(b"PK\x03\x04 a zip file");
    assert!(
        m.starts_with("not a WebAssembly module (no \\0asm header"),
        "{m}"
    );
    assert!(!m.contains("-->"), "no parser position: {m}");
    assert!(msg(b"hello").starts_with("not a WebAssembly module"));
    assert!(msg(b"(module (func $f (bogus)))").starts_with("not valid WAT text"));
    assert!(msg(b"\0asm\x01\0\0\0\xff").starts_with("not a valid WebAssembly binary"));
}

// --- Fair share of the pool -------------------------------------------------

/// A guest that calls `kv_get` once: with a [`GateHost`] it holds its worker
/// until the test lets it go.
const GATED: &str = r#"(module
  (import "meshgate" "kv_get" (func $get (param i32 i32 i32 i32) (result i64)))
  (memory (export "memory") 1)
  (func (export "_start")
    (drop (call $get (i32.const 0) (i32.const 1) (i32.const 16) (i32.const 16)))))"#;

#[derive(Default)]
struct GateState {
    /// Labels of the gated calls in the order they started on a worker.
    started: Vec<String>,
    /// Calls that may leave the gate.
    permits: usize,
}

/// Holds gated guests on their worker until the test opens it.
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    cv: parking_lot::Condvar,
}

impl Gate {
    /// Lets `n` gated calls finish.
    fn open(&self, n: usize) {
        self.state.lock().permits += n;
        self.cv.notify_all();
    }

    fn started(&self) -> Vec<String> {
        self.state.lock().started.clone()
    }

    /// Waits (10 s at most) until `n` gated calls have started.
    async fn wait_started(&self, n: usize) {
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while self.state.lock().started.len() < n {
            assert!(
                std::time::Instant::now() < end,
                "only {:?} started, waited for {n}",
                self.started()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

struct GateHost {
    label: String,
    gate: Arc<Gate>,
}

impl HostApi for GateHost {
    fn kv_get(&self, _: &[u8]) -> Result<Option<Vec<u8>>, HostError> {
        let mut state = self.gate.state.lock();
        state.started.push(self.label.clone());
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while state.permits == 0 {
            if self.gate.cv.wait_until(&mut state, end).timed_out() {
                return Err(HostError::Internal("the gate never opened".into()));
            }
        }
        state.permits -= 1;
        Ok(None)
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

fn config_wait(workers: usize, namespace_queue: usize, wait: Duration) -> WasmConfig {
    WasmConfig {
        queue_wait: wait,
        ..config(workers, 256, namespace_queue)
    }
}

type Pending = tokio::task::JoinHandle<Result<InvokeOutput>>;

/// Starts a gated call of namespace `ns` (its gate label is `ns` too).
fn gated(engine: &WasmEngine, m: &Arc<CompiledModule>, gate: &Arc<Gate>, ns: &str) -> Pending {
    let (engine, m) = (engine.clone(), m.clone());
    let host = Arc::new(GateHost {
        label: ns.to_owned(),
        gate: gate.clone(),
    });
    let c = Invocation::new(ns, "gated", Vec::new());
    tokio::spawn(async move { engine.invoke(m, c, host).await })
}

fn ns_stats(engine: &WasmEngine, ns: &str) -> (usize, usize) {
    engine
        .stats()
        .namespaces
        .iter()
        .find(|n| n.namespace == ns)
        .map_or((0, 0), |n| (n.running, n.queued))
}

/// Fair share, obeyed: a namespace alone on a 2-worker pool sends a burst of
/// 32 concurrent calls of the C echo guest at the default queue settings;
/// none is refused, every answer is right.
#[tokio::test]
async fn lone_namespace_burst_all_complete() {
    let (engine, _dir) = engine_with(WasmConfig {
        workers: 2,
        ..WasmConfig::default()
    });
    let echo = engine.compile(ECHO).unwrap();
    let calls: Vec<Pending> = (0..32)
        .map(|i| {
            let (engine, m) = (engine.clone(), echo.clone());
            let c = Invocation::new("lone", "echo", format!("call {i}").into_bytes());
            tokio::spawn(async move { engine.invoke(m, c, Arc::new(FakeHost::default())).await })
        })
        .collect();
    for (i, c) in calls.into_iter().enumerate() {
        let out = c.await.unwrap().unwrap_or_else(|e| panic!("call {i}: {e}"));
        assert_eq!(out.stdout, format!("call {i}").into_bytes());
    }
    wait_until(&engine, |s| s.namespaces.is_empty() && s.busy == 0).await;
}

/// Fair share, violated: a lone namespace holds every worker, fills its queue
/// (bound 4) and the call after that is refused with Busy at once.
#[tokio::test]
async fn lone_namespace_uses_every_worker_then_its_queue_bounds_it() {
    let (engine, _dir) = engine_with(config_wait(2, 4, Duration::from_secs(10)));
    let m = engine.compile(&wat(GATED)).unwrap();
    let gate = Arc::new(Gate::default());
    let mut calls: Vec<Pending> = (0..2).map(|_| gated(&engine, &m, &gate, "a")).collect();
    gate.wait_started(2).await;
    calls.extend((0..4).map(|_| gated(&engine, &m, &gate, "a")));
    wait_until(&engine, |s| s.queued == 4).await;
    assert_eq!(ns_stats(&engine, "a"), (2, 4), "both workers, 4 waiting");
    let refused = engine
        .invoke(
            m.clone(),
            Invocation::new("a", "gated", Vec::new()),
            Arc::new(FakeHost::default()),
        )
        .await;
    assert_eq!(refused.unwrap_err(), WasmError::Busy);
    gate.open(6);
    for c in calls {
        c.await.unwrap().unwrap();
    }
    assert_eq!(gate.started().len(), 6, "the refused call never ran");
}

/// Two namespaces flooding a 2-worker pool: as soon as both wait, each holds
/// one worker, after every single completion, whichever finished.
#[tokio::test]
async fn two_namespaces_flooding_split_the_workers() {
    let (engine, _dir) = engine_with(config_wait(2, 64, Duration::from_secs(10)));
    let m = engine.compile(&wat(GATED)).unwrap();
    let gate = Arc::new(Gate::default());
    let mut calls: Vec<Pending> = (0..2).map(|_| gated(&engine, &m, &gate, "a")).collect();
    gate.wait_started(2).await;
    calls.extend((0..8).map(|_| gated(&engine, &m, &gate, "a")));
    wait_until(&engine, |s| s.queued == 8).await;
    calls.extend((0..8).map(|_| gated(&engine, &m, &gate, "b")));
    wait_until(&engine, |s| s.queued == 16).await;
    assert_eq!(ns_stats(&engine, "a"), (2, 8));
    // Each step frees one worker (whichever call the gate lets go first, an
    // a's or a b's: thread timing decides). While both namespaces still have
    // calls waiting after the pick, they had them before it too, and the
    // freed worker must have gone to the one it left: one running each.
    let mut checked = 0;
    for step in 1..=10 {
        gate.open(1);
        gate.wait_started(2 + step).await;
        let (a, b) = (ns_stats(&engine, "a"), ns_stats(&engine, "b"));
        if a.1 > 0 && b.1 > 0 {
            checked += 1;
            assert_eq!(
                (a.0, b.0),
                (1, 1),
                "step {step}: started {:?}",
                gate.started()
            );
        }
    }
    // 16 waiting calls, one started per step: both still wait after the
    // first 7 steps at least.
    assert!(
        checked >= 7,
        "only {checked} steps had both namespaces waiting"
    );
    // A FIFO would have started all of a's 8 waiting calls first.
    assert_eq!(gate.started()[2], "b", "the first freed worker went to b");
    gate.open(16);
    for c in calls {
        c.await.unwrap().unwrap();
    }
}

/// Spare thread, obeyed: namespace a holds both workers of a 2-worker pool
/// with long calls and 4 more waiting; namespace b's call starts at once on
/// the spare thread and ends while all of a's still hold theirs. The spare
/// thread never runs a call of a (a has calls running): a stays at 2.
#[tokio::test]
async fn another_namespace_starts_on_the_spare_thread_at_once() {
    let (engine, _dir) = engine_with(WasmConfig {
        spare_workers: 1,
        ..config_wait(2, 64, Duration::from_secs(10))
    });
    assert_eq!(engine.stats().workers, 3, "two workers and a spare thread");
    let m = engine.compile(&wat(GATED)).unwrap();
    let gate = Arc::new(Gate::default());
    let mut calls: Vec<Pending> = (0..6).map(|_| gated(&engine, &m, &gate, "a")).collect();
    gate.wait_started(2).await;
    wait_until(&engine, |s| s.queued == 4).await;
    assert_eq!(
        ns_stats(&engine, "a"),
        (2, 4),
        "a on both workers, the spare idle"
    );
    assert_eq!(engine.stats().busy, 2);
    // b's call is not gated: it runs and answers with a's calls all held.
    let noop = engine.compile(&wat(NOOP)).unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        engine.invoke(
            noop,
            Invocation::new("b", "f", Vec::new()),
            Arc::new(FakeHost::default()),
        ),
    )
    .await
    .expect("b ran without waiting for a's calls")
    .unwrap();
    assert_eq!(ns_stats(&engine, "a"), (2, 4), "a's calls still held");
    assert_eq!(gate.started(), ["a", "a"]);
    // Each of a's calls that ends lets one waiting call of a start, never two.
    for step in 1..=4 {
        gate.open(1);
        gate.wait_started(2 + step).await;
        assert!(ns_stats(&engine, "a").0 <= 2, "step {step}: a on the spare");
    }
    gate.open(2);
    for c in calls.drain(..) {
        c.await.unwrap().unwrap();
    }
}

/// Spare thread, violated: with every thread taken (a on the two workers, b
/// on the spare), a third namespace's call waits in its queue, and is the
/// next to start when a thread frees (it has nothing running).
#[tokio::test]
async fn a_third_namespace_waits_when_the_spare_is_taken() {
    let (engine, _dir) = engine_with(WasmConfig {
        spare_workers: 1,
        ..config_wait(2, 64, Duration::from_secs(10))
    });
    let m = engine.compile(&wat(GATED)).unwrap();
    let gate = Arc::new(Gate::default());
    let mut calls: Vec<Pending> = (0..3).map(|_| gated(&engine, &m, &gate, "a")).collect();
    gate.wait_started(2).await;
    wait_until(&engine, |s| s.queued == 1).await;
    calls.push(gated(&engine, &m, &gate, "b"));
    gate.wait_started(3).await;
    calls.push(gated(&engine, &m, &gate, "c"));
    wait_until(&engine, |s| s.queued == 2).await;
    assert_eq!(engine.stats().busy, 3);
    assert_eq!(ns_stats(&engine, "b"), (1, 0), "b on the spare");
    assert_eq!(ns_stats(&engine, "c"), (0, 1), "c waits: no thread free");
    gate.open(1);
    gate.wait_started(4).await;
    assert_eq!(gate.started()[3], "c", "the freed thread went to c");
    gate.open(2);
    for c in calls {
        c.await.unwrap().unwrap();
    }
}

/// Round-robin order on one worker: a namespace's full queue refuses it (Busy)
/// while another namespace is still admitted, and served in its turn.
#[tokio::test]
async fn full_namespace_queue_busy_other_namespace_admitted() {
    let (engine, _dir) = engine_with(config_wait(1, 2, Duration::from_secs(10)));
    let m = engine.compile(&wat(GATED)).unwrap();
    let gate = Arc::new(Gate::default());
    let mut calls = vec![gated(&engine, &m, &gate, "a")];
    gate.wait_started(1).await;
    calls.push(gated(&engine, &m, &gate, "a"));
    calls.push(gated(&engine, &m, &gate, "a"));
    wait_until(&engine, |s| s.queued == 2).await;
    let refused = engine
        .invoke(
            m.clone(),
            Invocation::new("a", "gated", Vec::new()),
            Arc::new(FakeHost::default()),
        )
        .await;
    assert_eq!(refused.unwrap_err(), WasmError::Busy);
    calls.push(gated(&engine, &m, &gate, "b"));
    wait_until(&engine, |s| s.queued == 3).await;
    assert_eq!(ns_stats(&engine, "b"), (0, 1), "b admitted");
    gate.open(4);
    for c in calls {
        c.await.unwrap().unwrap();
    }
    assert_eq!(gate.started(), ["a", "a", "b", "a"]);
}

/// Invokes a gated call of namespace `a` while the only worker is held and
/// asserts it is refused with Busy, no sooner than `queue_wait` (150 ms) and
/// not never (10 s at most); `what` names the call in a failure.
async fn refused_after_150ms(engine: &WasmEngine, m: &Arc<CompiledModule>, what: &str) {
    let t = std::time::Instant::now();
    let call = engine.invoke(
        m.clone(),
        Invocation::new("a", "gated", Vec::new()),
        Arc::new(FakeHost::default()),
    );
    let out = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .unwrap_or_else(|_| panic!("{what} was never refused"));
    assert_eq!(out.unwrap_err(), WasmError::Busy, "{what}");
    assert!(
        t.elapsed() >= Duration::from_millis(150),
        "{what}: {:?}",
        t.elapsed()
    );
}

/// Wait deadline, violated: a call that waits past `queue_wait` (150 ms) for
/// the only worker is refused with Busy while that worker is still held.
#[tokio::test]
async fn queued_past_wait_deadline_busy() {
    let (engine, _dir) = engine_with(config_wait(1, 64, Duration::from_millis(150)));
    let m = engine.compile(&wat(GATED)).unwrap();
    let gate = Arc::new(Gate::default());
    let holder = gated(&engine, &m, &gate, "a");
    gate.wait_started(1).await;
    refused_after_150ms(&engine, &m, "the late call").await;
    assert_eq!(engine.stats().busy, 1, "refused while the worker is held");
    assert_eq!(engine.stats().queued, 0);
    gate.open(1);
    holder.await.unwrap().unwrap();
    assert_eq!(gate.started(), ["a"]);
}

/// Wait deadline, violated again and again: the queue timer is woken only
/// when it sleeps with no deadline, so a call queued while it sleeps until
/// the deadline of a call that has since left the queue (D), and one queued
/// after the queue emptied (E), are each refused once their own
/// `queue_wait` (150 ms) has passed, not left waiting.
#[tokio::test]
async fn every_call_past_its_wait_deadline_is_refused() {
    let (engine, _dir) = engine_with(config_wait(1, 64, Duration::from_millis(150)));
    let m = engine.compile(&wat(GATED)).unwrap();
    let gate = Arc::new(Gate::default());
    let holder = gated(&engine, &m, &gate, "a");
    gate.wait_started(1).await;
    // C waits; the timer now sleeps until C's deadline.
    let c = gated(&engine, &m, &gate, "a");
    wait_until(&engine, |s| s.queued == 1).await;
    // The holder ends and C takes the worker: the timer's deadline is stale.
    gate.open(1);
    holder.await.unwrap().unwrap();
    gate.wait_started(2).await;
    refused_after_150ms(
        &engine,
        &m,
        "D, queued while the timer waits for C's deadline",
    )
    .await;
    refused_after_150ms(&engine, &m, "E, queued after the queue emptied").await;
    assert_eq!(engine.stats().queued, 0);
    gate.open(1);
    c.await.unwrap().unwrap();
    assert_eq!(gate.started(), ["a", "a"]);
}

/// Wait deadline, obeyed: a call that gets a worker within `queue_wait` runs.
#[tokio::test]
async fn queued_within_wait_deadline_runs() {
    let (engine, _dir) = engine_with(config_wait(1, 64, Duration::from_secs(10)));
    let m = engine.compile(&wat(GATED)).unwrap();
    let gate = Arc::new(Gate::default());
    let holder = gated(&engine, &m, &gate, "a");
    gate.wait_started(1).await;
    let waiting = gated(&engine, &m, &gate, "a");
    wait_until(&engine, |s| s.queued == 1).await;
    gate.open(2);
    holder.await.unwrap().unwrap();
    waiting.await.unwrap().unwrap();
    assert_eq!(gate.started(), ["a", "a"]);
}

/// Nested invokes run inline on their worker: a chain of depth 5 completes on
/// a 1-worker pool with another namespace's call waiting for that worker.
#[tokio::test]
async fn nested_invoke_with_every_worker_busy() {
    let (engine, _dir) = engine_with(config_wait(1, 64, Duration::from_secs(10)));
    let gated_m = engine.compile(&wat(GATED)).unwrap();
    let chain = engine.compile(&wat(CHAIN)).unwrap();
    let gate = Arc::new(Gate::default());
    let holder = gated(&engine, &gated_m, &gate, "x");
    gate.wait_started(1).await;
    let nested = {
        let (engine, m) = (engine.clone(), chain.clone());
        let host = Arc::new(FakeHost::default().with_function("chain", chain.clone()));
        tokio::spawn(async move { engine.invoke(m, call(b""), host).await })
    };
    let other = gated(&engine, &gated_m, &gate, "y");
    wait_until(&engine, |s| s.queued == 2).await;
    gate.open(2);
    let out = tokio::time::timeout(Duration::from_secs(10), nested)
        .await
        .expect("the nested chain finished")
        .unwrap()
        .unwrap();
    let messages: Vec<&str> = out.logs.iter().map(|l| l.message.as_str()).collect();
    assert_eq!(messages, ["limit", "ok", "ok", "ok", "ok", "ok"]);
    holder.await.unwrap().unwrap();
    other.await.unwrap().unwrap();
}

/// Calls arriving together at an idle pool all take a worker, whatever the
/// namespace's queue bound (1 here): the bound counts calls that will wait,
/// not calls an idle worker has yet to pick up. The fifth call, with all four
/// workers taken, waits in the queue; the sixth is refused.
#[tokio::test]
async fn simultaneous_calls_take_idle_workers_past_the_queue_bound() {
    let (engine, _dir) = engine_with(config_wait(4, 1, Duration::from_secs(10)));
    let m = engine.compile(&wat(GATED)).unwrap();
    let gate = Arc::new(Gate::default());
    // Submitted back to back from one task: the workers have no time to
    // pick the first ones up before the next arrive.
    let mut calls: Vec<_> = (0..5)
        .map(|_| {
            let host = Arc::new(GateHost {
                label: "a".into(),
                gate: gate.clone(),
            });
            Box::pin(engine.invoke(m.clone(), Invocation::new("a", "gated", Vec::new()), host))
        })
        .collect();
    let refused = Box::pin(engine.invoke(
        m.clone(),
        Invocation::new("a", "gated", Vec::new()),
        Arc::new(FakeHost::default()),
    ));
    for c in calls.iter_mut() {
        // The first poll submits; none can finish while the gate is shut.
        assert!(futures_poll_once(c).await.is_none());
    }
    assert_eq!(refused.await.unwrap_err(), WasmError::Busy);
    gate.wait_started(4).await;
    assert_eq!(ns_stats(&engine, "a"), (4, 1));
    gate.open(5);
    for c in calls {
        c.await.unwrap();
    }
}

/// Polls `f` once: `Some` if it finished.
async fn futures_poll_once<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match std::pin::Pin::new(&mut *f).poll(cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        })
    })
    .await
}

/// A guest that sleeps `secs` seconds: one relative clock subscription of
/// the monotonic clock through `poll_oneoff` (its event at 100, the count
/// at 200).
fn sleeper(secs: u64) -> Vec<u8> {
    let nanos = secs * 1_000_000_000;
    wat(&format!(
        r#"(module
          (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (func (export "_start")
            (i32.store (i32.const 16) (i32.const 1))
            (i64.store (i32.const 24) (i64.const {nanos}))
            (drop (call $poll (i32.const 0) (i32.const 100) (i32.const 1) (i32.const 200)))))"#
    ))
}

/// A module whose only imports are `import` (WAT text of one import line).
fn importing(import: &str) -> Vec<u8> {
    wat(&format!(
        r#"(module {import} (memory (export "memory") 1) (func (export "_start")))"#
    ))
}

/// A module runs on its caller's thread only when it can neither wait nor
/// act outside its own store: WASI streams, env, clocks, randomness and the
/// `caller` and `log` imports; never with a sleep, KV, publish or nested call.
#[test]
fn only_pure_modules_may_run_on_the_callers_thread() {
    let (engine, _dir) = engine();
    assert!(engine.compile(ECHO).unwrap().runs_here(), "the C echo");
    assert!(engine.compile(&wat(INFINITE_LOOP)).unwrap().runs_here());
    for pure in [
        r#"(import "meshgate" "log" (func (param i32 i32 i32) (result i32)))"#,
        r#"(import "meshgate" "caller" (func (param i32 i32) (result i64)))"#,
        r#"(import "wasi_snapshot_preview1" "random_get" (func (param i32 i32) (result i32)))"#,
    ] {
        assert!(
            engine.compile(&importing(pure)).unwrap().runs_here(),
            "{pure}"
        );
    }
    for impure in [
        r#"(import "wasi_snapshot_preview1" "poll_oneoff" (func (param i32 i32 i32 i32) (result i32)))"#,
        r#"(import "meshgate" "kv_get" (func (param i32 i32 i32 i32) (result i64)))"#,
        r#"(import "meshgate" "kv_put" (func (param i32 i32 i32 i32) (result i32)))"#,
        r#"(import "meshgate" "kv_delete" (func (param i32 i32) (result i32)))"#,
        r#"(import "meshgate" "publish" (func (param i32 i32 i32 i32) (result i32)))"#,
        r#"(import "meshgate" "invoke" (func (param i32 i32 i32 i32 i32 i32) (result i64)))"#,
    ] {
        assert!(
            !engine.compile(&importing(impure)).unwrap().runs_here(),
            "{impure}"
        );
    }
}

/// With the one worker busy with namespace `other`, a pure call of `ns` is
/// answered at its first poll (it ran on this thread) while a pure call of
/// `other` (which holds every worker) is not; a call of `ns` that puts a KV
/// key waits for the worker, and while it waits a pure call queues behind it
/// instead of overtaking it.
#[test]
fn a_pure_call_runs_on_the_callers_thread_unless_a_call_of_its_namespace_waits() {
    use futures_util::FutureExt;
    let mut cfg = config(1, 16, 4);
    cfg.spare_workers = 0;
    let (engine, _dir) = engine_with(cfg);
    // The worker sleeps (no CPU) until its 30 s deadline: the asserts below
    // run while it holds the worker, however slow the machine.
    let sleeping = engine.compile(&sleeper(600)).unwrap();
    let blocker = {
        let engine = engine.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let mut c = Invocation::new("other", "f", Vec::new());
            c.timeout = Duration::from_secs(30);
            rt.block_on(engine.invoke(sleeping, c, Arc::new(FakeHost::default())))
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while engine.stats().busy == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the worker never started"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let echo = engine.compile(ECHO).unwrap();
    let host: Arc<dyn HostApi> = Arc::new(FakeHost::default());
    let out = engine
        .invoke_here(echo.clone(), call(b"hi"), host.clone())
        .now_or_never()
        .expect("answered at the first poll")
        .unwrap();
    assert_eq!(out.stdout, b"hi");
    let other = Invocation::new("other", "f", b"hi".to_vec());
    assert!(
        engine
            .invoke_here(echo.clone(), other, host.clone())
            .now_or_never()
            .is_none(),
        "a namespace holding every worker does not also run here"
    );

    let put = engine
        .compile(&wat(r#"(module
          (import "meshgate" "kv_put" (func $put (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (data (i32.const 0) "k")
          (func (export "_start") (drop (call $put (i32.const 0) (i32.const 1) (i32.const 0) (i32.const 1)))))"#))
        .unwrap();
    let mut waiting = Box::pin(engine.invoke_here(put, call(b""), host.clone()));
    assert!(
        (&mut waiting).now_or_never().is_none(),
        "a KV call waits for the worker"
    );
    // It and `other`'s call (dropped, but waiting until a worker finds its
    // caller gone).
    assert_eq!(engine.stats().queued, 2);
    assert!(
        engine
            .invoke_here(echo.clone(), call(b"hi"), host.clone())
            .now_or_never()
            .is_none(),
        "a pure call does not overtake a waiting one of its namespace"
    );
    // A namespace with nothing running and nothing waiting: its first call
    // is the one the fair order serves first, so it runs here at once.
    let quiet = Invocation::new("quiet", "f", b"hi".to_vec());
    let out = engine
        .invoke_here(echo, quiet, host)
        .now_or_never()
        .expect("a quiet namespace's first call answers at the first poll")
        .unwrap();
    assert_eq!(out.stdout, b"hi");
    // The KV call and the two dropped ones (the refused pure call went to
    // the queue) still wait: the quiet call took no worker and no place in line.
    assert_eq!(engine.stats().queued, 3, "and the waiting calls still wait");
    drop(waiting);
    // The sleeper ends at its deadline; the test does not wait for it.
    drop(blocker);
}

/// A pure guest that outlasts the budget on the caller's thread is stopped
/// and runs again from the start on the pool: one answer, one set of log
/// lines (the stopped run's are dropped). A module slow three runs in a row
/// goes to the pool, and comes back once a run there is short. The guest
/// loops a million times per the value of its input's first byte.
#[test]
fn a_pure_call_over_its_budget_runs_again_on_the_pool_and_shows_once() {
    let (engine, _dir) = engine();
    let slow = engine
        .compile(&wat(r#"(module
          (import "meshgate" "log" (func $log (param i32 i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "fd_read" (func $r (param i32 i32 i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (data (i32.const 64) "started")
          (data (i32.const 80) "done")
          (func (export "_start") (local i32) (local $n i32)
            (drop (call $log (i32.const 1) (i32.const 64) (i32.const 7)))
            (i32.store (i32.const 0) (i32.const 200))
            (i32.store (i32.const 4) (i32.const 1))
            (drop (call $r (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 8)))
            (local.set $n (i32.mul (i32.load8_u (i32.const 200)) (i32.const 1000000)))
            (block $end (loop
              (br_if $end (i32.ge_u (local.get 0) (local.get $n)))
              (local.set 0 (i32.add (local.get 0) (i32.const 1)))
              (br 0)))
            (i32.store (i32.const 0) (i32.const 80))
            (i32.store (i32.const 4) (i32.const 4))
            (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"#))
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let host: Arc<dyn HostApi> = Arc::new(FakeHost::default());
    let go = |input: &[u8]| {
        let out = rt
            .block_on(engine.invoke_here(slow.clone(), call(input), host.clone()))
            .unwrap();
        assert_eq!(out.stdout, b"done");
        let logs: Vec<&str> = out.logs.iter().map(|l| l.message.as_str()).collect();
        assert_eq!(logs, ["started"], "the stopped run left no line");
    };
    // 150 million turns: far past two 5 ms ticks.
    assert!(slow.runs_here());
    go(&[150]);
    assert_eq!(slow.long_runs(), 2, "stopped here, then long on the pool");
    assert!(slow.runs_here());
    go(&[150]);
    assert_eq!(slow.long_runs(), 4);
    assert!(!slow.runs_here(), "slow three times in a row: the pool");
    // A short run (on the pool) brings it back. A run of nothing is short
    // unless this thread is descheduled meanwhile (a loaded machine), so
    // one of a few tries is.
    for _ in 0..50 {
        go(&[0]);
        if slow.long_runs() == 0 {
            break;
        }
    }
    assert_eq!(slow.long_runs(), 0, "no short run in 50");
    assert!(slow.runs_here());
}

/// What our WASI preview 1 answers: stdin read to its end, env strings,
/// a closed stdout refusing writes (EBADF), an iovec outside memory
/// (EFAULT), the realtime clock near the host's, randomness filled, a
/// stream that cannot seek (ESPIPE), the CPU clocks refused (EBADF), and a
/// sleep of 1 ms that ends.
#[tokio::test]
async fn wasi_preview1_answers() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(r#"(module
          (import "wasi_snapshot_preview1" "fd_read" (func $read (param i32 i32 i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "fd_close" (func $close (param i32) (result i32)))
          (import "wasi_snapshot_preview1" "fd_seek" (func $seek (param i32 i64 i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "environ_get" (func $env (param i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "clock_time_get" (func $clock (param i32 i64 i32) (result i32)))
          (import "wasi_snapshot_preview1" "random_get" (func $random (param i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll (param i32 i32 i32 i32) (result i32)))
          (import "meshgate" "kv_put" (func $put (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (data (i32.const 0) "res")
          (func $word (param $at i32) (param $v i32)
            (i32.store (i32.add (i32.const 1024) (i32.mul (local.get $at) (i32.const 4))) (local.get $v)))
          (func (export "_start")
            ;; stdin: two reads of 4 bytes into 2000.., then one that finds the end
            (i32.store (i32.const 100) (i32.const 2000))
            (i32.store (i32.const 104) (i32.const 4))
            (call $word (i32.const 0) (call $read (i32.const 0) (i32.const 100) (i32.const 1) (i32.const 200)))
            (call $word (i32.const 1) (i32.load (i32.const 200)))
            (i32.store (i32.const 100) (i32.const 2004))
            (drop (call $read (i32.const 0) (i32.const 100) (i32.const 1) (i32.const 200)))
            (call $word (i32.const 2) (i32.load (i32.const 200)))
            (drop (call $read (i32.const 0) (i32.const 100) (i32.const 1) (i32.const 200)))
            (call $word (i32.const 3) (i32.load (i32.const 200)))
            ;; env: pointers at 300.., strings at 3000..
            (call $word (i32.const 4) (call $env (i32.const 300) (i32.const 3000)))
            (call $word (i32.const 5) (i32.sub (i32.load (i32.const 304)) (i32.load (i32.const 300))))
            ;; an iovec pointing past memory: EFAULT
            (i32.store (i32.const 100) (i32.const 65530))
            (i32.store (i32.const 104) (i32.const 100))
            (call $word (i32.const 6) (call $write (i32.const 1) (i32.const 100) (i32.const 1) (i32.const 200)))
            ;; close stdout, then write to it: EBADF; close it again: EBADF
            (call $word (i32.const 7) (call $close (i32.const 1)))
            (i32.store (i32.const 100) (i32.const 2000))
            (i32.store (i32.const 104) (i32.const 4))
            (call $word (i32.const 8) (call $write (i32.const 1) (i32.const 100) (i32.const 1) (i32.const 200)))
            (call $word (i32.const 9) (call $close (i32.const 1)))
            ;; seek on stdin: ESPIPE; on fd 9: EBADF
            (call $word (i32.const 10) (call $seek (i32.const 0) (i64.const 0) (i32.const 0) (i32.const 200)))
            (call $word (i32.const 11) (call $seek (i32.const 9) (i64.const 0) (i32.const 0) (i32.const 200)))
            ;; realtime clock, in seconds, at 400; the process CPU clock: EBADF
            (call $word (i32.const 12) (call $clock (i32.const 0) (i64.const 1) (i32.const 400)))
            (call $word (i32.const 13) (i32.wrap_i64 (i64.div_u (i64.load (i32.const 400)) (i64.const 1000000000))))
            (call $word (i32.const 14) (call $clock (i32.const 2) (i64.const 1) (i32.const 400)))
            ;; 64 random bytes at 500: any word not zero
            (call $word (i32.const 15) (call $random (i32.const 500) (i32.const 64)))
            (call $word (i32.const 16) (i32.or (i32.or (i64.ne (i64.load (i32.const 500)) (i64.const 0))
                                                       (i64.ne (i64.load (i32.const 508)) (i64.const 0)))
                                              (i64.ne (i64.load (i32.const 516)) (i64.const 0))))
            ;; one clock subscription of 1 ms (relative) at 600, event at 700
            (i64.store (i32.const 600) (i64.const 42))
            (i32.store8 (i32.const 608) (i32.const 0))
            (i32.store (i32.const 616) (i32.const 1))
            (i64.store (i32.const 624) (i64.const 1000000))
            (i64.store (i32.const 632) (i64.const 0))
            (i32.store16 (i32.const 640) (i32.const 0))
            (call $word (i32.const 17) (call $poll (i32.const 600) (i32.const 700) (i32.const 1) (i32.const 800)))
            (call $word (i32.const 18) (i32.load (i32.const 800)))
            (call $word (i32.const 19) (i32.wrap_i64 (i64.load (i32.const 700))))
            ;; stdin bytes as read
            (call $word (i32.const 20) (i32.load (i32.const 2000)))
            (call $word (i32.const 21) (i32.load (i32.const 2004)))
            (drop (call $put (i32.const 0) (i32.const 3) (i32.const 1024) (i32.const 88)))))"#))
        .unwrap();
    let host = Arc::new(FakeHost::default());
    let mut c = call(b"abcdefg");
    c.env = vec![("A".into(), "1".into()), ("B".into(), "22".into())];
    run(&engine, &m, c, host.clone()).await.unwrap();
    let v = host.get("res").unwrap();
    let word = |i: usize| u32::from_le_bytes(v[i * 4..i * 4 + 4].try_into().unwrap());
    assert_eq!(
        (word(0), word(1), word(2), word(3)),
        (0, 4, 3, 0),
        "stdin: 4, 3, then the end"
    );
    assert_eq!(word(20), u32::from_le_bytes(*b"abcd"));
    assert_eq!(word(21) & 0x00ff_ffff, u32::from_le_bytes(*b"efg\0"));
    assert_eq!(
        (word(4), word(5)),
        (0, "A=1\0".len() as u32),
        "env strings packed in order"
    );
    assert_eq!(word(6), 21, "an iovec past memory: EFAULT");
    assert_eq!(
        (word(7), word(8), word(9)),
        (0, 8, 8),
        "closed stdout: EBADF"
    );
    assert_eq!(
        (word(10), word(11)),
        (70, 8),
        "seek: ESPIPE on a stream, EBADF elsewhere"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as u32;
    assert_eq!(word(12), 0);
    assert!(
        word(13).abs_diff(now) <= 5,
        "realtime clock {} vs {now}",
        word(13)
    );
    assert_eq!(word(14), 8, "process CPU clock: EBADF");
    assert_eq!((word(15), word(16)), (0, 1), "random bytes filled");
    assert_eq!(
        (word(17), word(18), word(19)),
        (0, 1, 42),
        "the sleep's one event"
    );
}

/// A sleep past the call's deadline ends the call as timed out at the
/// deadline, not after the sleep.
#[tokio::test]
async fn a_sleep_past_the_deadline_times_out() {
    let (engine, _dir) = engine();
    let m = engine.compile(&sleeper(60)).unwrap();
    let mut c = call(b"");
    c.timeout = Duration::from_millis(200);
    let started = std::time::Instant::now();
    let err = run(&engine, &m, c, Arc::default()).await.unwrap_err();
    assert_eq!(err, WasmError::Timeout);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "slept the whole minute"
    );
}

/// A host call is not stopped by the deadline, so our WASI bounds each
/// call's work against a hostile guest: 2,000 iovecs are refused (EINVAL,
/// past POSIX's 1,024), a 100 KiB stderr write takes 64 KiB (a partial
/// write, as a pipe's), and 2 MiB of randomness in one call is refused
/// while 1 MiB is filled.
#[tokio::test]
async fn wasi_bounds_each_calls_work() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(r#"(module
          (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "fd_read" (func $read (param i32 i32 i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "random_get" (func $random (param i32 i32) (result i32)))
          (import "meshgate" "kv_put" (func $put (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 40)
          (data (i32.const 0) "res")
          (func $word (param $at i32) (param $v i32)
            (i32.store (i32.add (i32.const 1024) (i32.mul (local.get $at) (i32.const 4))) (local.get $v)))
          (func (export "_start")
            (i32.store (i32.const 100) (i32.const 4096))
            (i32.store (i32.const 104) (i32.const 102400))
            (call $word (i32.const 0) (call $write (i32.const 2) (i32.const 100) (i32.const 1) (i32.const 200)))
            (call $word (i32.const 1) (i32.load (i32.const 200)))
            (call $word (i32.const 2) (call $write (i32.const 2) (i32.const 100) (i32.const 2000) (i32.const 200)))
            (call $word (i32.const 3) (call $read (i32.const 0) (i32.const 100) (i32.const 2000) (i32.const 200)))
            (call $word (i32.const 4) (call $random (i32.const 65536) (i32.const 2097152)))
            (call $word (i32.const 5) (call $random (i32.const 65536) (i32.const 1048576)))
            (drop (call $put (i32.const 0) (i32.const 3) (i32.const 1024) (i32.const 24)))))"#))
        .unwrap();
    let host = Arc::new(FakeHost::default());
    run(&engine, &m, call(b""), host.clone()).await.unwrap();
    let v = host.get("res").unwrap();
    let word = |i: usize| u32::from_le_bytes(v[i * 4..i * 4 + 4].try_into().unwrap());
    assert_eq!(
        (word(0), word(1)),
        (0, 64 << 10),
        "stderr: 64 KiB of 100 taken"
    );
    assert_eq!((word(2), word(3)), (28, 28), "2,000 iovecs: EINVAL");
    assert_eq!(
        (word(4), word(5)),
        (28, 0),
        "2 MiB of randomness refused, 1 MiB filled"
    );
}

/// A guest that tries to reach the node's files or network through WASI
/// gets EBADF for each: `path_open` of `/etc/passwd` from fd 3 (and from
/// the stdin fd), a preopen's name, `sock_accept` on fd 3; `sock_send` on
/// stdout is `ENOTSOCK`, as wasmtime-wasi answers. There is no descriptor
/// that names a file or a socket.
#[tokio::test]
async fn wasi_names_no_file_and_no_socket() {
    let (engine, _dir) = engine();
    let m = engine
        .compile(&wat(r#"(module
          (import "wasi_snapshot_preview1" "path_open" (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "fd_prestat_dir_name" (func $name (param i32 i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "sock_accept" (func $accept (param i32 i32 i32) (result i32)))
          (import "wasi_snapshot_preview1" "sock_send" (func $send (param i32 i32 i32 i32 i32) (result i32)))
          (import "meshgate" "kv_put" (func $put (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (data (i32.const 0) "res")
          (data (i32.const 64) "/etc/passwd")
          (func $word (param $at i32) (param $v i32)
            (i32.store (i32.add (i32.const 1024) (i32.mul (local.get $at) (i32.const 4))) (local.get $v)))
          (func (export "_start")
            (call $word (i32.const 0) (call $open (i32.const 3) (i32.const 0) (i32.const 64) (i32.const 11)
              (i32.const 0) (i64.const -1) (i64.const -1) (i32.const 0) (i32.const 200)))
            (call $word (i32.const 1) (call $open (i32.const 0) (i32.const 0) (i32.const 64) (i32.const 11)
              (i32.const 0) (i64.const -1) (i64.const -1) (i32.const 0) (i32.const 200)))
            (call $word (i32.const 2) (call $name (i32.const 3) (i32.const 300) (i32.const 64)))
            (call $word (i32.const 3) (call $accept (i32.const 3) (i32.const 0) (i32.const 200)))
            (call $word (i32.const 4) (call $send (i32.const 1) (i32.const 100) (i32.const 1) (i32.const 0) (i32.const 200)))
            (drop (call $put (i32.const 0) (i32.const 3) (i32.const 1024) (i32.const 20)))))"#))
        .unwrap();
    let host = Arc::new(FakeHost::default());
    run(&engine, &m, call(b""), host.clone()).await.unwrap();
    let v = host.get("res").unwrap();
    let words: Vec<u32> = v
        .chunks(4)
        .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
        .collect();
    assert_eq!(words, [8, 8, 8, 8, 57], "EBADF, and ENOTSOCK on stdout");
}

/// A guest that asks for its arguments and tries the socket calls on stdio
/// and on a descriptor that does not exist; it writes every errno, `argc`,
/// the size of the strings, whether `argv[0]` points at the buffer, and the
/// buffer's first 16 bytes.
const ARGS_AND_SOCKETS: &str = r#"(module
  (import "wasi_snapshot_preview1" "args_sizes_get" (func $sizes (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "args_get" (func $args (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "sock_shutdown" (func $shut (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "sock_send" (func $send (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "sock_recv" (func $recv (param i32 i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "sock_accept" (func $accept (param i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (i32.store8 (i32.const 500) (call $sizes (i32.const 100) (i32.const 104)))
    (i32.store8 (i32.const 501) (call $args (i32.const 200) (i32.const 300)))
    (i32.store8 (i32.const 502) (call $shut (i32.const 1) (i32.const 3)))
    (i32.store8 (i32.const 503) (call $shut (i32.const 9) (i32.const 3)))
    (i32.store8 (i32.const 504) (call $send (i32.const 1) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 400)))
    (i32.store8 (i32.const 505) (call $recv (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 400) (i32.const 404)))
    (i32.store8 (i32.const 506) (call $accept (i32.const 2) (i32.const 0) (i32.const 400)))
    (i32.store8 (i32.const 507) (i32.eq (i32.load (i32.const 200)) (i32.const 300)))
    ;; iovecs at 600: errnos (8 bytes), argc and size (8), the strings (16)
    (i32.store (i32.const 600) (i32.const 500)) (i32.store (i32.const 604) (i32.const 8))
    (i32.store (i32.const 608) (i32.const 100)) (i32.store (i32.const 612) (i32.const 8))
    (i32.store (i32.const 616) (i32.const 300)) (i32.store (i32.const 620) (i32.const 16))
    ;; one iovec per fd_write: wasmtime-wasi writes only the first of several
    (drop (call $w (i32.const 1) (i32.const 600) (i32.const 1) (i32.const 700)))
    (drop (call $w (i32.const 1) (i32.const 608) (i32.const 1) (i32.const 700)))
    (drop (call $w (i32.const 1) (i32.const 616) (i32.const 1) (i32.const 700)))))"#;

/// Differential: the guest above prints the same under our preview 1 as
/// under wasmtime-wasi's given the function's name as its one argument
/// (`argv[0]`), and `sock_*` on stdio answer `ENOTSOCK`.
#[tokio::test]
async fn args_and_sockets_answer_as_wasmtime_wasi() {
    let (engine, _dir) = engine();
    let ours = ours_print(&engine, ARGS_AND_SOCKETS).await;
    let theirs = theirs_print(&engine, ARGS_AND_SOCKETS.to_string()).unwrap();
    assert_eq!(ours, theirs, "ours vs wasmtime-wasi");
    // What both answered, spelled out: success, success, ENOTSOCK (57) on
    // stdio, EBADF (8) on fd 9; argc 1, 9 bytes; argv[0] at the buffer.
    assert_eq!(&ours[..8], &[0, 0, 57, 8, 57, 57, 57, 1]);
    assert_eq!(&ours[8..16], &[1, 0, 0, 0, 9, 0, 0, 0]);
    assert_eq!(&ours[16..], b"hello-fn\0\0\0\0\0\0\0\0");
}

/// Counts that `POST /v1/functions` does not cover end to end (types,
/// tables, memories, element segments, imports), each as a pair at the
/// engine: a module at the limit compiles, one over is `ModuleTooComplex`
/// naming its limit, before compiling (nothing reaches the artifact cache).
#[test]
fn module_shape_limits_obeyed_and_violated() {
    let (engine, _dir) = engine_with(WasmConfig {
        module_limits: ModuleLimits {
            max_types: 3,
            max_element_segments: 2,
            max_imports: 2,
            ..ModuleLimits::default()
        },
        ..config(1, 4, 4)
    });
    let start = r#"(func (export "_start"))"#;
    let types = |n: usize| {
        (0..n)
            .map(|i| format!("(type (func (param {})))", vec!["i32"; i + 1].join(" ")))
            .collect::<String>()
    };
    let elems = |n: usize| "(elem declare func 0)".repeat(n);
    let imports = |n: usize| {
        (0..n)
            .map(|i| {
                format!(
                    r#"(import "meshgate" "log" (func $l{i} (param i32 i32 i32) (result i32)))"#
                )
            })
            .collect::<String>()
    };
    // (limit key, at the limit, one over); type 0 is `_start`'s own.
    let pairs = [
        ("max_types", types(2), types(3)),
        ("max_element_segments", elems(2), elems(3)),
        ("max_imports", imports(2), imports(3)),
        (
            "max_tables",
            "(table 1 funcref)".into(),
            "(table 1 funcref) (table 1 funcref)".into(),
        ),
        (
            "max_memories",
            "(memory 1)".into(),
            "(memory 1) (memory 1)".into(),
        ),
    ];
    for (limit, under, over) in pairs {
        // Imports come before the functions they shift.
        let m = |fields: &str| format!("(module {fields} {start})");
        engine
            .compile(m(&under).as_bytes())
            .unwrap_or_else(|e| panic!("{limit} at the limit: {e}"));
        let misses = engine.cache_misses();
        match engine.compile(m(&over).as_bytes()) {
            Err(WasmError::ModuleTooComplex(msg)) => assert!(msg.contains(limit), "{msg}"),
            other => panic!("{limit}: {other:?}"),
        }
        assert_eq!(
            engine.cache_misses(),
            misses,
            "{limit}: reached the compiler"
        );
    }
}

/// Every errno the guest ABI documents for the calls that name no file and
/// no socket (docs/guest-abi.md), differentially: one guest makes each call
/// below with good and bad arguments, stores each answer's errno as a byte,
/// and prints them; it runs under our preview 1 and under wasmtime-wasi's
/// (no preopened directory, empty stdin and env, `argv[0]` the function's
/// name), and the two outputs must agree call by call. Out-of-memory
/// pointers are among the bad arguments (`EFAULT` in both).
const DIFF_CASES: &[(&str, &str)] = &[
    (
        "args_sizes_get ok",
        "(call $args_sizes_get (i32.const 100) (i32.const 104))",
    ),
    (
        "args_get ok",
        "(call $args_get (i32.const 200) (i32.const 300))",
    ),
    (
        "environ_sizes_get ok",
        "(call $environ_sizes_get (i32.const 100) (i32.const 104))",
    ),
    (
        "environ_get ok",
        "(call $environ_get (i32.const 200) (i32.const 300))",
    ),
    (
        "clock_res_get realtime",
        "(call $clock_res_get (i32.const 0) (i32.const 400))",
    ),
    (
        "clock_res_get monotonic",
        "(call $clock_res_get (i32.const 1) (i32.const 400))",
    ),
    (
        "clock_time_get realtime",
        "(call $clock_time_get (i32.const 0) (i64.const 1) (i32.const 400))",
    ),
    (
        "clock_time_get monotonic",
        "(call $clock_time_get (i32.const 1) (i64.const 1) (i32.const 400))",
    ),
    (
        "random_get ok",
        "(call $random_get (i32.const 400) (i32.const 32))",
    ),
    (
        "random_get zero bytes",
        "(call $random_get (i32.const 400) (i32.const 0))",
    ),
    (
        "fd_write to stdin",
        "(call $fd_write (i32.const 0) (i32.const 800) (i32.const 1) (i32.const 808))",
    ),
    (
        "fd_write to fd 9",
        "(call $fd_write (i32.const 9) (i32.const 800) (i32.const 1) (i32.const 808))",
    ),
    (
        "fd_write to stderr",
        "(call $fd_write (i32.const 2) (i32.const 800) (i32.const 1) (i32.const 808))",
    ),
    (
        "fd_read from empty stdin",
        "(call $fd_read (i32.const 0) (i32.const 816) (i32.const 1) (i32.const 808))",
    ),
    (
        "fd_read from fd 9",
        "(call $fd_read (i32.const 9) (i32.const 816) (i32.const 1) (i32.const 808))",
    ),
    (
        "fd_fdstat_get stdout",
        "(call $fd_fdstat_get (i32.const 1) (i32.const 400))",
    ),
    (
        "fd_fdstat_get fd 9",
        "(call $fd_fdstat_get (i32.const 9) (i32.const 400))",
    ),
    (
        "fd_filestat_get fd 9",
        "(call $fd_filestat_get (i32.const 9) (i32.const 400))",
    ),
    (
        "fd_seek stdout",
        "(call $fd_seek (i32.const 1) (i64.const 0) (i32.const 0) (i32.const 400))",
    ),
    (
        "fd_seek fd 9",
        "(call $fd_seek (i32.const 9) (i64.const 0) (i32.const 0) (i32.const 400))",
    ),
    (
        "fd_tell fd 9",
        "(call $fd_tell (i32.const 9) (i32.const 400))",
    ),
    (
        "fd_prestat_get fd 3",
        "(call $fd_prestat_get (i32.const 3) (i32.const 400))",
    ),
    ("fd_close fd 9", "(call $fd_close (i32.const 9))"),
    (
        "path_open fd 3",
        "(call $path_open (i32.const 3) (i32.const 0) (i32.const 200) (i32.const 1) (i32.const 0) (i64.const 0) (i64.const 0) (i32.const 0) (i32.const 400))",
    ),
    ("sched_yield", "(call $sched_yield)"),
    (
        "poll_oneoff no subscription",
        "(call $poll_oneoff (i32.const 900) (i32.const 1000) (i32.const 0) (i32.const 808))",
    ),
    ("fd_close stdin", "(call $fd_close (i32.const 0))"),
    (
        "fd_read from closed stdin",
        "(call $fd_read (i32.const 0) (i32.const 816) (i32.const 1) (i32.const 808))",
    ),
];

/// Calls given a pointer past the guest's memory or an unknown clock: ours
/// answer the errno preview 1 defines for it (`EFAULT` 21, `EINVAL` 28);
/// wasmtime-wasi traps instead (the guest dies). A deliberate departure
/// (docs/guest-abi.md): a C guest gets an error it can handle. Each runs as
/// its own guest: (name, call, our errno, words of their trap).
const FAULT_CASES: &[(&str, &str, u8, &str)] = &[
    (
        "args_sizes_get bad pointer",
        "(call $args_sizes_get (i32.const 65534) (i32.const 104))",
        21,
        "out of bounds",
    ),
    (
        "args_get bad pointer",
        "(call $args_get (i32.const 65535) (i32.const 300))",
        21,
        "out of bounds",
    ),
    (
        "environ_sizes_get bad pointer",
        "(call $environ_sizes_get (i32.const 65534) (i32.const 104))",
        21,
        "out of bounds",
    ),
    (
        "clock_res_get bad pointer",
        "(call $clock_res_get (i32.const 1) (i32.const 65532))",
        21,
        "out of bounds",
    ),
    (
        "clock_time_get bad pointer",
        "(call $clock_time_get (i32.const 0) (i64.const 1) (i32.const 65532))",
        21,
        "out of bounds",
    ),
    (
        "random_get past memory",
        "(call $random_get (i32.const 65530) (i32.const 32))",
        21,
        "out of bounds",
    ),
    (
        "fd_write bad nwritten",
        "(call $fd_write (i32.const 2) (i32.const 800) (i32.const 1) (i32.const 65534))",
        21,
        "out of bounds",
    ),
    (
        "fd_read bad iovec",
        "(call $fd_read (i32.const 0) (i32.const 65532) (i32.const 1) (i32.const 808))",
        21,
        "out of bounds",
    ),
    (
        "fd_fdstat_get bad pointer",
        "(call $fd_fdstat_get (i32.const 1) (i32.const 65530))",
        21,
        "out of bounds",
    ),
    (
        "poll_oneoff bad pointer",
        "(call $poll_oneoff (i32.const 65496) (i32.const 1000) (i32.const 1) (i32.const 808))",
        21,
        "out of bounds",
    ),
    (
        "clock_res_get unknown clock",
        "(call $clock_res_get (i32.const 9) (i32.const 400))",
        28,
        "Invalid enum value",
    ),
    (
        "clock_time_get unknown clock",
        "(call $clock_time_get (i32.const 9) (i64.const 1) (i32.const 400))",
        28,
        "Invalid enum value",
    ),
];

/// The imports `DIFF_CASES` call, with their standard signatures.
const DIFF_IMPORTS: &[(&str, &str)] = &[
    ("args_sizes_get", "(param i32 i32) (result i32)"),
    ("args_get", "(param i32 i32) (result i32)"),
    ("environ_sizes_get", "(param i32 i32) (result i32)"),
    ("environ_get", "(param i32 i32) (result i32)"),
    ("clock_res_get", "(param i32 i32) (result i32)"),
    ("clock_time_get", "(param i32 i64 i32) (result i32)"),
    ("random_get", "(param i32 i32) (result i32)"),
    ("fd_write", "(param i32 i32 i32 i32) (result i32)"),
    ("fd_read", "(param i32 i32 i32 i32) (result i32)"),
    ("fd_fdstat_get", "(param i32 i32) (result i32)"),
    ("fd_filestat_get", "(param i32 i32) (result i32)"),
    ("fd_seek", "(param i32 i64 i32 i32) (result i32)"),
    ("fd_tell", "(param i32 i32) (result i32)"),
    ("fd_prestat_get", "(param i32 i32) (result i32)"),
    ("fd_close", "(param i32) (result i32)"),
    (
        "path_open",
        "(param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)",
    ),
    ("sched_yield", "(result i32)"),
    ("poll_oneoff", "(param i32 i32 i32 i32) (result i32)"),
];

/// The guest: each case's errno at 2000 + i, then one `fd_write` of them all
/// to stdout (iovec at 1900). An iovec for the writes at 800 (4 bytes at
/// 820, "ok!\n"), one for the reads at 816 (16 bytes at 840).
fn diff_guest(cases: &[(&str, &str)]) -> String {
    let imports: String = DIFF_IMPORTS
        .iter()
        .map(|(name, sig)| {
            format!(r#"(import "wasi_snapshot_preview1" "{name}" (func ${name} {sig}))"#)
        })
        .collect();
    let calls: String = cases
        .iter()
        .enumerate()
        .map(|(i, (_, call))| format!("(i32.store8 (i32.const {}) {call})\n", 2000 + i))
        .collect();
    format!(
        r#"(module {imports}
  (memory (export "memory") 1)
  (data (i32.const 820) "ok!\n")
  (func (export "_start")
    (i32.store (i32.const 800) (i32.const 820)) (i32.store (i32.const 804) (i32.const 4))
    (i32.store (i32.const 816) (i32.const 840)) (i32.store (i32.const 820) (i32.const 16))
    (i32.store (i32.const 800) (i32.const 820))
    {calls}
    (i32.store (i32.const 1900) (i32.const 2000)) (i32.store (i32.const 1904) (i32.const {n}))
    (drop (call $fd_write (i32.const 1) (i32.const 1900) (i32.const 1) (i32.const 1952)))))"#,
        n = cases.len()
    )
}

/// What `guest` prints under our preview 1.
async fn ours_print(engine: &WasmEngine, guest: &str) -> Vec<u8> {
    let m = engine.compile(&wat(guest)).unwrap();
    run(
        engine,
        &m,
        Invocation::new("ns", "hello-fn", Vec::new()),
        Arc::default(),
    )
    .await
    .unwrap()
    .stdout
}

/// What `guest` prints under wasmtime-wasi's preview 1, or its trap.
fn theirs_print(engine: &WasmEngine, guest: String) -> Result<Vec<u8>, String> {
    use wasmtime_wasi::p2::pipe::MemoryOutputPipe;

    // wasmtime-wasi's sync calls enter a Tokio runtime of their own: run
    // them on a thread outside the test's.
    let raw = engine.wasmtime_engine().clone();
    std::thread::spawn(move || {
        let module = wasmtime::Module::new(&raw, &guest).unwrap();
        let mut linker = wasmtime::Linker::new(&raw);
        wasmtime_wasi::p1::add_to_linker_sync(&mut linker, |t| t).unwrap();
        let out = MemoryOutputPipe::new(1 << 16);
        let wasi = wasmtime_wasi::WasiCtxBuilder::new()
            .args(&["hello-fn"])
            .stdout(out.clone())
            .build_p1();
        let mut store = wasmtime::Store::new(&raw, wasi);
        store.set_epoch_deadline(u64::MAX / 2);
        let instance = linker.instantiate(&mut store, &module).unwrap();
        instance
            .get_typed_func::<(), ()>(&mut store, "_start")
            .unwrap()
            .call(&mut store, ())
            .map_err(|e| format!("{e:?}"))?;
        Ok(out.contents().to_vec())
    })
    .join()
    .unwrap()
}

#[tokio::test]
async fn every_documented_errno_answers_as_wasmtime_wasi() {
    let (engine, _dir) = engine();
    let ours = ours_print(&engine, &diff_guest(DIFF_CASES)).await;
    let theirs = theirs_print(&engine, diff_guest(DIFF_CASES)).unwrap();
    assert_eq!(ours.len(), DIFF_CASES.len(), "ours printed {ours:?}");
    assert_eq!(theirs.len(), DIFF_CASES.len(), "theirs printed {theirs:?}");
    let differ: Vec<String> = DIFF_CASES
        .iter()
        .zip(ours.iter().zip(&theirs))
        .filter(|(_, (a, b))| a != b)
        .map(|((name, _), (a, b))| format!("{name}: ours {a}, wasmtime-wasi {b}"))
        .collect();
    assert!(
        differ.is_empty(),
        "errnos that differ:\n{}",
        differ.join("\n")
    );
    // Not all success: the bad arguments were refused (a guard that the
    // guest ran its cases rather than printing zeros).
    assert!(
        ours.iter().filter(|&&e| e == 8).count() >= 5,
        "EBADF: {ours:?}"
    );
    assert!(ours.iter().any(|&e| e == 28), "EINVAL: {ours:?}");
}

#[tokio::test]
async fn bad_pointers_and_clocks_are_errnos_where_wasmtime_wasi_traps() {
    let (engine, _dir) = engine();
    for &(name, call, errno, trap) in FAULT_CASES {
        let guest = diff_guest(&[(name, call)]);
        assert_eq!(ours_print(&engine, &guest).await, [errno], "{name}: ours");
        let theirs = theirs_print(&engine, guest);
        assert!(
            theirs.as_ref().is_err_and(|e| e.contains(trap)),
            "{name}: wasmtime-wasi answered {theirs:?}"
        );
    }
}
