//! Pub/sub across the cluster mesh (docs/design.md §6): publish-to-deliver latency
//! (p50/p99) and delivered messages per second with the subscriber on another
//! node, against the same run on a single node, as ratios.
//!
//! One run starts etcd and three processes of the meshgate binary cargo built
//! with this bench (so `--features cluster` is needed):
//! - `single node`: a standalone node (sled, no cluster); publisher and
//!   subscriber on it. The baseline.
//! - `cluster, same node`: nodes A and B on one etcd; publisher and subscriber
//!   both on A (the publish also goes out on the mesh).
//! - `cluster, cross node`: publisher on A, subscriber on B: every message
//!   crosses the libp2p GossipSub mesh and B's reorder buffer.
//!
//! Each path runs, in turns, a latency phase (one publish at a time, the next
//! once the subscriber has it) and a throughput phase (publishes acknowledged
//! in a window of `WINDOW`, counted at the subscriber, which also checks that
//! every message came once and in order). The publisher is a `/v1/ws` socket;
//! the subscriber a `/v1/pubsub/ws?format=binary` socket; the payload's first
//! 8 bytes number the message.
//!
//! `cargo bench --features cluster --bench cluster_pubsub` prints the table.
//!
//! With `BURST_RUNS=<runs>` (issue #41) it runs the burst instead: per run,
//! one publisher pipelines `BURST_MSGS` (20,000) publishes on one `/v1/ws`
//! socket, every frame written at once (the node reads on while at most 256
//! answers are pending), to one subscriber: on the single node, then on A
//! (same node, each publish also sent out on the mesh: the mesh's cost
//! without the crossing), then from A to a subscriber on B. It prints a row
//! per run (delivered, complete and in order, msgs/s of each path, and its
//! ratio to the single node's run just before) and the medians, and fails
//! unless every run of every path was complete and in order.
//! With `BURST_RUNS=<runs>` and `BURST_NODES=<n>` (and `BURST_PUBLISHERS=<p>`,
//! at most n; default n − 1) it runs the burst on a mesh of n nodes, each its
//! own process: per run, p publishers on nodes 1..p each pipeline
//! `BURST_MSGS` publishes to their own topic at once, and every node has a
//! subscriber to every publisher's topic, which checks that each came
//! complete and in per-publisher order; against the same p publishers and
//! p subscribers on the single node. The rate of a run is the messages
//! published over the time from the first write to the last delivery on
//! any subscriber. It prints a row per run and the mesh's counters of every
//! node (`meshgate_mesh_gaps_skipped_total` among them), and fails unless
//! every run was complete and in order everywhere.
//! Under `cargo test --features cluster` (no `--bench` argument) a short smoke
//! round runs and fails if a message is lost, duplicated or out of order.
//! etcd comes from Debian's `etcd-server` (`scripts/test.sh` installs it).

#[allow(dead_code)] // start and url are what the bench needs
#[path = "../src/storage/etcd_process.rs"]
mod etcd_process;

#[path = "support/ws.rs"]
mod ws;

use base64::Engine as _;
use etcd_process::EtcdProcess;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use ws::{Ws, frame};

const OPERATOR_KEY: &str = "mgop_bench_operator_key_0123456789";
const CLUSTER_SECRET: &str = "cluster-pubsub-bench-secret";
const PAYLOAD: usize = 128;
const WINDOW: usize = 64;
const IN_FLIGHT: usize = 256;

struct Sizes {
    rounds: usize,
    latency_msgs: usize,
    throughput_msgs: usize,
}

// ---- The nodes: processes of the meshgate binary. ----

