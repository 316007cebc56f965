//! Issue #40's speed bars for the API-gateway features of deployment routes,
//! in one run, every part its own process (the upstream: this binary started
//! again with `GATEWAY_BENCH_UPSTREAM=1`; the node: the meshgate binary,
//! `serve`, or `MESHGATE_BENCH_BIN`; the load generator: this process):
//!
//! 1. requests/s of a proxied route with `auth: jwt` (a JWT verified per
//!    request, identity headers sent upstream) against the same upstream
//!    behind a route with `auth: none`, interleaved, as a ratio (bar: 0.8);
//! 2. the node's CPU (utime + stime from `/proc`) over an idle window with
//!    100 deployments whose instances have active health checks at the
//!    default interval, against the same 100 without checks (bar: < 1 % of
//!    one core for the checks).
//!
//! `cargo bench --bench gateway` prints the table. Under `cargo test` (no
//! `--bench` argument) it runs a short smoke round.

#[path = "support/load.rs"]
mod load;
#[path = "support/procs.rs"]
mod procs;

use procs::{http, spawn_announcing};
use std::process::Command;
use std::time::Duration;

const UPSTREAM_ENV: &str = "GATEWAY_BENCH_UPSTREAM";
const OPERATOR_KEY: &str = "mgop_gatewaybench_0123456789abcdef0123456789abcd";
const CONNECTIONS: usize = 32;
const BODY: &[u8] = b"{\"hello\":\"world\"}";

fn json(b: &str) -> serde_json::Value {
    serde_json::from_str(b).unwrap_or_else(|e| panic!("{e}: {b}"))
}

/// The node's CPU ticks (utime + stime).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let f: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// The share of one core the node used over `secs` of idling.
fn idle_cpu(pid: u32, secs: f64) -> f64 {
    let hz = 100.0; // USER_HZ on Linux
    let t0 = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs_f64(secs));
    (cpu_ticks(pid) - t0) as f64 / hz / secs
}

fn main() {
    if std::env::var_os(UPSTREAM_ENV).is_some() {
        return procs::run_upstream(BODY);
    }
    let full = std::env::args().any(|a| a == "--bench");
    let secs = if full { 5.0 } else { 0.3 };
    let idle_secs = if full { 30.0 } else { 0.5 };
    let dir = tempfile::tempdir().unwrap();
    let mut up_cmd = Command::new(std::env::current_exe().unwrap());
    up_cmd.env(UPSTREAM_ENV, "1");
    let (_upstream_proc, upstream) =
        spawn_announcing(up_cmd, "upstream listening on ", "the upstream");
    let (node_proc, addr) = procs::start_node(
        dir.path(),
        OPERATOR_KEY,
        "[quotas]\ndeployments = 1000\nhosts = 1000\n",
    );
    let (s, b) = http(
        &addr,
        "POST",
        "/v1/namespaces",
        Some(OPERATOR_KEY),
        Some(r#"{"name":"bench"}"#),
    );
    assert_eq!(s, 201, "create namespace: {b}");
    let key = json(&b)["api_key"].as_str().unwrap().to_string();
    let (s, b) = http(
        &addr,
        "POST",
        "/v1/auth/token",
        None,
        Some(&format!("{{\"api_key\":\"{key}\"}}")),
    );
    assert_eq!(s, 200, "token: {b}");
    let jwt = json(&b)["access_token"].as_str().unwrap().to_string();
    let deploy = |name: &str, policy: serde_json::Value, health: Option<serde_json::Value>| {
        let mut upstream_spec = serde_json::json!({"instances": [format!("http://{upstream}")]});
        if let Some(h) = health {
            upstream_spec["health"] = h;
        }
        let dep = serde_json::json!({
            "name": name, "hosts": [format!("{name}.bench.test")],
            "upstream": upstream_spec, "policy": policy,
        });
        let (s, b) = http(
            &addr,
            "POST",
            "/v1/deployments",
            Some(&key),
            Some(&dep.to_string()),
        );
        assert_eq!(s, 201, "create deployment {name}: {b}");
    };
    deploy("open", serde_json::json!({"auth": "none"}), None);
    deploy("guarded", serde_json::json!({"auth": "jwt"}), None);

    let sys = actix_web::rt::System::new();
    let (none_rps, jwt_rps) = sys.block_on(async {
        let req = |host: &str, bearer: Option<&str>| {
            let mut r = load::Request::get(format!("http://{addr}/hello")).header("host", host);
            if let Some(t) = bearer {
                r = r.header("authorization", format!("Bearer {t}"));
            }
            r.expect_body = Some(BODY.to_vec());
            r
        };
        let open = req("open.bench.test", None);
        let guarded = req("guarded.bench.test", Some(&jwt));
        for r in [&open, &guarded] {
            load::run(r.clone(), CONNECTIONS, secs / 3.0).await;
        }
        let a1 = load::run(open.clone(), CONNECTIONS, secs).await;
        let b1 = load::run(guarded.clone(), CONNECTIONS, secs).await;
        let b2 = load::run(guarded, CONNECTIONS, secs).await;
        let a2 = load::run(open, CONNECTIONS, secs).await;
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        if full {
            println!(
                "p50 / p99 ms: none {:.2} / {:.2}, jwt {:.2} / {:.2}",
                ms(a1.p50),
                ms(a1.p99),
                ms(b1.p50),
                ms(b1.p99)
            );
        }
        ((a1.rps + a2.rps) / 2.0, (b1.rps + b2.rps) / 2.0)
    });

    // 100 deployments without checks, the node idle; then the same 100 with
    // active checks at the default interval.
    let pid = node_proc.0.id();
    for i in 0..100 {
        deploy(
            &format!("plain{i}"),
            serde_json::json!({"auth": "none"}),
            None,
        );
    }
    std::thread::sleep(Duration::from_secs_f64(idle_secs / 3.0));
    let without = idle_cpu(pid, idle_secs);
    for i in 0..100 {
        deploy(
            &format!("checked{i}"),
            serde_json::json!({"auth": "none"}),
            Some(serde_json::json!({"path": "/health"})),
        );
    }
    std::thread::sleep(Duration::from_secs_f64(idle_secs / 3.0));
    let with = idle_cpu(pid, idle_secs);
    if full {
        println!(
            "{CONNECTIONS} keep-alive connections, {secs} s per run, two runs each interleaved; \
             idle windows of {idle_secs} s; every part its own process"
        );
        println!("| measure | value |");
        println!("|---|---|");
        println!("| route with `auth: none` | {none_rps:.0} req/s |");
        println!("| route with `auth: jwt` | {jwt_rps:.0} req/s |");
        println!(
            "| ratio jwt / none (bar 0.8) | **{:.2}** |",
            jwt_rps / none_rps
        );
        println!(
            "| node CPU idle, 100 deployments without checks | {:.2} % of a core |",
            without * 100.0
        );
        println!(
            "| node CPU idle, + 100 deployments with active checks (default interval) | {:.2} % of a core |",
            with * 100.0
        );
        println!(
            "| the checks' cost (bar < 1 %) | **{:.2} %** of a core |",
            (with - without) * 100.0
        );
    } else {
        assert!(jwt_rps > 0.0 && none_rps > 0.0);
    }
    drop(node_proc);
}
