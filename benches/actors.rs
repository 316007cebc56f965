//! Request/reply round trips through a `NamespaceSupervisor` (with its bounded
//! admission and instrumentation) against a bare actix actor on the same kind of
//! thread, and the store's get/put. `cargo bench --bench actors`.

use actix::prelude::*;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use meshgate::actors::{
    ActorDirectory, GetInfo, NamespaceRecord, NamespaceSupervisor, ask, ns_key,
};
use meshgate::metrics::Metrics;
use meshgate::storage::{OrderedKv, Store};
use std::time::{Duration, Instant};

struct Bare;
impl Actor for Bare {
    type Context = Context<Self>;
}
#[derive(Message)]
#[rtype(result = "u64")]
struct Ping;
impl Handler<Ping> for Bare {
    type Result = u64;
    fn handle(&mut self, _: Ping, _: &mut Context<Self>) -> u64 {
        1
    }
}

fn round_trips(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open_sled(dir.path()).unwrap();
    let sys = actix::System::new();
    let record = NamespaceRecord::new("bench", 0);
    sys.block_on(store.put_json(&ns_key("bench"), &record))
        .unwrap();
    let metrics = Metrics::new();
    let directory = ActorDirectory::default();
    let stats = directory.register(&metrics, "namespace", "bench", 1024);
    let (ns, bare) = sys.block_on(async {
        let arbiter = Arbiter::new();
        let s2 = stats.clone();
        let st = store.clone();
        let ns = Supervisor::start_in_arbiter(&arbiter.handle(), move |_| {
            NamespaceSupervisor::new("bench".into(), st, s2, 1024)
        });
        let bare_arbiter = Arbiter::new();
        let bare = Bare::start_in_arbiter(&bare_arbiter.handle(), |_| Bare);
        // Let the supervisor load its record.
        tokio::time::sleep(Duration::from_millis(50)).await;
        (ns, bare)
    });
    let mut g = c.benchmark_group("round_trip");
    g.throughput(Throughput::Elements(1));
    g.bench_function("bare_actix_actor", |b| {
        b.iter_custom(|iters| {
            sys.block_on(async {
                let t = Instant::now();
                for _ in 0..iters {
                    bare.send(Ping).await.unwrap();
                }
                t.elapsed()
            })
        })
    });
    g.bench_function("namespace_supervisor", |b| {
        b.iter_custom(|iters| {
            sys.block_on(async {
                let t = Instant::now();
                for _ in 0..iters {
                    ask(&ns, &stats, GetInfo, Duration::from_secs(10))
                        .await
                        .unwrap()
                        .unwrap();
                }
                t.elapsed()
            })
        })
    });
    g.finish();

    let mut g = c.benchmark_group("store");
    g.throughput(Throughput::Elements(1));
    sys.block_on(store.put(b"kv/bench/k", &[7u8; 128])).unwrap();
    g.bench_function("get_128b", |b| {
        b.iter(|| sys.block_on(store.get(b"kv/bench/k")).unwrap())
    });
    g.sample_size(20);
    g.bench_function("put_128b_durable", |b| {
        b.iter(|| sys.block_on(store.put(b"kv/bench/p", &[1u8; 128])).unwrap())
    });
    g.finish();
}

criterion_group!(benches, round_trips);
criterion_main!(benches);
