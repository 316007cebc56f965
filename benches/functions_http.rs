//! Functions over HTTP, as issue #16 states it: requests per second of
//! `POST /v1/functions/echo/invoke` (the C echo module, through the whole
//! chain, the namespace supervisor and the WASM worker pool) against a KV read
//! (`GET /v1/kv/hot`, 128 bytes) through the same chain with the same token,
//! both on the same node over real HTTP with keep-alive connections; and the
//! deploy-to-first-invoke time of the C echo module (cold: compiled; warm: the
//! same bytes again under another name, loaded from the artifact cache).
//!
//! The node is the release binary in its own process (benches/support/raw.rs);
//! runs alternate KV / invoke for several rounds, and the table gives the
//! medians of the per-round ratios.
//!
//! `cargo bench --bench functions_http` prints the table, then the same ratio
//! through `wrk` (benches/support/wrk.rs; `apt-get install -y wrk`). Under `cargo test`
//! (no `--bench` argument) it runs a short smoke round so the bench stays
//! working. `MESHGATE_BENCH_SECS` / `MESHGATE_BENCH_ROUNDS` change the run
//! length; the node's pid is printed so a profiler can attach.

#[path = "support/raw.rs"]
mod raw;
#[path = "support/wrk.rs"]
mod wrk;

use raw::{Load, NodeProcess, median, request_bytes, run};
use std::time::{Duration, Instant};

const CONNECTIONS: usize = 16;
const BOUNDARY: &str = "meshgatebench0123";
const INPUT: &[u8] = br#"{"hello":"world"}"#;

fn env_or<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
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

/// Deploys `name` and invokes it once; returns the elapsed time.
fn deploy_and_invoke(node: &NodeProcess, auth: &str, name: &str, wasm: &[u8]) -> Duration {
    let t = Instant::now();
    let ct = format!("multipart/form-data; boundary={BOUNDARY}");
    let (st, b) = node
        .call(
            "POST",
            "/v1/functions",
            &[("authorization", auth), ("content-type", &ct)],
            &multipart(name, wasm),
        )
        .unwrap();
    assert_eq!(st, 201, "{}", String::from_utf8_lossy(&b));
    let (st, b) = node
        .call(
            "POST",
            &format!("/v1/functions/{name}/invoke"),
            &[("authorization", auth)],
            INPUT,
        )
        .unwrap();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(b, INPUT);
    t.elapsed()
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let secs: f64 = env_or("MESHGATE_BENCH_SECS", if full { 3.0 } else { 0.3 });
    let rounds: usize = env_or("MESHGATE_BENCH_ROUNDS", if full { 5 } else { 1 });
    let wasm = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/functions/echo.wasm"
    ))
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The generators keep CONNECTIONS (wrk: 32) calls in flight in one
    // namespace: the namespace's cap is raised above both.
    let node = NodeProcess::start(dir.path(), "[functions]\nnamespace_concurrency = 64\n");
    eprintln!("node pid {} on {}", node.child.id(), node.addr);
    let key = node.namespace("bench");
    let auth = format!("Bearer {key}");

    let cold = deploy_and_invoke(&node, &auth, "echo", &wasm);
    let warm = deploy_and_invoke(&node, &auth, "echo2", &wasm);
    let value = vec![b'x'; 128];
    let (st, _) = node
        .call("PUT", "/v1/kv/hot", &[("authorization", &auth)], &value)
        .unwrap();
    assert_eq!(st, 200);

    let kv = Load {
        bytes: request_bytes("GET", "/v1/kv/hot", &[("authorization", &auth)], b""),
        expect_body: Some(value.clone()),
    };
    let invoke = Load {
        bytes: request_bytes(
            "POST",
            "/v1/functions/echo/invoke",
            &[("authorization", &auth)],
            INPUT,
        ),
        expect_body: Some(INPUT.to_vec()),
    };
    for l in [&kv, &invoke] {
        run(node.addr, l, CONNECTIONS, secs / 3.0);
    }
    let (mut kvs, mut invs, mut ratios, mut p50k, mut p50i) =
        (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        let a = run(node.addr, &kv, CONNECTIONS, secs);
        let b = run(node.addr, &invoke, CONNECTIONS, secs);
        ratios.push(b.rps / a.rps);
        kvs.push(a.rps);
        invs.push(b.rps);
        p50k.push(a.p50.as_secs_f64() * 1e6);
        p50i.push(b.p50.as_secs_f64() * 1e6);
    }

    // A smoke run under `cargo test` keeps quiet unless it fails.
    if full {
        let per_round = ratios
            .iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(", ");
        println!("| measurement (median of {rounds} rounds) | value |");
        println!("|---|---|");
        println!("| `GET /v1/kv/hot`, API key, req/s | {:.0} |", median(kvs));
        println!(
            "| `POST /v1/functions/echo/invoke`, API key, req/s | {:.0} |",
            median(invs)
        );
        println!(
            "| p50 latency KV / invoke, µs | {:.0} / {:.0} |",
            median(p50k),
            median(p50i)
        );
        println!(
            "| ratio invoke / KV read | **{:.2}** ({per_round}) |",
            median(ratios.clone())
        );
        println!(
            "| deploy-to-first-invoke, C echo, cold (compiled) | {:.1} ms |",
            cold.as_secs_f64() * 1000.0
        );
        println!(
            "| deploy-to-first-invoke, C echo, warm (artifact cache) | {:.1} ms |",
            warm.as_secs_f64() * 1000.0
        );
        println!(
            "({CONNECTIONS} keep-alive connections, {secs} s per run, {}-byte JSON input, node = release binary in its own process logging to a file)",
            INPUT.len()
        );
        let url = |path: &str| format!("http://{}{path}", node.addr);
        let auth_header = format!("authorization: {auth}");
        wrk::ratio_table(
            "invoke",
            &wrk::Wrk::post(&url("/v1/functions/echo/invoke"), &[&auth_header], INPUT),
            "KV read",
            &wrk::Wrk::get(&url("/v1/kv/hot"), &[&auth_header]),
            3,
        );
    }
}
