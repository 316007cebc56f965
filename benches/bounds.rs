//! Bounded compiles and unpacks (issue #39): the node's memory under the
//! attacks of the issue, sampled from `/proc/<pid>/status` (VmRSS every
//! 5 ms while each attack runs, and VmHWM, the process's high-water mark).
//!
//! One node (its own process, benches/support/raw.rs) with the default
//! `[functions]` and `[deploy]` settings except `max_site_unpacked_bytes =
//! 128 MiB`, so the many-file bomb (250 MiB in 250 distinct files, under
//! the default 256 MiB) is refused after it has streamed half its bytes to
//! disk, the worst case of a refusal, instead of being stored (the
//! per-namespace site quota is another setting). The attacks, one after
//! the other:
//!
//! - 16 concurrent deploys of a 255 KB tarball holding one 250 MiB file;
//! - 16 concurrent deploys of a 255 KB tarball of 250 distinct 1 MiB files;
//! - a module of 100,000 functions; a module of one function of 1,000,000
//!   values; both at once, twice over (four deploys, two namespaces);
//! - for scale, what is accepted: a module at the function limit (10,000),
//!   two of them at once (two namespaces).
//!
//! Each row gives the answers, the RSS before, the highest RSS sampled
//! during, the difference, VmHWM after, and the wall time.
//!
//! `cargo bench --features cluster --bench bounds` prints the table. Under
//! `cargo test` (no `--bench` argument) it runs the smallest attacks only,
//! so the bench stays working.

#[path = "support/raw.rs"]
#[allow(dead_code)] // the load generator is not used here
mod raw;

use raw::NodeProcess;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const BOUNDARY: &str = "meshgateboundsbench";

