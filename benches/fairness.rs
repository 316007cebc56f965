//! Fair share of the WASM pool, over HTTP, at the default `[functions]`
//! settings (workers = one per core, per-namespace queue 64, queue wait 3 s):
//!
//! (a) a lone namespace's burst: 32 keep-alive clients invoking the C echo
//!     module back to back; the share of 429 `FUNCTION_BUSY` (target ≤ 1%);
//! (b) a quiet tenant (one client, sequential echo invokes): its latency
//!     alone, then beside a flooding neighbour (32 clients invoking a
//!     busy-loop guest); target p99 beside ≤ 2 × p99 alone.
//!
//! `cargo bench --bench fairness` prints a table. Under `cargo test` (no
//! `--bench` argument) it runs a short smoke round, silent unless it fails:
//! the lone burst must see ≤ 1% refusals and the quiet tenant none.

#[path = "support/node.rs"]
mod node_support;

use meshgate::wasm::{
    CompiledModule, HostApi, HostError, Invocation, ResolvedFunction, WasmConfig, WasmEngine,
    WasmError,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const BURST: usize = 32;
const BOUNDARY: &str = "meshgatebench0123";
const INPUT: &[u8] = br#"{"hello":"world"}"#;
/// Spins ITERATIONS times, then exits: a CPU-bound call of a few milliseconds.
const ITERATIONS: u32 = 3_000_000;

fn busy_loop_wat() -> String {
    format!(
        r#"(module
  (func (export "_start") (local $i i32)
    (loop $l
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const {ITERATIONS}))))))"#
    )
}

fn multipart(name: &str, wasm: &[u8]) -> Vec<u8> {
    let mut b = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\n{name}\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"wasm\"\r\n\r\n"
    )
    .into_bytes();
    b.extend_from_slice(wasm);
    b.extend_from_slice(format!("\r\n--{BOUNDARY}--\r\n").as_bytes());
    b
}

async fn deploy(addr: SocketAddr, key: &str, name: &str, wasm: &[u8]) {
    let client = awc::Client::builder()
        .timeout(Duration::from_secs(120))
        .finish();
    let mut r = client
        .post(format!("http://{addr}/v1/functions"))
        .insert_header(("authorization", format!("Bearer {key}")))
        .insert_header((
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        ))
        .send_body(multipart(name, wasm))
        .await
        .unwrap();
    let body = r.body().await.unwrap();
    assert_eq!(
        r.status().as_u16(),
        201,
        "{}",
        String::from_utf8_lossy(&body)
    );
}

async fn create_namespace(addr: SocketAddr, data_dir: &std::path::Path, name: &str) -> String {
    let op = std::fs::read_to_string(data_dir.join("operator.key")).unwrap();
    let mut r = awc::Client::default()
        .post(format!("http://{addr}/v1/namespaces"))
        .insert_header(("authorization", format!("Bearer {}", op.trim())))
        .send_json(&serde_json::json!({ "name": name }))
        .await
        .unwrap();
    let v: serde_json::Value = r.json().await.unwrap();
    v["api_key"].as_str().unwrap().to_string()
}

/// Answers of one client loop.
#[derive(Default)]
struct Tally {
    ok: u64,
    busy: u64,
    other: u64,
    /// Latencies of the successful calls.
    lat: Vec<Duration>,
}

