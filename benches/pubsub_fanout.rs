//! Fan-out load bench: drives a running meshgate node and a running
//! nats-server over real WebSockets with the same client (this file's small
//! WebSocket client on tokio), doing the same job: 1 publisher, SUBS
//! subscribers on one topic, PAYLOAD-byte messages, a window of in-flight
//! publishes. Then opens IDLE idle subscribers and reads each server's RSS.
//!
//! Run through `scripts/bench-pubsub.sh`, which starts both servers and sets:
//! `MG_ADDR`, `MG_KEY`, `MG_PID`, `NATS_ADDR` (its websocket listener),
//! `NATS_PID`; optional `SUBS` (1000), `MSGS` (2000), `PAYLOAD` (128),
//! `WINDOW` (32), `IDLE` (5000), `FORMAT` (`binary`, or `json`: meshgate's
//! JSON frames) and `TOPIC` (`bench`; the script gives topics `hist.*` a
//! history rule, so `TOPIC=hist.bench` publishes to a history topic).
//! Without them it prints how to run and exits.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use ws::{Ws, frame};

#[path = "support/ws.rs"]
mod ws;

fn env_or(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

#[derive(Clone, Copy, PartialEq)]
enum Server {
    Meshgate,
    Nats,
}

#[derive(Clone)]
struct Target {
    server: Server,
    addr: String,
    key: String,
    pid: u32,
}

impl Target {
    fn name(&self) -> &'static str {
        match self.server {
            Server::Meshgate => "meshgate",
            Server::Nats => "nats-server",
        }
    }
}

/// NATS protocol inside WebSocket frames: counts MSGs, notes PINGs and PONGs.
#[derive(Default)]
struct NatsParser {
    buf: Vec<u8>,
}

#[derive(Default)]
struct NatsEvents {
    msgs: u64,
    pings: u64,
    pongs: u64,
}

impl NatsParser {
    fn feed(&mut self, data: &[u8], ev: &mut NatsEvents) {
        self.buf.extend_from_slice(data);
        let mut at = 0;
        loop {
            let rest = &self.buf[at..];
            let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
                break;
            };
            let line = &rest[..eol];
            if line.starts_with(b"MSG ") {
                let size: usize = std::str::from_utf8(line)
                    .ok()
                    .and_then(|l| l.rsplit(' ').next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                if rest.len() < eol + 2 + size + 2 {
                    break;
                }
                ev.msgs += 1;
                at += eol + 2 + size + 2;
            } else {
                if line == b"PING" {
                    ev.pings += 1;
                } else if line == b"PONG" {
                    ev.pongs += 1;
                } else if line.starts_with(b"-ERR") {
                    eprintln!("nats: {}", String::from_utf8_lossy(line));
                }
                at += eol + 2;
            }
        }
        self.buf.drain(..at);
    }
}

/// Opens a subscriber on `topic` and waits until the server has it.
async fn subscribe(t: &Target, topic: &str) -> std::io::Result<Ws> {
    match t.server {
        Server::Meshgate => {
            let format = std::env::var("FORMAT").unwrap_or_else(|_| "binary".into());
            let path = format!(
                "/v1/pubsub/ws?topic={topic}&format={format}&token={}",
                t.key
            );
            // The subscription is live once the 101 arrives.
            Ws::connect(&t.addr, &path).await
        }
        Server::Nats => {
            let mut ws = Ws::connect(&t.addr, "/").await?;
            let cmd = format!(
                "CONNECT {{\"verbose\":false,\"pedantic\":false,\"protocol\":1}}\r\nSUB {topic} 1\r\nPING\r\n"
            );
            ws.send(0x2, cmd.as_bytes()).await?;
            let mut p = NatsParser::default();
            let mut ev = NatsEvents::default();
            while ev.pongs == 0 {
                ws.read_frames(|_, d| p.feed(d, &mut ev)).await?;
            }
            Ok(ws)
        }
    }
}