/// A meshgate process, killed on drop.
struct NodeProc {
    child: Child,
    addr: String,
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_node(dir: &Path, name: &str, extra_config: &str) -> NodeProc {
    let data = dir.join(name);
    std::fs::create_dir_all(&data).unwrap();
    let cfg = dir.join(format!("{name}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "[rate_limit]\ngeneral_per_minute = 100000000\ngeneral_burst = 10000000\n\
             credential_per_minute = 100000000\ncredential_burst = 10000000\n\
             namespace_per_minute = 100000000\nnamespace_burst = 10000000\nanonymous_per_minute = 100000000\nanonymous_burst = 10000000\n{extra_config}"
        ),
    )
    .unwrap();
    let mut child = Command::new(
        // MESHGATE_BENCH_BIN runs another build of the node (a saved baseline).
        std::env::var("MESHGATE_BENCH_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_meshgate").to_string()),
    )
    .arg("serve")
    .arg("--config")
    .arg(&cfg)
    .arg("--listen")
    .arg("127.0.0.1:0")
    .arg("--data-dir")
    .arg(&data)
    .env("MESHGATE_OPERATOR_KEY", OPERATOR_KEY)
    .env("MESHGATE_CLUSTER_SECRET", CLUSTER_SECRET)
    .env(
        "RUST_LOG",
        std::env::var("BENCH_NODE_LOG").unwrap_or_else(|_| "error".into()),
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit())
    .spawn()
    .expect("spawn the meshgate binary");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        // Keep reading so the node never blocks on a full pipe.
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(a) = line.strip_prefix("meshgate listening on http://")
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(a.to_string());
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("node {name} did not start"));
    let node = NodeProc { child, addr };
    let deadline = Instant::now() + Duration::from_secs(30);
    while http(&node.addr, "GET", "/readyz", None).0 != 200 {
        assert!(Instant::now() < deadline, "node {name} never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    node
}

/// One HTTP/1.1 exchange with the operator key (`Connection: close`).
fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {OPERATOR_KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    if s.write_all(req.as_bytes()).is_err() {
        return (0, String::new());
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Creates a namespace through `addr`; returns its owner API key.
fn create_namespace(addr: &str, body: &str) -> String {
    let (s, b) = http(addr, "POST", "/v1/namespaces", Some(body));
    assert_eq!(s, 201, "create namespace: {b}");
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    v["api_key"].as_str().unwrap().to_string()
}

/// The value of an unlabelled gauge in `/metrics`.
fn gauge(addr: &str, name: &str) -> f64 {
    let (_, b) = http(addr, "GET", "/metrics", None);
    b.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

// ---- The clients. ----

/// A subscriber socket on `addr`; every message's number and arrival instant
/// goes to the returned channel.
async fn subscriber(addr: &str, key: &str, topic: &str) -> mpsc::UnboundedReceiver<(u64, Instant)> {
    let path = format!("/v1/pubsub/ws?topic={topic}&format=binary&token={key}");
    // The subscription is live once the 101 has arrived.
    let mut ws = Ws::connect(addr, &path).await.expect("subscriber connects");
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let mut pings = 0;
            let mut got = Vec::new();
            let read = ws
                .read_frames(|op, d| match op {
                    0x2 if d.len() >= 8 => got.push(u64::from_be_bytes(d[..8].try_into().unwrap())),
                    0x9 => pings += 1,
                    _ => {}
                })
                .await;
            let now = Instant::now();
            for n in got {
                if tx.send((n, now)).is_err() {
                    return;
                }
            }
            for _ in 0..pings {
                let _ = ws.send(0xA, b"").await;
            }
            if read.is_err() {
                return;
            }
        }
    });
    rx
}

/// The publishing socket: `/v1/ws`, one `publish` frame per message, each
/// answered in order.
struct Publisher {
    ws: Ws,
    topic: String,
    pad: Vec<u8>,
}

impl Publisher {
    async fn connect(addr: &str, key: &str, topic: &str) -> Publisher {
        Publisher {
            ws: Ws::connect(addr, &format!("/v1/ws?token={key}"))
                .await
                .expect("publisher connects"),
            topic: topic.to_string(),
            pad: vec![b'x'; PAYLOAD - 8],
        }
    }

    fn publish_frame(&self, n: u64) -> Vec<u8> {
        let mut data = n.to_be_bytes().to_vec();
        data.extend_from_slice(&self.pad);
        let b64 = base64::engine::general_purpose::STANDARD.encode(&data);
        frame(
            0x1,
            format!(
                "{{\"id\":{n},\"type\":\"publish\",\"topic\":\"{}\",\"data_base64\":\"{b64}\"}}",
                self.topic
            )
            .as_bytes(),
        )
    }

    /// Reads at least one frame; returns the number of publish answers.
    async fn acks(&mut self) -> usize {
        let mut acks = 0;
        let mut pings = 0;
        let read = self.ws.read_frames(|op, d| match op {
            0x1 if d.starts_with(b"{\"id\"") => {
                assert!(
                    d.windows(9).any(|w| w == b"\"ok\":true"),
                    "publish refused: {}",
                    String::from_utf8_lossy(d)
                );
                acks += 1;
            }
            0x9 => pings += 1,
            _ => {}
        });
        tokio::time::timeout(Duration::from_secs(120), read)
            .await
            .expect("the publisher's answers stopped for 120 s")
            .expect("publisher socket");
        for _ in 0..pings {
            self.ws.send(0xA, b"").await.unwrap();
        }
        acks
    }
}

struct Route {
    name: &'static str,
    pub_addr: String,
    sub_addr: String,
    key: String,
    topic: String,
}

struct Connected {
    publisher: Publisher,
    sub: mpsc::UnboundedReceiver<(u64, Instant)>,
    next: u64,
}

/// Connects both ends and publishes until one message has come through
/// (the mesh's first message to a new topic on a peer may take a heartbeat).
async fn connect(p: &Route) -> Connected {
    let mut sub = subscriber(&p.sub_addr, &p.key, &p.topic).await;
    let mut publisher = Publisher::connect(&p.pub_addr, &p.key, &p.topic).await;
    // Warm-up numbers, never counted.
    for next in (1u64 << 62)..(1u64 << 62) + 100 {
        publisher
            .ws
            .wr
            .write_all(&publisher.publish_frame(next))
            .await
            .unwrap();
        publisher.acks().await;
        if tokio::time::timeout(Duration::from_millis(300), sub.recv())
            .await
            .is_ok()
        {
            // Let stragglers of the warm-up land, then forget them.
            tokio::time::sleep(Duration::from_millis(300)).await;
            while sub.try_recv().is_ok() {}
            return Connected {
                publisher,
                sub,
                next: 0,
            };
        }
    }
    panic!("{}: a warm-up message never reached the subscriber", p.name);
}

#[derive(Default)]
struct Outcome {
    latencies_ms: Vec<f64>,
    loaded_latencies_ms: Vec<f64>,
    delivered: u64,
    seconds: f64,
    faults: Vec<String>,
}

/// One publish at a time; the next goes once the subscriber has this one.
async fn latency_phase(c: &mut Connected, n: usize, out: &mut Outcome) {
    for _ in 0..n {
        let id = c.next;
        c.next += 1;
        let frame = c.publisher.publish_frame(id);
        let t0 = Instant::now();
        c.publisher.ws.wr.write_all(&frame).await.unwrap();
        match tokio::time::timeout(Duration::from_secs(10), c.sub.recv()).await {
            Ok(Some((got, at))) if got == id => {
                out.latencies_ms.push((at - t0).as_secs_f64() * 1e3)
            }
            Ok(Some((got, _))) => out.faults.push(format!("expected {id}, got {got}")),
            _ => {
                out.faults.push(format!("message {id} never came"));
                return;
            }
        }
        // Its answer (it may come after the delivery).
        let mut acked = 0;
        while acked == 0 {
            acked = c.publisher.acks().await;
        }
    }
}

/// `n` publishes kept flowing with at most `WINDOW` unanswered and at most
/// `IN_FLIGHT` published but not yet delivered (below the subscriber's
/// outbound queue of 1,024 frames, so the subscriber is never a slow
/// consumer); delivered messages counted until the last one arrives.
async fn throughput_phase(c: &mut Connected, n: usize, out: &mut Outcome) {
    let first = c.next;
    let mut sent_at: Vec<Instant> = Vec::with_capacity(n);
    let (mut acked, mut received) = (0usize, 0usize);
    let mut expect = first;
    let start = Instant::now();
    let mut last_at = start;
    while received < n {
        let mut batch = Vec::new();
        while sent_at.len() < n
            && sent_at.len() - acked < WINDOW
            && sent_at.len() - received < IN_FLIGHT
        {
            batch.extend(c.publisher.publish_frame(first + sent_at.len() as u64));
            sent_at.push(Instant::now());
        }
        if !batch.is_empty() {
            c.publisher.ws.wr.write_all(&batch).await.unwrap();
        }
        if acked < sent_at.len() {
            acked += c.publisher.acks().await;
        } else {
            // Everything answered and the window full: wait for a delivery.
            match tokio::time::timeout(Duration::from_secs(30), c.sub.recv()).await {
                Ok(Some((got, at))) => {
                    note(got, at, first, &sent_at, &mut expect, out);
                    received += 1;
                    last_at = at;
                }
                _ => {
                    out.faults
                        .push(format!("{} of {n} messages never came", n - received));
                    break;
                }
            }
        }
        while let Ok((got, at)) = c.sub.try_recv() {
            note(got, at, first, &sent_at, &mut expect, out);
            received += 1;
            last_at = at;
        }
    }
    // Answers still unread (a delivery can come before its answer).
    while acked < sent_at.len() {
        acked += c.publisher.acks().await;
    }
    c.next = first + n as u64;
    out.delivered += received as u64;
    out.seconds += (last_at - start).as_secs_f64();
}

fn note(
    got: u64,
    at: Instant,
    first: u64,
    sent_at: &[Instant],
    expect: &mut u64,
    out: &mut Outcome,
) {
    if got != *expect {
        eprintln!("fault: expected {expect}, got {got}");
        out.faults.push(format!("expected {expect}, got {got}"));
    }
    *expect = got + 1;
    if let Some(t0) = got.checked_sub(first).and_then(|i| sent_at.get(i as usize)) {
        out.loaded_latencies_ms.push((at - *t0).as_secs_f64() * 1e3);
    }
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * q).round() as usize]
}

