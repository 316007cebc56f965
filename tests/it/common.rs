//! A real node for tests: the `meshgate` binary started on 127.0.0.1:0 with a
//! temporary data folder, and a small HTTP client.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct TestNode {
    pub child: Option<Child>,
    pub base: String,
    pub addr: String,
    pub dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    pub operator_key: String,
    pub stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

/// Options for starting a node.
#[derive(Default, Clone)]
pub struct NodeOpts {
    /// Extra `config.toml` text.
    pub config: String,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
    /// Reuse this data folder instead of a fresh one.
    pub data_dir: Option<PathBuf>,
    /// Listen address (default 127.0.0.1:0).
    pub listen: Option<String>,
    /// Return as soon as the listener is bound, before `/readyz` is 200.
    pub no_wait_ready: bool,
}

pub const OPERATOR_KEY: &str = "mgop_test_operator_key_0123456789";

/// Generous limits so tests are not throttled unless they mean to be.
pub const TEST_CONFIG: &str = "[rate_limit]\ngeneral_per_minute = 1000000\ngeneral_burst = 100000\ncredential_per_minute = 100000\ncredential_burst = 10000\nnamespace_per_minute = 1000000\nnamespace_burst = 100000\n";

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_meshgate")
}

impl TestNode {
    pub fn start() -> TestNode {
        Self::start_with(NodeOpts {
            config: TEST_CONFIG.into(),
            ..Default::default()
        })
    }

    /// Starts the binary and waits for its "listening on" line.
    pub fn start_with(opts: NodeOpts) -> TestNode {
        let (tmp, dir) = match &opts.data_dir {
            Some(d) => (None, d.clone()),
            None => {
                let t = tempfile::tempdir().unwrap();
                let d = t.path().join("data");
                (Some(t), d)
            }
        };
        std::fs::create_dir_all(&dir).unwrap();
        let cfg_path = dir
            .parent()
            .unwrap()
            .join(format!("config-{}.toml", std::process::id()));
        std::fs::write(&cfg_path, &opts.config).unwrap();
        let mut cmd = Command::new(bin());
        cmd.arg("serve")
            .arg("--config")
            .arg(&cfg_path)
            .arg("--listen")
            .arg(opts.listen.as_deref().unwrap_or("127.0.0.1:0"))
            .arg("--data-dir")
            .arg(&dir)
            .env("MESHGATE_OPERATOR_KEY", OPERATOR_KEY)
            .env(
                "RUST_LOG",
                std::env::var("TEST_RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn meshgate");
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut l = log2.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if !sent && let Some(a) = line.strip_prefix("meshgate listening on ") {
                    let _ = tx.send(a.to_string());
                    sent = true;
                }
            }
        });
        let (scheme, addr) = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => {
                let (s, a) = a.split_once("://").expect("scheme://addr");
                (s.to_string(), a.to_string())
            }
            Err(_) => {
                let _ = child.kill();
                panic!("node did not start: {}", log.lock().unwrap());
            }
        };
        let node = TestNode {
            child: Some(child),
            base: format!("{scheme}://{addr}"),
            addr,
            dir,
            _tmp: tmp,
            operator_key: OPERATOR_KEY.into(),
            stderr: log,
        };
        if !opts.no_wait_ready {
            node.wait_ready();
        }
        node
    }

    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if http("GET", &format!("{}/readyz", self.base), &[], None).0 == 200 {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("node never became ready: {}", self.stderr.lock().unwrap());
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Sends a signal to the node.
    pub fn signal(&self, sig: i32) {
        let pid = self.child.as_ref().unwrap().id() as i32;
        unsafe_kill(pid, sig);
    }

    /// Waits for the process to exit and returns its exit code.
    pub fn wait_exit(&mut self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        let child = self.child.as_mut().unwrap();
        while Instant::now() < deadline {
            if let Some(s) = child.try_wait().unwrap() {
                return s.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Kills the node with SIGKILL and reaps it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Creates a namespace; returns its owner API key.
    pub fn create_namespace(&self, name: &str) -> String {
        let (s, b) = self.op(
            "POST",
            "/v1/namespaces",
            Some(&format!("{{\"name\":\"{name}\"}}")),
        );
        assert_eq!(s, 201, "create namespace: {b}");
        json(&b)["api_key"].as_str().unwrap().to_string()
    }

    /// A call with the operator key.
    pub fn op(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        let auth = format!("Bearer {}", self.operator_key);
        let (s, _, b) = http(
            method,
            &self.url(path),
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            body.map(str::as_bytes),
        );
        (s, String::from_utf8_lossy(&b).into_owned())
    }

    /// A call with a credential.
    pub fn with_key(
        &self,
        key: &str,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> (u16, String) {
        let auth = format!("Bearer {key}");
        let (s, _, b) = http(
            method,
            &self.url(path),
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            body,
        );
        (s, String::from_utf8_lossy(&b).into_owned())
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn unsafe_kill(pid: i32, sig: i32) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success());
}

pub fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

/// A minimal blocking HTTP/1.1 client (one request per connection), so tests
/// need no async runtime. Returns status, headers (lower-case names) and body.
pub fn http(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    http_from(None, method, url, headers, body)
}

/// The same, from a chosen local address (e.g. 127.0.0.2 to be "another client").
pub fn http_from(
    local: Option<&str>,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("http url");
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let addr: std::net::SocketAddr = hostport.parse().expect("ip:port");
    let stream = match local {
        Some(l) => socket2_connect(l, addr),
        None => {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(10)).expect("connect")
        }
    };
    let mut stream = stream;
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let body = body.unwrap_or(&[]);
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("host: {hostport}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes()).unwrap();
    stream.write_all(body).unwrap();
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    parse_response(&raw)
}

fn socket2_connect(local: &str, addr: std::net::SocketAddr) -> std::net::TcpStream {
    tokio_free::bind_connect(local.parse().expect("local ip"), addr)
}

mod tokio_free {
    /// Connect from a chosen local IP using a blocking tokio-free path: tokio's
    /// TcpSocket supports bind-before-connect, run on a throwaway runtime.
    pub fn bind_connect(
        local: std::net::IpAddr,
        addr: std::net::SocketAddr,
    ) -> std::net::TcpStream {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let sock = tokio::net::TcpSocket::new_v4().unwrap();
            sock.bind(std::net::SocketAddr::new(local, 0)).unwrap();
            let s = sock.connect(addr).await.unwrap();
            let std = s.into_std().unwrap();
            std.set_nonblocking(false).unwrap();
            std
        })
    }
}

fn parse_response(raw: &[u8]) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end: {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| {
            l.split_once(':')
                .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        })
        .collect();
    let mut body = raw[end + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
    {
        body = dechunk(&body);
    }
    (status, headers, body)
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = b.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..i]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        out.extend_from_slice(&b[i + 2..i + 2 + size]);
        b = &b[i + 2 + size + 2..];
    }
    out
}

pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}
