//! Functions over HTTP: requests per second of `POST /v1/functions/echo/invoke`
//! (the C echo module, through the whole chain, the namespace supervisor and
//! the WASM worker pool) against a bare actix-web handler that echoes the body,
//! in one run with the same load generator; and the deploy-to-first-invoke time
//! of the C echo module (cold: compiled; warm: the same bytes again under
//! another name, loaded from the artifact cache).
//!
//! `cargo bench --bench functions_http` prints a table. Under `cargo test` (no
//! `--bench` argument) it runs a short smoke round so the bench stays working.

#[path = "support/node.rs"]
mod node_support;

use actix_web::{App, HttpResponse, HttpServer, web};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const CONNECTIONS: usize = 16;
const BOUNDARY: &str = "meshgatebench0123";
const INPUT: &[u8] = br#"{"hello":"world"}"#;

async fn bare_echo(body: web::Bytes) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(body)
}

/// Drives `url` from CONNECTIONS keep-alive clients for `secs`; returns requests/s.
async fn load(url: String, auth: Option<String>, secs: f64) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for _ in 0..CONNECTIONS {
        let (url, auth, done) = (url.clone(), auth.clone(), done.clone());
        tasks.push(actix_web::rt::spawn(async move {
            let client = awc::Client::builder()
                .connector(awc::Connector::new().limit(1))
                .timeout(Duration::from_secs(30))
                .finish();
            while Instant::now() < end {
                let mut req = client.post(&url);
                if let Some(a) = &auth {
                    req = req.insert_header(("authorization", a.as_str()));
                }
                let mut resp = req.send_body(INPUT).await.expect("request");
                assert!(resp.status().is_success(), "{}", resp.status());
                let b = resp.body().await.unwrap();
                assert_eq!(&b[..], INPUT);
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / secs
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
async fn deploy_and_invoke(
    addr: std::net::SocketAddr,
    key: &str,
    name: &str,
    wasm: &[u8],
) -> Duration {
    let client = awc::Client::builder()
        .timeout(Duration::from_secs(60))
        .finish();
    let t = Instant::now();
    let r = client
        .post(format!("http://{addr}/v1/functions"))
        .insert_header(("authorization", format!("Bearer {key}")))
        .insert_header((
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        ))
        .send_body(multipart(name, wasm))
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let mut r = client
        .post(format!("http://{addr}/v1/functions/{name}/invoke"))
        .insert_header(("authorization", format!("Bearer {key}")))
        .send_body(INPUT)
        .await
        .unwrap();
    assert!(r.status().is_success());
    let _ = r.body().await;
    t.elapsed()
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let secs = if full { 5.0 } else { 0.3 };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = node_support::config(dir.path());
    // The load generator keeps CONNECTIONS calls in flight in one namespace.
    cfg.functions.namespace_concurrency = CONNECTIONS * 2;
    let wasm = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/functions/echo.wasm"
    ))
    .unwrap();
    let sys = actix_web::rt::System::new();
    sys.block_on(async move {
        let started = node_support::start(cfg).await;
        let (addr, key) = (started.addr, started.key);

        let cold = deploy_and_invoke(addr, &key, "echo", &wasm).await;
        let warm = deploy_and_invoke(addr, &key, "echo2", &wasm).await;

        let bare = HttpServer::new(|| App::new().route("/bare", web::post().to(bare_echo)))
            .workers(meshgate::node::num_cpus())
            .bind("127.0.0.1:0")
            .unwrap();
        let bare_addr = bare.addrs()[0];
        actix_web::rt::spawn(bare.run());
        tokio::time::sleep(Duration::from_millis(100)).await;

        let fn_url = format!("http://{addr}/v1/functions/echo/invoke");
        let bare_url = format!("http://{bare_addr}/bare");
        let auth = Some(format!("Bearer {key}"));
        load(fn_url.clone(), auth.clone(), secs / 3.0).await;
        load(bare_url.clone(), None, secs / 3.0).await;
        let bare1 = load(bare_url.clone(), None, secs).await;
        let fn_rps = load(fn_url, auth, secs).await;
        let bare2 = load(bare_url, None, secs).await;
        let bare_avg = (bare1 + bare2) / 2.0;

        // A smoke run under `cargo test` keeps quiet unless it fails.
        if full {
            println!("| measurement | value |");
            println!("|---|---|");
            println!("| bare echo handler (no chain, no WASM), req/s | {bare_avg:.0} |");
            println!("| HTTP invoke of the C echo module, req/s | {fn_rps:.0} |");
            println!("| ratio invoke / bare | {:.2} |", fn_rps / bare_avg);
            println!(
                "| deploy-to-first-invoke, C echo, cold (compiled) | {:.1} ms |",
                cold.as_secs_f64() * 1000.0
            );
            println!(
                "| deploy-to-first-invoke, C echo, warm (artifact cache) | {:.1} ms |",
                warm.as_secs_f64() * 1000.0
            );
            println!(
                "({CONNECTIONS} keep-alive connections, {secs} s each, {}-byte JSON input, load generator in-process)",
                INPUT.len()
            );
        }
        std::process::exit(0);
    });
}