/// One pipelined burst: `n` publishes written at once on a fresh `/v1/ws`
/// socket of `p.pub_addr` while the answers are read, counted at the
/// already-warm subscriber `sub` until all came or nothing came for 10 s.
/// Returns (delivered, complete and in order, msgs/s from the first write to
/// the last delivery).
async fn burst(
    p: &Route,
    sub: &mut mpsc::UnboundedReceiver<(u64, Instant)>,
    first: u64,
    n: usize,
) -> (usize, bool, f64) {
    let publisher = Publisher::connect(&p.pub_addr, &p.key, &p.topic).await;
    let frames: Vec<u8> = (0..n as u64)
        .flat_map(|i| publisher.publish_frame(first + i))
        .collect();
    let Ws { mut rd, mut wr, .. } = publisher.ws;
    let start = Instant::now();
    let writer = tokio::spawn(async move {
        wr.write_all(&frames).await.expect("publisher writes");
        wr
    });
    let answers = tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let (mut acked, mut refused) = (0usize, 0usize);
        let mut buf: Vec<u8> = Vec::new();
        let mut chunk = vec![0u8; 1 << 16];
        while acked < n {
            let k = match tokio::time::timeout(Duration::from_secs(60), rd.read(&mut chunk)).await {
                Ok(Ok(k)) if k > 0 => k,
                _ => break,
            };
            buf.extend_from_slice(&chunk[..k]);
            let mut pos = 0;
            while let Some((op, range, used)) = ws::parse(&buf[pos..]) {
                let d = &buf[pos + range.start..pos + range.end];
                if op == 0x1 && d.starts_with(b"{\"id\"") {
                    acked += 1;
                    if !d.windows(9).any(|w| w == b"\"ok\":true") {
                        refused += 1;
                    }
                }
                pos += used;
            }
            buf.drain(..pos);
        }
        (acked, refused, rd)
    });
    let mut expect = first;
    let mut in_order = true;
    let mut delivered = 0usize;
    let mut last_at = start;
    while delivered < n {
        match tokio::time::timeout(Duration::from_secs(10), sub.recv()).await {
            Ok(Some((got, at))) => {
                if got >= 1 << 62 {
                    continue; // a warm-up straggler
                }
                if got != expect {
                    in_order = false;
                }
                expect = got + 1;
                delivered += 1;
                last_at = at;
            }
            _ => break,
        }
    }
    let (acked, refused, _rd) = answers.await.expect("answers task");
    let _wr = writer.await.expect("writer task");
    if acked != n || refused > 0 {
        eprintln!(
            "{}: {acked} of {n} publishes answered, {refused} refused",
            p.name
        );
        in_order = false;
    }
    let rate = delivered as f64 / (last_at - start).as_secs_f64().max(1e-9);
    (delivered, in_order && delivered == n, rate)
}