/// Reads until `want` messages arrived, adding each batch to `total`.
async fn drain(t: Server, mut ws: Ws, want: u64, total: Arc<AtomicU64>) -> std::io::Result<Ws> {
    let mut got = 0u64;
    let mut p = NatsParser::default();
    while got < want {
        let mut ev = NatsEvents::default();
        let mut pings = 0u64;
        ws.read_frames(|op, d| match (t, op) {
            (Server::Meshgate, 0x1 | 0x2) => ev.msgs += 1,
            (Server::Meshgate, 0x9) => pings += 1,
            (Server::Nats, 0x1 | 0x2) => p.feed(d, &mut ev),
            _ => {}
        })
        .await?;
        for _ in 0..pings {
            ws.send(0xA, b"").await?;
        }
        for _ in 0..ev.pings {
            ws.send(0x2, b"PONG\r\n").await?;
        }
        got += ev.msgs;
        total.fetch_add(ev.msgs, Ordering::Relaxed);
    }
    Ok(ws)
}

struct FanoutResult {
    delivered_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    complete: bool,
}

async fn fanout(
    t: &Target,
    subs: usize,
    msgs: usize,
    payload: usize,
    window: usize,
) -> FanoutResult {
    let topic = std::env::var("TOPIC").unwrap_or_else(|_| "bench".into());
    let topic = topic.as_str();
    let total = Arc::new(AtomicU64::new(0));
    let mut readers = Vec::with_capacity(subs);
    let conns = futures_util::future::join_all((0..subs).map(|_| subscribe(t, topic))).await;
    for c in conns {
        let ws = c.expect("subscriber connects");
        readers.push(tokio::spawn(drain(
            t.server,
            ws,
            msgs as u64,
            total.clone(),
        )));
    }
    // The publisher.
    let mut publisher = match t.server {
        Server::Meshgate => Ws::connect(&t.addr, &format!("/v1/ws?token={}", t.key))
            .await
            .expect("publisher connects"),
        Server::Nats => {
            let mut ws = Ws::connect(&t.addr, "/").await.expect("publisher connects");
            ws.send(
                0x2,
                b"CONNECT {\"verbose\":false,\"pedantic\":false,\"protocol\":1}\r\n",
            )
            .await
            .unwrap();
            ws
        }
    };
    let data = vec![b'x'; payload];
    let b64 = {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(&data)
    };
    let mut sent_at: Vec<Instant> = Vec::with_capacity(msgs);
    let mut latencies: Vec<f64> = Vec::with_capacity(msgs);
    let mut acked = 0usize;
    let mut parser = NatsParser::default();
    let start = Instant::now();
    while acked < msgs {
        // Fill the window.
        let mut out = Vec::new();
        while sent_at.len() < msgs && sent_at.len() - acked < window {
            let i = sent_at.len();
            match t.server {
                Server::Meshgate => out.extend(frame(
                    0x1,
                    format!("{{\"id\":{i},\"type\":\"publish\",\"topic\":\"{topic}\",\"data_base64\":\"{b64}\"}}")
                        .as_bytes(),
                )),
                Server::Nats => {
                    let mut p = format!("PUB {topic} {payload}\r\n").into_bytes();
                    p.extend_from_slice(&data);
                    p.extend_from_slice(b"\r\nPING\r\n");
                    out.extend(frame(0x2, &p));
                }
            }
            sent_at.push(Instant::now());
        }
        if !out.is_empty() {
            publisher.wr.write_all(&out).await.unwrap();
        }
        // Read acks (in order).
        let mut acks = 0usize;
        let mut ev = NatsEvents::default();
        publisher
            .read_frames(|op, d| match t.server {
                // An answer to a publish (a history topic's has `epoch` and
                // `offset` too, and its keys come in name order).
                Server::Meshgate if op == 0x1 && is_answer(d) && memchr_ok(d) => {
                    acks += 1;
                }
                Server::Nats => parser.feed(d, &mut ev),
                _ => {}
            })
            .await
            .unwrap();
        if t.server == Server::Nats {
            acks = ev.pongs as usize;
        }
        let now = Instant::now();
        for t0 in &sent_at[acked..acked + acks] {
            latencies.push((now - *t0).as_secs_f64() * 1000.0);
        }
        acked += acks;
    }
    // Wait for every subscriber (bounded).
    let want = (msgs * subs) as u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    while total.load(Ordering::Relaxed) < want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let got = total.load(Ordering::Relaxed);
    for r in readers {
        r.abort();
    }
    latencies.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p) as usize];
    FanoutResult {
        delivered_per_s: got as f64 / elapsed,
        p50_ms: q(0.50),
        p99_ms: q(0.99),
        complete: got == want,
    }
}

