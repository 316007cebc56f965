//! Every limit as an obeyed/violated pair, the guest ABI and the C examples.

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

fn config(workers: usize, queue: usize, namespace_concurrency: usize) -> WasmConfig {
    WasmConfig {
        workers,
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

/// A namespace at its cap gets Busy while another namespace still runs.
#[tokio::test]
async fn namespace_cap_busy_while_other_namespace_runs() {
    let (engine, _dir) = engine_with(config(2, 16, 1));
    let looping = engine.compile(&wat(INFINITE_LOOP)).unwrap();
    let noop = engine.compile(&wat(NOOP)).unwrap();
    let mut long = Invocation::new("a", "loop", Vec::new());
    long.timeout = Duration::from_millis(500);
    let first = {
        let (engine, m) = (engine.clone(), looping.clone());
        tokio::spawn(async move { engine.invoke(m, long, Arc::new(FakeHost::default())).await })
    };
    wait_until(&engine, |s| s.busy == 1).await;
    assert_eq!(
        engine.stats().namespaces,
        [NamespaceStats {
            namespace: "a".into(),
            running: 1,
            queued: 0
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
    assert_eq!(first.await.unwrap().unwrap_err(), WasmError::Timeout);
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
            max: 1024
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
        if let Some(r) = super::host::guest_range(ptr, len, size) {
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