/// One publisher pipelines `n` publishes (numbered from `first`) on `topic`
/// at `pub_addr`; each of `subs` (already warm, subscribed to `topic`)
/// must receive all of them in order. Returns the subscribers, whether each
/// got all in order, and the time from the first write to the last
/// delivery.
async fn fan_burst(
    pub_addr: String,
    key: String,
    topic: String,
    subs: Vec<mpsc::UnboundedReceiver<(u64, Instant)>>,
    first: u64,
    n: usize,
) -> (
    Vec<mpsc::UnboundedReceiver<(u64, Instant)>>,
    Vec<bool>,
    Instant,
    Instant,
) {
    let publisher = Publisher::connect(&pub_addr, &key, &topic).await;
    let frames: Vec<u8> = (0..n as u64)
        .flat_map(|i| publisher.publish_frame(first + i))
        .collect();
    let Ws { mut rd, mut wr, .. } = publisher.ws;
    let start = Instant::now();
    let writer = tokio::spawn(async move {
        wr.write_all(&frames).await.expect("publisher writes");
        wr
    });
    let answers = tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let (mut acked, mut refused) = (0usize, 0usize);
        let mut buf: Vec<u8> = Vec::new();
        let mut chunk = vec![0u8; 1 << 16];
        while acked < n {
            let k = match tokio::time::timeout(Duration::from_secs(60), rd.read(&mut chunk)).await {
                Ok(Ok(k)) if k > 0 => k,
                _ => break,
            };
            buf.extend_from_slice(&chunk[..k]);
            let mut pos = 0;
            while let Some((op, range, used)) = ws::parse(&buf[pos..]) {
                let d = &buf[pos + range.start..pos + range.end];
                if op == 0x1 && d.starts_with(b"{\"id\"") {
                    acked += 1;
                    if !d.windows(9).any(|w| w == b"\"ok\":true") {
                        refused += 1;
                    }
                }
                pos += used;
            }
            buf.drain(..pos);
        }
        (acked, refused, rd)
    });
    let mut readers = Vec::new();
    for mut sub in subs {
        readers.push(tokio::spawn(async move {
            let (mut expect, mut in_order, mut delivered, mut last_at) = (first, true, 0, start);
            while delivered < n {
                match tokio::time::timeout(Duration::from_secs(10), sub.recv()).await {
                    Ok(Some((got, at))) => {
                        if got >= 1 << 62 {
                            continue; // a warm-up straggler
                        }
                        in_order &= got == expect;
                        expect = got + 1;
                        delivered += 1;
                        last_at = at;
                    }
                    _ => break,
                }
            }
            if delivered < n {
                eprintln!("a subscriber got {delivered} of {n}");
            }
            (sub, in_order && delivered == n, last_at)
        }));
    }
    let mut subs = Vec::new();
    let mut ok = Vec::new();
    let mut last = start;
    for r in readers {
        let (sub, good, at) = r.await.expect("reader task");
        subs.push(sub);
        ok.push(good);
        last = last.max(at);
    }
    let (acked, refused, _rd) = answers.await.expect("answers task");
    let _wr = writer.await.expect("writer task");
    if acked != n || refused > 0 {
        eprintln!("{topic}: {acked} of {n} publishes answered, {refused} refused");
        ok.iter_mut().for_each(|o| *o = false);
    }
    (subs, ok, start, last)
}

