//! The cost of the request chain: requests per second of an authenticated KV
//! read through the whole chain, against the same handler work (locate the
//! namespace supervisor, ask it for the key) mounted on a bare actix-web app, in
//! one run with the same load generator. Also JWT verifications per second.
//!
//! `cargo bench --bench chain` prints a table. Under `cargo test` (no `--bench`
//! argument) it runs a short smoke round so the bench stays working.

#[path = "support/node.rs"]
mod node_support;

use actix_web::{App, HttpResponse, HttpServer, web};
use meshgate::actors::KvGet;
use meshgate::node::Node;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const CONNECTIONS: usize = 32;

async fn bare_kv(node: web::Data<Node>, key: web::Path<String>) -> HttpResponse {
    let h = node.locate("bench").await.unwrap();
    match h
        .ask(KvGet {
            key: key.into_inner(),
        })
        .await
        .unwrap()
        .unwrap()
    {
        Some(v) => HttpResponse::Ok().body(v),
        None => HttpResponse::NotFound().finish(),
    }
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
                .finish();
            while Instant::now() < end {
                let mut req = client.get(&url);
                if let Some(a) = &auth {
                    req = req.insert_header(("authorization", a.as_str()));
                }
                let mut resp = req.send().await.expect("request");
                assert!(resp.status().is_success(), "{}", resp.status());
                let _ = resp.body().await;
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / secs
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let secs = if full { 5.0 } else { 0.3 };
    let dir = tempfile::tempdir().unwrap();
    let cfg = node_support::config(dir.path());
    let sys = actix_web::rt::System::new();
    sys.block_on(async move {
        let started = node_support::start(cfg).await;
        let node = started.node.clone();
        let (addr, key) = (started.addr, started.key);
        let client = awc::Client::default();
        let mut r = client
            .post(format!("http://{addr}/v1/auth/token"))
            .send_json(&serde_json::json!({"api_key": key}))
            .await
            .unwrap();
        let v: serde_json::Value = r.json().await.unwrap();
        let jwt = v["access_token"].as_str().unwrap().to_string();
        let r = client
            .put(format!("http://{addr}/v1/kv/hot"))
            .insert_header(("authorization", format!("Bearer {jwt}")))
            .send_body(vec![b'x'; 128])
            .await
            .unwrap();
        assert!(r.status().is_success());

        let data = web::Data::new(node.clone());
        let bare = HttpServer::new(move || App::new().app_data(data.clone()).route("/bare/{key}", web::get().to(bare_kv)))
            .workers(meshgate::node::num_cpus())
            .bind("127.0.0.1:0")
            .unwrap();
        let bare_addr = bare.addrs()[0];
        actix_web::rt::spawn(bare.run());
        tokio::time::sleep(Duration::from_millis(100)).await;

        // Warm both, then measure alternately.
        let chain_url = format!("http://{addr}/v1/kv/hot");
        let bare_url = format!("http://{bare_addr}/bare/hot");
        let jwt_auth = Some(format!("Bearer {jwt}"));
        let key_auth = Some(format!("Bearer {key}"));
        load(chain_url.clone(), jwt_auth.clone(), secs / 3.0).await;
        load(bare_url.clone(), None, secs / 3.0).await;
        let bare_rps = load(bare_url.clone(), None, secs).await;
        let jwt_rps = load(chain_url.clone(), jwt_auth.clone(), secs).await;
        let key_rps = load(chain_url.clone(), key_auth.clone(), secs).await;
        let bare_rps2 = load(bare_url, None, secs).await;
        let bare_avg = (bare_rps + bare_rps2) / 2.0;

        // JWT verifications per second, single thread.
        let n = if full { 200_000 } else { 2_000 };
        let t = Instant::now();
        for _ in 0..n {
            node.jwt.verify(&jwt, meshgate::http::now(), "meshgate", "meshgate").unwrap();
        }
        let verify_rate = n as f64 / t.elapsed().as_secs_f64();

        // A smoke run under `cargo test` keeps quiet unless it fails.
        if full {
            println!("| measurement | value |");
            println!("|---|---|");
            println!("| bare handler (no chain), req/s | {bare_avg:.0} |");
            println!("| full chain, JWT, req/s | {jwt_rps:.0} |");
            println!("| full chain, API key, req/s | {key_rps:.0} |");
            println!("| ratio chain(JWT) / bare | {:.2} |", jwt_rps / bare_avg);
            println!("| ratio chain(API key) / bare | {:.2} |", key_rps / bare_avg);
            println!("| JWT verifications/s (1 thread) | {verify_rate:.0} |");
            println!("({CONNECTIONS} keep-alive connections, {secs} s each, 128-byte value, load generator in-process)");
        }
        std::process::exit(0);
    });
}
