//! The node as an operator runs it, and a lean HTTP/1.1 load generator.
//!
//! [`NodeProcess`] starts the release `meshgate` binary (`serve`, its own
//! process, its own logging to a file) on a free loopback port. [`run`]
//! drives one request from N keep-alive connections on a thread of its own
//! (a current-thread tokio runtime, pre-built request bytes, a minimal
//! response parser; wrk-like, so the generator costs little next to the
//! node), checking every answer's status (and body when asked).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub const OPERATOR_KEY: &str = "mgop_bench_operator_key_0123456789abcdef";

/// A running node process; killed on drop.
pub struct NodeProcess {
    pub addr: SocketAddr,
    pub child: Child,
    #[allow(dead_code)] // read by whoever wants the node's log after a run
    pub log: PathBuf,
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl NodeProcess {
    /// Starts the binary with `extra` appended to a config whose rate limits
    /// are lifted; returns once `/readyz` answers 200.
    pub fn start(dir: &Path, extra: &str) -> NodeProcess {
        let data = dir.join("data");
        std::fs::create_dir_all(&data).unwrap();
        let cfg = dir.join("config.toml");
        let big = u32::MAX / 2;
        std::fs::write(
            &cfg,
            format!(
                "[server]\nlisten = \"127.0.0.1:0\"\n\n[rate_limit]\ngeneral_per_minute = {big}\ngeneral_burst = {big}\nnamespace_per_minute = {big}\nnamespace_burst = {big}\nanonymous_per_minute = {big}\nanonymous_burst = {big}\n\n{extra}\n"
            ),
        )
        .unwrap();
        let log = dir.join("node.log");
        let log_file = std::fs::File::create(&log).unwrap();
        // MESHGATE_BENCH_BIN runs another build of the node (a saved baseline).
        let bin = std::env::var("MESHGATE_BENCH_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_meshgate").to_string());
        let mut child = Command::new(bin)
            .arg("serve")
            .arg("--config")
            .arg(&cfg)
            .arg("--data-dir")
            .arg(&data)
            .env("MESHGATE_OPERATOR_KEY", OPERATOR_KEY)
            .stdout(Stdio::piped())
            .stderr(log_file)
            .spawn()
            .expect("start the meshgate binary");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if !sent && let Some(a) = line.strip_prefix("meshgate listening on ") {
                    let _ = tx.send(a.trim().to_string());
                    sent = true;
                }
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| {
                panic!(
                    "the node never listened: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            });
        let addr: SocketAddr = line
            .strip_prefix("http://")
            .unwrap_or_else(|| panic!("not a plain HTTP listener: {line}"))
            .parse()
            .unwrap();
        let node = NodeProcess { addr, child, log };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok((200, _)) = node.call("GET", "/readyz", &[], b"") {
                break;
            }
            assert!(Instant::now() < deadline, "the node never became ready");
            std::thread::sleep(Duration::from_millis(50));
        }
        node
    }

    /// One request on a fresh connection: (status, body).
    pub fn call(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> std::io::Result<(u16, Vec<u8>)> {
        let mut s = TcpStream::connect(self.addr)?;
        s.write_all(&request_bytes(method, path, headers, body))?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 8192];
        loop {
            if let Some((status, used, len)) = parse_head(&buf)? {
                while buf.len() < used + len {
                    let n = s.read(&mut chunk)?;
                    if n == 0 {
                        return Err(std::io::Error::other("closed mid-body"));
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                return Ok((status, buf[used..used + len].to_vec()));
            }
            let n = s.read(&mut chunk)?;
            if n == 0 {
                return Err(std::io::Error::other("closed before an answer"));
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Creates namespace `name`; returns its owner API key.
    pub fn namespace(&self, name: &str) -> String {
        let auth = format!("Bearer {OPERATOR_KEY}");
        let body = format!("{{\"name\":\"{name}\"}}");
        let (st, b) = self
            .call(
                "POST",
                "/v1/namespaces",
                &[
                    ("authorization", &auth),
                    ("content-type", "application/json"),
                ],
                body.as_bytes(),
            )
            .unwrap();
        assert!(st < 300, "{st} {}", String::from_utf8_lossy(&b));
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        v["api_key"].as_str().unwrap().to_string()
    }

    /// An access token (JWT) for an API key.
    #[allow(dead_code)] // not every bench uses a JWT
    pub fn jwt(&self, key: &str) -> String {
        let body = format!("{{\"api_key\":\"{key}\"}}");
        let (st, b) = self
            .call(
                "POST",
                "/v1/auth/token",
                &[("content-type", "application/json")],
                body.as_bytes(),
            )
            .unwrap();
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        v["access_token"].as_str().unwrap().to_string()
    }
}

/// The bytes of one HTTP/1.1 keep-alive request.
pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut r = format!("{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n");
    for (k, v) in headers {
        r.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" || method == "PUT" {
        r.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    r.push_str("\r\n");
    let mut r = r.into_bytes();
    r.extend_from_slice(body);
    r
}

/// The head of an answer at the start of `b`: (status, head length, body length).
fn parse_head(b: &[u8]) -> std::io::Result<Option<(u16, usize, usize)>> {
    let Some(end) = b.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = std::str::from_utf8(&b[..end]).map_err(std::io::Error::other)?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line in {head:?}")))?;
    let mut len = 0;
    for l in lines {
        let (k, v) = l.split_once(':').unwrap_or((l, ""));
        if k.eq_ignore_ascii_case("content-length") {
            len = v.trim().parse().map_err(std::io::Error::other)?;
        } else if k.eq_ignore_ascii_case("transfer-encoding") {
            return Err(std::io::Error::other("chunked answers are not supported"));
        }
    }
    Ok(Some((status, end + 4, len)))
}

/// One kind of request to repeat.
#[derive(Clone)]
pub struct Load {
    pub bytes: Vec<u8>,
    /// When set, every answer's body must equal it.
    pub expect_body: Option<Vec<u8>>,
}

/// What a run measured.
#[derive(Clone, Copy, Debug)]
pub struct Outcome {
    pub rps: f64,
    pub p50: Duration,
    #[allow(dead_code)] // not every bench prints it
    pub p99: Duration,
}

/// Drives `load` at `addr` from `connections` keep-alive connections for
/// `secs`, on a thread of its own; every answer must be 2xx.
pub fn run(addr: SocketAddr, load: &Load, connections: usize, secs: f64) -> Outcome {
    let load = load.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let load = std::sync::Arc::new(load);
            let end = Instant::now() + Duration::from_secs_f64(secs);
            let mut tasks = Vec::new();
            for _ in 0..connections {
                let load = load.clone();
                tasks.push(tokio::spawn(async move {
                    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
                    s.set_nodelay(true).unwrap();
                    let mut buf: Vec<u8> = Vec::with_capacity(16384);
                    let mut chunk = vec![0u8; 16384];
                    let mut lat = Vec::with_capacity(100_000);
                    while Instant::now() < end {
                        let t = Instant::now();
                        s.write_all(&load.bytes).await.expect("write");
                        buf.clear();
                        let (status, used, len) = loop {
                            if let Some(h) = parse_head(&buf).expect("answer head") {
                                break h;
                            }
                            let n = s.read(&mut chunk).await.expect("read");
                            assert!(n > 0, "the node closed the connection");
                            buf.extend_from_slice(&chunk[..n]);
                        };
                        while buf.len() < used + len {
                            let n = s.read(&mut chunk).await.expect("read");
                            assert!(n > 0, "the node closed the connection mid-body");
                            buf.extend_from_slice(&chunk[..n]);
                        }
                        assert!(
                            (200..300).contains(&status),
                            "{status}: {}",
                            String::from_utf8_lossy(&buf)
                        );
                        if let Some(want) = &load.expect_body {
                            assert_eq!(&buf[used..used + len], &want[..]);
                        }
                        lat.push(t.elapsed());
                    }
                    lat
                }));
            }
            let mut all = Vec::new();
            for t in tasks {
                all.extend(t.await.unwrap());
            }
            all.sort();
            let pct = |p: f64| {
                all.get(((all.len() as f64 * p) as usize).min(all.len().saturating_sub(1)))
                    .copied()
                    .unwrap_or_default()
            };
            Outcome {
                rps: all.len() as f64 / secs,
                p50: pct(0.50),
                p99: pct(0.99),
            }
        })
    })
    .join()
    .expect("load thread")
}

/// The median of `v`.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