impl Tally {
    fn add(&mut self, o: Tally) {
        self.ok += o.ok;
        self.busy += o.busy;
        self.other += o.other;
        self.lat.extend(o.lat);
    }
    fn total(&self) -> u64 {
        self.ok + self.busy + self.other
    }
    fn busy_share(&self) -> f64 {
        self.busy as f64 / self.total().max(1) as f64
    }
    fn pct(&mut self, p: f64) -> Duration {
        self.lat.sort();
        let n = self.lat.len();
        self.lat
            .get(((n as f64 * p) as usize).min(n.saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    }
}

/// `clients` keep-alive clients invoking `url` back to back until `stop`.
async fn drive(url: String, key: String, clients: usize, stop: Arc<AtomicBool>) -> Tally {
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (url, key, stop) = (url.clone(), key.clone(), stop.clone());
        tasks.push(actix_web::rt::spawn(async move {
            let client = awc::Client::builder()
                .connector(awc::Connector::new().limit(1))
                .timeout(Duration::from_secs(60))
                .finish();
            let mut t = Tally::default();
            while !stop.load(Ordering::Relaxed) {
                let start = Instant::now();
                let mut resp = client
                    .post(&url)
                    .insert_header(("authorization", format!("Bearer {key}")))
                    .send_body(INPUT)
                    .await
                    .expect("request");
                let _ = resp.body().await;
                match resp.status().as_u16() {
                    200 => {
                        t.ok += 1;
                        t.lat.push(start.elapsed());
                    }
                    429 => t.busy += 1,
                    _ => t.other += 1,
                }
            }
            t
        }));
    }
    let mut all = Tally::default();
    for t in tasks {
        all.add(t.await.unwrap());
    }
    all
}

/// Runs `drive` for `secs` on a thread of its own (its own event loop, so a
/// flood driven elsewhere does not delay these clients' own answers).
async fn drive_for(url: String, key: String, clients: usize, secs: f64) -> Tally {
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let stop2 = stop.clone();
    std::thread::spawn(move || {
        let t = actix_web::rt::System::new().block_on(drive(url, key, clients, stop2));
        let _ = tx.send(t);
    });
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    rx.await.expect("the load thread failed")
}

/// Serves nothing: the bench guests import no host function.
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

/// The pool alone (no HTTP): `clients` tasks calling `module` of `ns` back to
/// back on `engine` until `stop`.
async fn drive_engine(
    engine: WasmEngine,
    module: Arc<CompiledModule>,
    ns: &'static str,
    clients: usize,
    stop: Arc<AtomicBool>,
) -> Tally {
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (engine, module, stop) = (engine.clone(), module.clone(), stop.clone());
        tasks.push(actix_web::rt::spawn(async move {
            let mut t = Tally::default();
            while !stop.load(Ordering::Relaxed) {
                let start = Instant::now();
                let call = Invocation::new(ns, "f", INPUT.to_vec());
                match engine.invoke(module.clone(), call, Arc::new(NoHost)).await {
                    Ok(_) => {
                        t.ok += 1;
                        t.lat.push(start.elapsed());
                    }
                    Err(WasmError::Busy) => t.busy += 1,
                    Err(_) => t.other += 1,
                }
            }
            t
        }));
    }
    let mut all = Tally::default();
    for t in tasks {
        all.add(t.await.unwrap());
    }
    all
}