/// One run of `publishers` concurrent fan bursts: publisher i on
/// `pub_addrs[i]`, topic `topics[i]`, its subscribers `subs[i]`. Returns
/// whether every subscriber got everything in order, and msgs/s (all
/// publishes over first write to last delivery).
async fn fan_run(
    pub_addrs: &[String],
    key: &str,
    topics: &[String],
    subs: &mut Vec<Vec<mpsc::UnboundedReceiver<(u64, Instant)>>>,
    first: u64,
    n: usize,
) -> (bool, f64) {
    let mut tasks = Vec::new();
    for (i, s) in std::mem::take(subs).into_iter().enumerate() {
        tasks.push(tokio::spawn(fan_burst(
            pub_addrs[i].clone(),
            key.to_string(),
            topics[i].clone(),
            s,
            first,
            n,
        )));
    }
    let (mut all_ok, mut start, mut last) = (true, None::<Instant>, None::<Instant>);
    for t in tasks {
        let (s, ok, st, la) = t.await.expect("burst task");
        subs.push(s);
        all_ok &= ok.iter().all(|o| *o);
        start = Some(start.map_or(st, |x: Instant| x.min(st)));
        last = Some(last.map_or(la, |x: Instant| x.max(la)));
    }
    let (start, last) = (
        start.unwrap_or_else(Instant::now),
        last.unwrap_or_else(Instant::now),
    );
    let rate = (n * pub_addrs.len()) as f64 / (last - start).as_secs_f64().max(1e-9);
    (all_ok, rate)
}

