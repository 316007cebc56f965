//! The cost of the record MAC (`src/storage/record_mac.rs`) on the store's
//! read and write paths: `Store` get and buffered put on the embedded store
//! (sled), without and with the MAC installed, and the MAC alone (wrap on
//! write, open on read), for a record of 256 bytes (a function version's
//! metadata) and one of 16 KiB (a KV value).
//!
//! `cargo bench --bench store_mac`; without a release build (the numbers
//! are then a debug build's, the ratios still telling):
//! `cargo test --features cluster --bench store_mac -- --bench`

use criterion::{Criterion, criterion_group, criterion_main};
use meshgate::storage::{BatchOp, OrderedKv, RecordMac, Store};
use std::hint::black_box;

const SIZES: [usize; 2] = [256, 16 << 10];
/// Records in the store, read in turn.
const RECORDS: usize = 1_000;

fn key(i: usize) -> Vec<u8> {
    format!("fnver/bank/pay/{i:010}").into_bytes()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    for size in SIZES {
        let value = vec![b'x'; size];
        let mut g = c.benchmark_group(format!("store_{size}B"));
        for with_mac in [false, true] {
            let dir = tempfile::tempdir().expect("temp dir");
            let store = Store::open_sled(dir.path()).expect("sled");
            if with_mac {
                rt.block_on(store.adopt_record_macs(RecordMac::derive(b"bench secret"), true))
                    .expect("install the MAC");
            }
            rt.block_on(async {
                for i in 0..RECORDS {
                    store.put(&key(i), &value).await.expect("put");
                }
            });
            let label = if with_mac { "mac" } else { "plain" };
            let mut i = 0;
            g.bench_function(format!("get_{label}"), |b| {
                b.iter(|| {
                    i = (i + 1) % RECORDS;
                    rt.block_on(store.get(black_box(&key(i))))
                        .expect("get")
                        .expect("present")
                })
            });
            g.bench_function(format!("put_buffered_{label}"), |b| {
                b.iter(|| {
                    i = (i + 1) % RECORDS;
                    rt.block_on(
                        store.apply_buffered(vec![BatchOp::Put(key(i), black_box(&value).clone())]),
                    )
                    .expect("put")
                })
            });
        }
        let mac = RecordMac::derive(b"bench secret");
        let k = key(7);
        let record = mac.wrap(&k, &value);
        g.bench_function("mac_wrap", |b| {
            b.iter(|| mac.wrap(black_box(&k), black_box(&value)))
        });
        g.bench_function("mac_open", |b| {
            b.iter(|| mac.open(black_box(&k), black_box(&record)).is_ok())
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