/// Whether an ack frame says ok (a refused publish would be an error).
fn is_answer(d: &[u8]) -> bool {
    d.starts_with(b"{") && d.windows(5).any(|w| w == b"\"id\":")
}

fn memchr_ok(d: &[u8]) -> bool {
    let ok = d.windows(9).any(|w| w == b"\"ok\":true");
    if !ok {
        eprintln!("publish refused: {}", String::from_utf8_lossy(d));
    }
    ok
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// RSS growth per idle subscriber, in bytes.
async fn idle(t: &Target, n: usize) -> (f64, usize) {
    let before = rss_kib(t.pid);
    let mut conns = Vec::with_capacity(n);
    for chunk in (0..n).collect::<Vec<_>>().chunks(200) {
        let batch =
            futures_util::future::join_all(chunk.iter().map(|_| subscribe(t, "idle"))).await;
        for c in batch {
            match c {
                Ok(ws) => conns.push(ws),
                Err(e) => eprintln!("{}: idle connect failed: {e}", t.name()),
            }
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = rss_kib(t.pid);
    let open = conns.len();
    drop(conns);
    tokio::time::sleep(Duration::from_millis(500)).await;
    (
        (after.saturating_sub(before) as f64 * 1024.0) / open.max(1) as f64,
        open,
    )
}

fn main() {
    let (Ok(mg_addr), Ok(nats_addr)) = (std::env::var("MG_ADDR"), std::env::var("NATS_ADDR"))
    else {
        println!("pubsub_fanout: run scripts/bench-pubsub.sh (it starts meshgate and nats-server)");
        return;
    };
    let subs = env_or("SUBS", 1000);
    let msgs = env_or("MSGS", 2000);
    let payload = env_or("PAYLOAD", 128);
    let window = env_or("WINDOW", 32);
    let idle_n = env_or("IDLE", 5000);
    let mg = Target {
        server: Server::Meshgate,
        addr: mg_addr,
        key: std::env::var("MG_KEY").unwrap_or_default(),
        pid: env_or("MG_PID", 0) as u32,
    };
    let nats = Target {
        server: Server::Nats,
        addr: nats_addr,
        key: String::new(),
        pid: env_or("NATS_PID", 0) as u32,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let format = std::env::var("FORMAT").unwrap_or_else(|_| "binary".into());
        let topic = std::env::var("TOPIC").unwrap_or_else(|_| "bench".into());
        println!(
            "1 publisher, {subs} subscribers, {msgs} messages of {payload} B, window {window}, meshgate frames {format}, topic {topic}"
        );
        let mut rows = Vec::new();
        for t in [&mg, &nats] {
            let r = fanout(t, subs, msgs, payload, window).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            let (per_idle, open) = idle(t, idle_n).await;
            rows.push((t.name(), r, per_idle, open));
        }
        println!();
        println!(
            "| server | delivered msgs/s | publish-ack p50 | publish-ack p99 | all delivered | RSS per idle subscriber ({idle_n} conns) |"
        );
        println!("|---|---:|---:|---:|---|---:|");
        for (name, r, per_idle, open) in &rows {
            println!(
                "| {name} | {:.0} | {:.2} ms | {:.2} ms | {} | {:.1} KiB ({open} open) |",
                r.delivered_per_s,
                r.p50_ms,
                r.p99_ms,
                if r.complete { "yes" } else { "NO" },
                per_idle / 1024.0
            );
        }
        let ratio = rows[0].1.delivered_per_s / rows[1].1.delivered_per_s.max(1.0);
        println!();
        println!("meshgate / nats-server delivered msgs/s: {ratio:.2} (goal >= 1.0)");
    });
}