/// The mesh burst (`BURST_RUNS` with `BURST_NODES`): see the module's comment.
fn mesh_burst_main(
    runs: usize,
    msgs: usize,
    publishers: usize,
    single: (&NodeProc, &str),
    cluster: (&[NodeProc], &str),
) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (nodes, ckey) = cluster;
    let topics: Vec<String> = (0..publishers).map(|i| format!("bench.p{i}")).collect();
    let mut rows = Vec::new();
    rt.block_on(async {
        // Warm every (publisher, subscriber) pair, keeping the subscribers.
        let mut single_subs = Vec::new();
        let mut mesh_subs = Vec::new();
        for (i, topic) in topics.iter().enumerate() {
            let route = |name, pub_addr: &str, sub_addr: &str, key: &str| Route {
                name,
                pub_addr: pub_addr.to_string(),
                sub_addr: sub_addr.to_string(),
                key: key.to_string(),
                topic: topic.clone(),
            };
            single_subs.push(vec![
                connect(&route("single", &single.0.addr, &single.0.addr, single.1))
                    .await
                    .sub,
            ]);
            let mut subs = Vec::new();
            for node in nodes {
                subs.push(
                    connect(&route("mesh", &nodes[i].addr, &node.addr, ckey))
                        .await
                        .sub,
                );
            }
            mesh_subs.push(subs);
        }
        let single_pubs = vec![single.0.addr.clone(); publishers];
        let mesh_pubs: Vec<String> = nodes[..publishers].iter().map(|n| n.addr.clone()).collect();
        for run in 0..runs {
            let first = (run * msgs) as u64;
            let s = fan_run(
                &single_pubs,
                single.1,
                &topics,
                &mut single_subs,
                first,
                msgs,
            )
            .await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            let m = fan_run(&mesh_pubs, ckey, &topics, &mut mesh_subs, first, msgs).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            eprintln!(
                "run {}: single {} {:.0} msgs/s; mesh {} {:.0} msgs/s",
                run + 1,
                s.0,
                s.1,
                m.0,
                m.1
            );
            rows.push((s, m));
        }
    });
    let n = nodes.len();
    println!(
        "{runs} runs: {publishers} publishers × {msgs} publishes of {PAYLOAD} B pipelined on /v1/ws; on {n} nodes every node subscribes to every publisher's topic"
    );
    println!();
    println!(
        "| run | single node: complete, in order | msgs/s | {n} nodes: complete, in order on every node | msgs/s | ratio |"
    );
    println!("|---:|:---:|---:|:---:|---:|---:|");
    let yes = |b: bool| if b { "yes" } else { "no" };
    for (i, (s, m)) in rows.iter().enumerate() {
        println!(
            "| {} | {} | {:.0} | {} | {:.0} | {:.2} |",
            i + 1,
            yes(s.0),
            s.1,
            yes(m.0),
            m.1,
            m.1 / s.1.max(1e-9)
        );
    }
    let med = |f: &dyn Fn(&((bool, f64), (bool, f64))) -> f64| {
        quantile(&mut rows.iter().map(f).collect::<Vec<_>>(), 0.5)
    };
    let (s_med, m_med) = (med(&|r| r.0.1), med(&|r| r.1.1));
    let r_med = med(&|r| r.1.1 / r.0.1.max(1e-9));
    let complete = |k: usize| {
        rows.iter()
            .filter(|r| if k == 0 { r.0.0 } else { r.1.0 })
            .count()
    };
    println!();
    println!(
        "complete and in order: single {}/{runs}, {n} nodes {}/{runs}; median msgs/s: single {s_med:.0}, {n} nodes {m_med:.0}; ratio of the medians {:.2}, median of the per-run ratios {r_med:.2}",
        complete(0),
        complete(1),
        m_med / s_med.max(1e-9),
    );
    for (i, node) in nodes.iter().enumerate() {
        let (_, m) = http(&node.addr, "GET", "/metrics", None);
        for l in m.lines().filter(|l| l.starts_with("meshgate_mesh_")) {
            println!("n{}: {l}", i + 1);
        }
    }
    assert!(
        complete(0) == runs && complete(1) == runs,
        "a burst lost, duplicated or reordered messages"
    );
}

