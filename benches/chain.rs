//! The cost of the request chain, as issue #16 states it: requests per second
//! of `GET /v1/kv/hot` (a 128-byte value) through the whole chain (rate
//! limits, authentication, namespace authorization, scopes, the handler)
//! against `/livez` of the same node, both over real HTTP with keep-alive
//! connections, once with a JWT and once with an API key.
//!
//! The node is the release binary run as an operator runs it (`meshgate
//! serve`, its own process, logging to a file); the load generator is a lean
//! HTTP/1.1 client on a thread of the bench process (benches/support/raw.rs).
//! Runs alternate livez / JWT / API key for several rounds; each round's
//! ratio is against that round's `/livez`, and the table gives the medians.
//!
//! `cargo bench --bench chain` prints the table, then each ratio through
//! `wrk` (benches/support/wrk.rs; `apt-get install -y wrk`). Under `cargo test` (no
//! `--bench` argument) it runs a short smoke round so the bench stays working.
//! `MESHGATE_BENCH_SECS` / `MESHGATE_BENCH_ROUNDS` change the run length;
//! the node's pid is printed so a profiler can attach (`perf record -p`).

#[path = "support/raw.rs"]
mod raw;
#[path = "support/wrk.rs"]
mod wrk;

use raw::{Load, NodeProcess, median, request_bytes, run};

const CONNECTIONS: usize = 32;

fn env_or<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let secs: f64 = env_or("MESHGATE_BENCH_SECS", if full { 3.0 } else { 0.3 });
    let rounds: usize = env_or("MESHGATE_BENCH_ROUNDS", if full { 5 } else { 1 });
    let dir = tempfile::tempdir().unwrap();
    let node = NodeProcess::start(dir.path(), "");
    eprintln!("node pid {} on {}", node.child.id(), node.addr);
    let key = node.namespace("bench");
    let jwt = node.jwt(&key);
    let key_auth = format!("Bearer {key}");
    let jwt_auth = format!("Bearer {jwt}");
    let value = vec![b'x'; 128];
    let (st, _) = node
        .call("PUT", "/v1/kv/hot", &[("authorization", &key_auth)], &value)
        .unwrap();
    assert_eq!(st, 200);

    let livez = Load {
        bytes: request_bytes("GET", "/livez", &[], b""),
        expect_body: None,
    };
    let kv = |auth: &str| Load {
        bytes: request_bytes("GET", "/v1/kv/hot", &[("authorization", auth)], b""),
        expect_body: Some(value.clone()),
    };
    let (kv_jwt, kv_key) = (kv(&jwt_auth), kv(&key_auth));

    // Warm every path (caches, connections, the supervisor) before measuring.
    for l in [&livez, &kv_jwt, &kv_key] {
        run(node.addr, l, CONNECTIONS, secs / 3.0);
    }
    let (mut lz, mut j, mut k, mut rj, mut rk) = (vec![], vec![], vec![], vec![], vec![]);
    let (mut p50l, mut p50j, mut p50k) = (vec![], vec![], vec![]);
    for _ in 0..rounds {
        let a = run(node.addr, &livez, CONNECTIONS, secs);
        let b = run(node.addr, &kv_jwt, CONNECTIONS, secs);
        let c = run(node.addr, &kv_key, CONNECTIONS, secs);
        rj.push(b.rps / a.rps);
        rk.push(c.rps / a.rps);
        lz.push(a.rps);
        j.push(b.rps);
        k.push(c.rps);
        p50l.push(a.p50.as_secs_f64() * 1e6);
        p50j.push(b.p50.as_secs_f64() * 1e6);
        p50k.push(c.p50.as_secs_f64() * 1e6);
    }

    // A smoke run under `cargo test` keeps quiet unless it fails.
    if full {
        let per_round = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!("| measurement (median of {rounds} rounds) | value |");
        println!("|---|---|");
        println!("| `/livez`, req/s | {:.0} |", median(lz));
        println!("| `GET /v1/kv/hot`, JWT, req/s | {:.0} |", median(j));
        println!("| `GET /v1/kv/hot`, API key, req/s | {:.0} |", median(k));
        println!(
            "| p50 latency livez / JWT / API key, µs | {:.0} / {:.0} / {:.0} |",
            median(p50l),
            median(p50j),
            median(p50k)
        );
        println!(
            "| ratio KV (JWT) / livez | **{:.2}** ({}) |",
            median(rj.clone()),
            per_round(&rj)
        );
        println!(
            "| ratio KV (API key) / livez | **{:.2}** ({}) |",
            median(rk.clone()),
            per_round(&rk)
        );
        println!(
            "({CONNECTIONS} keep-alive connections, {secs} s per run, 128-byte value, node = release binary in its own process logging to a file)"
        );
        let url = |path: &str| format!("http://{}{path}", node.addr);
        let livez = wrk::Wrk::get(&url("/livez"), &[]);
        for (name, auth) in [("KV (JWT)", &jwt_auth), ("KV (API key)", &key_auth)] {
            let auth_header = format!("authorization: {auth}");
            let kv = wrk::Wrk::get(&url("/v1/kv/hot"), &[&auth_header]);
            wrk::ratio_table(name, &kv, "livez", &livez, 3);
        }
    }
}