/// Runs `drive_engine` for `secs` on a thread of its own.
async fn drive_engine_for(
    engine: WasmEngine,
    module: Arc<CompiledModule>,
    ns: &'static str,
    clients: usize,
    secs: f64,
) -> Tally {
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let stop2 = stop.clone();
    std::thread::spawn(move || {
        let t =
            actix_web::rt::System::new().block_on(drive_engine(engine, module, ns, clients, stop2));
        let _ = tx.send(t);
    });
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    rx.await.expect("the load thread failed")
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let secs = if full { 5.0 } else { 0.3 };
    let dir = tempfile::tempdir().unwrap();
    // The default [functions] settings: only the rate limits are lifted.
    let mut cfg = node_support::config(dir.path());
    // Another workers' nice value than the default, to compare (the
    // `[functions] worker_nice` setting).
    if let Some(n) = std::env::var("MESHGATE_BENCH_WORKER_NICE")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        cfg.functions.worker_nice = n;
    }
    let data_dir = cfg.server.data_dir.clone();
    let workers = meshgate::node::num_cpus();
    let echo = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/functions/echo.wasm"
    ))
    .unwrap();
    let sys = actix_web::rt::System::new();
    sys.block_on(async move {
        let started = node_support::start(cfg).await;
        let (addr, quiet_key) = (started.addr, started.key);
        let noisy_key = create_namespace(addr, &data_dir, "noisy").await;
        deploy(addr, &quiet_key, "echo", &echo).await;
        deploy(addr, &noisy_key, "spin", busy_loop_wat().as_bytes()).await;
        let echo_url = format!("http://{addr}/v1/functions/echo/invoke");
        let spin_url = format!("http://{addr}/v1/functions/spin/invoke");

        // The neighbour's call alone, for scale.
        let spin_alone = drive_for(spin_url.clone(), noisy_key.clone(), 1, secs / 3.0)
            .await
            .pct(0.5);

        // (a) A lone namespace's burst.
        drive_for(echo_url.clone(), quiet_key.clone(), BURST, secs / 3.0).await;
        let mut lone = drive_for(echo_url.clone(), quiet_key.clone(), BURST, secs).await;

        // (b) The quiet tenant alone, then beside the flood.
        let mut alone = drive_for(echo_url.clone(), quiet_key.clone(), 1, secs).await;
        let stop = Arc::new(AtomicBool::new(false));
        let flood = actix_web::rt::spawn(drive(spin_url, noisy_key, BURST, stop.clone()));
        // Let the flood fill the pool before measuring.
        let filled = Instant::now() + Duration::from_secs(10);
        let engine = started.node.0.functions.engine().clone();
        while engine.stats().queued == 0 {
            assert!(Instant::now() < filled, "the flood never filled the pool");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut beside = drive_for(echo_url, quiet_key, 1, secs).await;
        stop.store(true, Ordering::Relaxed);
        let flood = flood.await.unwrap();

        // (c) The same pair on the pool alone (no HTTP, no load generator
        // sockets): what the scheduling itself adds.
        let pool = WasmEngine::new(WasmConfig::default(), dir.path().join("pool-cache")).unwrap();
        let echo_m = pool.compile(&echo).unwrap();
        let spin_m = pool.compile(busy_loop_wat().as_bytes()).unwrap();
        let mut pool_alone =
            drive_engine_for(pool.clone(), echo_m.clone(), "quiet", 1, secs).await;
        let stop = Arc::new(AtomicBool::new(false));
        let pool_flood = actix_web::rt::spawn(drive_engine(
            pool.clone(),
            spin_m,
            "noisy",
            BURST,
            stop.clone(),
        ));
        let filled = Instant::now() + Duration::from_secs(10);
        while pool.stats().queued == 0 {
            assert!(Instant::now() < filled, "the flood never filled the pool");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let sampler = {
            let (pool, stop) = (pool.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut n, mut busy, mut queued) = (0u64, 0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let s = pool.stats();
                    n += 1;
                    busy += s.busy as u64;
                    queued += s.queued as u64;
                    std::thread::sleep(Duration::from_millis(1));
                }
                (busy as f64 / n.max(1) as f64, queued as f64 / n.max(1) as f64)
            })
        };
        let mut pool_beside = drive_engine_for(pool.clone(), echo_m, "quiet", 1, secs).await;
        stop.store(true, Ordering::Relaxed);
        let pool_flood = pool_flood.await.unwrap();
        let (avg_busy, avg_queued) = sampler.join().unwrap();
        assert_eq!(pool_alone.busy + pool_alone.other, 0, "pool: quiet alone refused");
        assert_eq!(pool_beside.busy + pool_beside.other, 0, "pool: quiet refused beside the flood");
        assert!(pool_flood.ok > 0, "pool: the neighbour never ran");

        let lone_share = lone.busy_share();
        assert!(
            lone_share <= 0.01,
            "lone burst: {} of {} refused",
            lone.busy,
            lone.total()
        );
        assert_eq!(lone.other, 0, "lone burst: unexpected statuses");
        assert_eq!(alone.busy + alone.other, 0, "quiet tenant alone refused");
        assert_eq!(beside.busy + beside.other, 0, "quiet tenant refused beside the flood");
        assert!(flood.ok > 0, "the neighbour never ran");

        if full {
            let (a50, a99) = (alone.pct(0.5), alone.pct(0.99));
            let (b50, b99) = (beside.pct(0.5), beside.pct(0.99));
            println!("| measurement | value |");
            println!("|---|---|");
            println!(
                "| (a) lone burst, {BURST} clients, echo: answers / 429 share | {} / {:.2}% (p99 {:.1} ms) |",
                lone.total(),
                lone_share * 100.0,
                ms(lone.pct(0.99))
            );
            println!(
                "| (b) quiet tenant alone: p50 / p99 | {:.2} / {:.2} ms ({} calls) |",
                ms(a50),
                ms(a99),
                alone.ok
            );
            println!(
                "| (b) quiet tenant beside the flood: p50 / p99 | {:.2} / {:.2} ms ({} calls) |",
                ms(b50),
                ms(b99),
                beside.ok
            );
            println!(
                "| (b) p99 beside / p99 alone | {:.2}× |",
                b99.as_secs_f64() / a99.as_secs_f64().max(1e-9)
            );
            println!(
                "| neighbour: {BURST} clients, busy loop of {:.1} ms alone: answers / 429 share | {} / {:.1}% |",
                ms(spin_alone),
                flood.total(),
                flood.busy_share() * 100.0
            );
            let (c50, c99) = (pool_alone.pct(0.5), pool_alone.pct(0.99));
            let (d50, d99) = (pool_beside.pct(0.5), pool_beside.pct(0.99));
            println!(
                "| (c) pool only, quiet alone: p50 / p99 | {:.2} / {:.2} ms ({} calls) |",
                ms(c50),
                ms(c99),
                pool_alone.ok
            );
            println!(
                "| (c) pool only, quiet beside {BURST} flooding tasks: p50 / p99 | {:.2} / {:.2} ms ({} calls; neighbour {} calls, {} refused; workers busy {avg_busy:.2} and {avg_queued:.1} waiting on average) |",
                ms(d50),
                ms(d99),
                pool_beside.ok,
                pool_flood.ok,
                pool_flood.busy + pool_flood.other
            );
            println!(
                "| (c) p99 beside / p99 alone | {:.2}× |",
                d99.as_secs_f64() / c99.as_secs_f64().max(1e-9)
            );
            println!(
                "({workers} workers, default [functions] settings, {secs} s per run, load generator in-process on the same cores)"
            );
        }
        std::process::exit(0);
    });
}