/// The burst mode (`BURST_RUNS`): see the module's comment.
fn burst_main(
    runs: usize,
    msgs: usize,
    single: &Route,
    same: &Route,
    cross: &Route,
    nodes: &[(&str, &NodeProc)],
) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut rows = Vec::new();
    rt.block_on(async {
        let mut subs = Vec::new();
        for p in [single, same, cross] {
            // Warm: the mesh's first message to a topic may take a heartbeat.
            subs.push(connect(p).await.sub);
        }
        for run in 0..runs {
            let first = (run * msgs) as u64;
            let mut row = Vec::new();
            for (p, sub) in [single, same, cross].into_iter().zip(subs.iter_mut()) {
                let r = burst(p, sub, first, msgs).await;
                eprintln!(
                    "run {}: {}: {} delivered, complete and in order {}, {:.0} msgs/s",
                    run + 1,
                    p.name,
                    r.0,
                    r.1,
                    r.2
                );
                row.push(r);
                // Let the nodes settle between bursts.
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            rows.push(row);
        }
    });
    println!(
        "{runs} runs of {msgs} publishes of {PAYLOAD} B pipelined on one /v1/ws socket to one subscriber (format=binary)"
    );
    println!();
    println!(
        "| run | single: delivered | in order | msgs/s | A→A (same node): in order | msgs/s | ratio | A→B: delivered | in order | msgs/s | ratio A→B / single |"
    );
    println!("|---:|---:|:---:|---:|:---:|---:|---:|---:|:---:|---:|---:|");
    let yes = |b: bool| if b { "yes" } else { "no" };
    let ratio = |r: &Vec<(usize, bool, f64)>, k: usize| r[k].2 / r[0].2.max(1e-9);
    for (i, r) in rows.iter().enumerate() {
        println!(
            "| {} | {} | {} | {:.0} | {} | {:.0} | {:.2} | {} | {} | {:.0} | {:.2} |",
            i + 1,
            r[0].0,
            yes(r[0].1),
            r[0].2,
            yes(r[1].1),
            r[1].2,
            ratio(r, 1),
            r[2].0,
            yes(r[2].1),
            r[2].2,
            ratio(r, 2)
        );
    }
    let med = |k: usize| quantile(&mut rows.iter().map(|r| r[k].2).collect::<Vec<_>>(), 0.5);
    let (s_med, a_med, c_med) = (med(0), med(1), med(2));
    let med_ratio = |k: usize| {
        quantile(
            &mut rows.iter().map(|r| ratio(r, k)).collect::<Vec<_>>(),
            0.5,
        )
    };
    let complete = |k: usize| rows.iter().filter(|r| r[k].1).count();
    println!();
    println!(
        "complete and in order: single {}/{runs}, A→A {}/{runs}, A→B {}/{runs}; median msgs/s: single {s_med:.0}, A→A {a_med:.0}, A→B {c_med:.0}; A→B / single: ratio of the medians {:.2}, median of the per-run ratios {:.2}; A→A / single: {:.2}, {:.2}",
        complete(0),
        complete(1),
        complete(2),
        c_med / s_med.max(1e-9),
        med_ratio(2),
        a_med / s_med.max(1e-9),
        med_ratio(1),
    );
    for (name, node) in nodes {
        let (_, m) = http(&node.addr, "GET", "/metrics", None);
        for l in m.lines().filter(|l| {
            l.starts_with("meshgate_mesh_")
                || l.starts_with("meshgate_pubsub_dropped")
                || l.starts_with("meshgate_ws_slow_consumers")
        }) {
            println!("{name}: {l}");
        }
    }
    assert!(
        (0..3).all(|k| complete(k) == runs),
        "a burst lost, duplicated or reordered messages"
    );
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let burst_runs: Option<usize> = std::env::var("BURST_RUNS")
        .ok()
        .and_then(|v| v.parse().ok());
    let burst_msgs: usize = std::env::var("BURST_MSGS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let sizes = if full {
        Sizes {
            rounds: 3,
            latency_msgs: 1000,
            throughput_msgs: 10_000,
        }
    } else {
        Sizes {
            rounds: 1,
            latency_msgs: 30,
            throughput_msgs: 300,
        }
    };
    let etcd = EtcdProcess::start();
    let tmp = tempfile::tempdir().unwrap();
    let single = start_node(tmp.path(), "single", "");
    let cluster = |id: &str| {
        format!(
            "[cluster]\netcd = [\"{}\"]\nnode_id = \"{id}\"\nregister_seconds = 1\n",
            etcd.url()
        )
    };
    let mesh_nodes: Option<usize> = std::env::var("BURST_NODES")
        .ok()
        .and_then(|v| v.parse().ok());
    if let (Some(runs), Some(n)) = (burst_runs, mesh_nodes) {
        let n = n.max(2);
        let publishers: usize = std::env::var("BURST_PUBLISHERS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(n - 1)
            .clamp(1, n);
        let nodes: Vec<NodeProc> = (1..=n)
            .map(|i| start_node(tmp.path(), &format!("n{i}"), &cluster(&format!("n{i}"))))
            .collect();
        let members: Vec<String> = (1..=n).map(|i| format!("\"n{i}\"")).collect();
        let single_key = create_namespace(&single.addr, r#"{"name":"bench"}"#);
        let cluster_key = create_namespace(
            &nodes[0].addr,
            &format!(r#"{{"name":"bench","members":[{}]}}"#, members.join(",")),
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        while nodes
            .iter()
            .any(|node| gauge(&node.addr, "meshgate_mesh_peers") < (n - 1) as f64)
        {
            assert!(Instant::now() < deadline, "the mesh never formed");
            std::thread::sleep(Duration::from_millis(200));
        }
        mesh_burst_main(
            runs,
            burst_msgs,
            publishers,
            (&single, &single_key),
            (&nodes, &cluster_key),
        );
        drop((nodes, single, etcd));
        return;
    }
    let a = start_node(tmp.path(), "a", &cluster("a"));
    let b = start_node(tmp.path(), "b", &cluster("b"));

    eprintln!("nodes: single {}, a {}, b {}", single.addr, a.addr, b.addr);
    let single_key = create_namespace(&single.addr, r#"{"name":"bench"}"#);
    let cluster_key = create_namespace(&a.addr, r#"{"name":"bench","members":["a","b"]}"#);
    let deadline = Instant::now() + Duration::from_secs(60);
    while gauge(&a.addr, "meshgate_mesh_peers") < 1.0 || gauge(&b.addr, "meshgate_mesh_peers") < 1.0
    {
        assert!(
            Instant::now() < deadline,
            "the mesh between A and B never formed"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let paths = [
        Route {
            name: "single node",
            pub_addr: single.addr.clone(),
            sub_addr: single.addr.clone(),
            key: single_key,
            topic: "bench.single".into(),
        },
        Route {
            name: "cluster, same node",
            pub_addr: a.addr.clone(),
            sub_addr: a.addr.clone(),
            key: cluster_key.clone(),
            topic: "bench.same".into(),
        },
        Route {
            name: "cluster, cross node",
            pub_addr: a.addr.clone(),
            sub_addr: b.addr.clone(),
            key: cluster_key,
            topic: "bench.cross".into(),
        },
    ];

    if let Some(runs) = burst_runs {
        burst_main(
            runs,
            burst_msgs,
            &paths[0],
            &paths[1],
            &paths[2],
            &[("single", &single), ("A", &a), ("B", &b)],
        );
        drop((a, b, single, etcd));
        return;
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut outcomes: Vec<Outcome> = paths.iter().map(|_| Outcome::default()).collect();
    rt.block_on(async {
        let mut conns = Vec::new();
        for p in &paths {
            conns.push(connect(p).await);
        }
        // Paths in turns, so a slow moment of the machine hits them all.
        for _ in 0..sizes.rounds {
            for ((c, out), p) in conns.iter_mut().zip(outcomes.iter_mut()).zip(&paths) {
                eprintln!("{}: latency", p.name);
                latency_phase(c, sizes.latency_msgs, out).await;
                eprintln!("{}: throughput", p.name);
                throughput_phase(c, sizes.throughput_msgs, out).await;
            }
        }
    });

    println!(
        "{} rounds of {} sequential + {} flowing (≤ {WINDOW} unanswered, ≤ {IN_FLIGHT} undelivered) publishes of {PAYLOAD} B per path",
        sizes.rounds, sizes.latency_msgs, sizes.throughput_msgs
    );
    println!();
    println!(
        "| path | publish→deliver p50 | p99 | delivered msgs/s | p50 under load | p99 under load | ratio msgs/s | ratio p50 |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut base: Option<(f64, f64)> = None;
    let mut faults = Vec::new();
    for (p, o) in paths.iter().zip(outcomes.iter_mut()) {
        let p50 = quantile(&mut o.latencies_ms, 0.50);
        let p99 = quantile(&mut o.latencies_ms, 0.99);
        let lp50 = quantile(&mut o.loaded_latencies_ms, 0.50);
        let lp99 = quantile(&mut o.loaded_latencies_ms, 0.99);
        let rate = o.delivered as f64 / o.seconds.max(1e-9);
        let (b_rate, b_p50) = *base.get_or_insert((rate, p50));
        println!(
            "| {} | {p50:.2} ms | {p99:.2} ms | {rate:.0} | {lp50:.2} ms | {lp99:.2} ms | {:.2} | {:.2} |",
            p.name,
            rate / b_rate,
            p50 / b_p50
        );
        faults.extend(o.faults.iter().map(|f| format!("{}: {f}", p.name)));
    }
    // The mesh's own counters (batch sizes, drops, gaps), for reading a run.
    for (name, node) in [("A", &a), ("B", &b)] {
        let (_, m) = http(&node.addr, "GET", "/metrics", None);
        for l in m
            .lines()
            .filter(|l| l.starts_with("meshgate_mesh_") || l.starts_with("meshgate_actor_mailbox"))
        {
            eprintln!("{name}: {l}");
        }
    }
    drop((a, b, single, etcd));
    if !faults.is_empty() {
        for f in faults.iter().take(20) {
            eprintln!("{f}");
        }
        panic!(
            "{} delivery faults (lost, duplicated or out of order)",
            faults.len()
        );
    }
}