fn multipart(parts: &[(&str, &[u8])]) -> Vec<u8> {
    let mut body = Vec::new();
    for (name, data) in parts {
        body.extend_from_slice(
            format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\n\r\n").as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    body
}

/// One field of `/proc/<pid>/status`, in KiB.
fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// Samples VmRSS every 5 ms until dropped; `peak` is the highest seen.
struct Sampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(pid: u32) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(status_kib(pid, "VmRSS:")));
        let (s, p) = (stop.clone(), peak.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(status_kib(pid, "VmRSS:"), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        Sampler {
            stop,
            peak,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

// ---- attack modules and archives, built here ----

fn leb(mut v: u64, out: &mut Vec<u8>) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

fn section(id: u8, content: &[u8], out: &mut Vec<u8>) {
    out.push(id);
    leb(content.len() as u64, out);
    out.extend_from_slice(content);
}

/// One type `[] -> []`, one function per body, the first exported `_start`.
fn binary_module(bodies: &[Vec<u8>]) -> Vec<u8> {
    let mut m = b"\0asm\x01\0\0\0".to_vec();
    section(1, &[1, 0x60, 0, 0], &mut m);
    let mut funcs = Vec::new();
    leb(bodies.len() as u64, &mut funcs);
    funcs.extend(std::iter::repeat_n(0u8, bodies.len()));
    section(3, &funcs, &mut m);
    let mut exp = vec![1, 6];
    exp.extend_from_slice(b"_start");
    exp.extend_from_slice(&[0, 0]);
    section(7, &exp, &mut m);
    let mut code = Vec::new();
    leb(bodies.len() as u64, &mut code);
    for b in bodies {
        leb(b.len() as u64 + 1, &mut code);
        code.extend_from_slice(b);
        code.push(0x0b);
    }
    section(10, &code, &mut m);
    m
}

fn many_functions(n: usize) -> Vec<u8> {
    binary_module(&vec![vec![0u8]; n])
}

fn many_values(values: usize) -> Vec<u8> {
    let mut body = vec![0u8, 0x41, 0x01];
    for _ in 1..values {
        body.extend_from_slice(&[0x41, 0x01, 0x6a]);
    }
    body.push(0x1a);
    binary_module(&[body])
}

fn tarball(files: &[(String, Vec<u8>)]) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    let mut b = tar::Builder::new(gz);
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, path, &data[..]).unwrap();
    }
    b.into_inner().unwrap().finish().unwrap()
}

/// Zeros, distinct by their first bytes.
fn zeros(n: usize, tag: u32) -> Vec<u8> {
    let mut v = vec![0u8; n];
    v[..4].copy_from_slice(&tag.to_le_bytes());
    v
}

// ---- the run ----

struct Row {
    what: String,
    answers: String,
    before: u64,
    peak: u64,
    hwm: u64,
    secs: f64,
}

/// Runs `jobs` at once (each one request: (namespace key, path, body)),
/// sampling the node's memory; returns the row.
fn attack(node: &NodeProcess, what: &str, jobs: Vec<(String, String, Vec<u8>)>) -> Row {
    let pid = node.child.id();
    let before = status_kib(pid, "VmRSS:");
    let sampler = Sampler::start(pid);
    let t = Instant::now();
    let addr = node.addr;
    let threads: Vec<_> = jobs
        .into_iter()
        .map(|(key, path, body)| {
            std::thread::spawn(move || {
                let ct = format!("multipart/form-data; boundary={BOUNDARY}");
                let auth = format!("Bearer {key}");
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
                use std::io::{Read, Write};
                s.write_all(&raw::request_bytes(
                    "POST",
                    &path,
                    &[
                        ("authorization", &auth),
                        ("content-type", &ct),
                        ("connection", "close"),
                    ],
                    &body,
                ))
                .unwrap();
                let mut out = Vec::new();
                let _ = s.read_to_end(&mut out);
                let text = String::from_utf8_lossy(&out);
                let status = text.get(9..12).unwrap_or("???").to_string();
                let code = text
                    .split("\"code\":\"")
                    .nth(1)
                    .and_then(|c| c.split('"').next())
                    .unwrap_or("")
                    .to_string();
                if code.is_empty() {
                    status
                } else {
                    format!("{status} {code}")
                }
            })
        })
        .collect();
    let mut answers: Vec<String> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let secs = t.elapsed().as_secs_f64();
    let peak = sampler.finish();
    answers.sort();
    let mut counted: Vec<(String, usize)> = Vec::new();
    for a in answers {
        match counted.last_mut() {
            Some((last, n)) if *last == a => *n += 1,
            _ => counted.push((a, 1)),
        }
    }
    let answers = counted
        .iter()
        .map(|(a, n)| format!("{n}× {a}"))
        .collect::<Vec<_>>()
        .join(", ");
    Row {
        what: what.into(),
        answers,
        before,
        peak,
        hwm: status_kib(pid, "VmHWM:"),
        secs,
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let dir = tempfile::tempdir().unwrap();
    let node = NodeProcess::start(
        dir.path(),
        "[deploy]\nmax_site_unpacked_bytes = 134217728\n",
    );
    let keys: Vec<String> = (0..4).map(|i| node.namespace(&format!("b{i}"))).collect();
    let (bomb_mib, copies, files) = if full { (250, 16, 250) } else { (16, 2, 16) };

    let one = tarball(&[
        ("index.html".into(), b"<h1>hi</h1>".to_vec()),
        ("bomb.bin".into(), zeros(bomb_mib << 20, 0)),
    ]);
    let many_files: Vec<(String, Vec<u8>)> = (0..files)
        .map(|i| {
            (
                format!("f{i}.bin"),
                zeros((bomb_mib << 20) / files, i as u32 + 1),
            )
        })
        .collect();
    let many = tarball(&many_files);
    drop(many_files);
    let site = |i: usize, t: &[u8]| {
        let name = format!("s{i}");
        let host = format!("s{i}.bomb.test");
        multipart(&[
            ("name", name.as_bytes()),
            ("hosts", host.as_bytes()),
            ("tarball", t),
        ])
    };
    let module = |name: &str, wasm: &[u8]| multipart(&[("name", name.as_bytes()), ("wasm", wasm)]);

    let mut rows = Vec::new();
    let jobs = (0..copies)
        .map(|i| (keys[i % 4].clone(), "/v1/deployments".into(), site(i, &one)))
        .collect();
    rows.push(attack(
        &node,
        &format!(
            "{copies} concurrent tarballs of one {bomb_mib} MiB file ({} KB each)",
            one.len() / 1000
        ),
        jobs,
    ));
    let jobs = (0..copies)
        .map(|i| {
            (
                keys[i % 4].clone(),
                "/v1/deployments".into(),
                site(100 + i, &many),
            )
        })
        .collect();
    rows.push(attack(
        &node,
        &format!(
            "{copies} concurrent tarballs of {files} distinct files, {bomb_mib} MiB ({} KB each)",
            many.len() / 1000
        ),
        jobs,
    ));
    let (fns, values) = if full {
        (100_000, 1_000_000)
    } else {
        (20_000, 400_000)
    };
    let fns_m = many_functions(fns);
    let values_m = many_values(values);
    rows.push(attack(
        &node,
        &format!("module of {fns} functions ({} KB)", fns_m.len() / 1000),
        vec![(
            keys[0].clone(),
            "/v1/functions".into(),
            module("fns", &fns_m),
        )],
    ));
    rows.push(attack(
        &node,
        &format!(
            "module of one function of {values} values ({} KB)",
            values_m.len() / 1000
        ),
        vec![(
            keys[0].clone(),
            "/v1/functions".into(),
            module("values", &values_m),
        )],
    ));
    rows.push(attack(
        &node,
        "both modules at once, twice (two namespaces)",
        vec![
            (
                keys[0].clone(),
                "/v1/functions".into(),
                module("fns", &fns_m),
            ),
            (
                keys[0].clone(),
                "/v1/functions".into(),
                module("values", &values_m),
            ),
            (
                keys[1].clone(),
                "/v1/functions".into(),
                module("fns", &fns_m),
            ),
            (
                keys[1].clone(),
                "/v1/functions".into(),
                module("values", &values_m),
            ),
        ],
    ));
    if full {
        let at_limit = many_functions(10_000);
        rows.push(attack(
            &node,
            "accepted: module of 10,000 functions (the limit)",
            vec![(
                keys[2].clone(),
                "/v1/functions".into(),
                module("limit", &at_limit),
            )],
        ));
        let other = many_functions(9_999);
        let third = many_functions(9_998);
        rows.push(attack(
            &node,
            "accepted: two such modules at once (two namespaces)",
            vec![
                (
                    keys[3].clone(),
                    "/v1/functions".into(),
                    module("limit", &other),
                ),
                (
                    keys[2].clone(),
                    "/v1/functions".into(),
                    module("limit2", &third),
                ),
            ],
        ));
    }

    println!(
        "\n| attack | answers | VmRSS before (MiB) | VmRSS peak during (MiB) | peak − before (MiB) | VmHWM after (MiB) | wall (s) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:+.0} | {:.0} | {:.2} |",
            r.what,
            r.answers,
            mib(r.before),
            mib(r.peak),
            mib(r.peak) - mib(r.before),
            mib(r.hwm),
            r.secs
        );
    }
}
