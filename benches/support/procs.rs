//! Child processes the benches start (an upstream, the node), announced on
//! their stdout, and one-shot HTTP/1.1 calls to them.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The upstream process of a proxy bench: a small actix-web app answering
/// every path with `body`, one worker per core. Prints its address, then
/// serves until killed.
pub fn run_upstream(body: &'static [u8]) {
    use actix_web::{App, HttpResponse, HttpServer, web};
    actix_web::rt::System::new().block_on(async move {
        let srv = HttpServer::new(move || {
            App::new().default_service(web::to(move || async move {
                HttpResponse::Ok()
                    .content_type("application/json")
                    .body(body)
            }))
        })
        .workers(meshgate::node::num_cpus())
        .backlog(4096)
        .bind("127.0.0.1:0")
        .unwrap();
        println!("upstream listening on {}", srv.addrs()[0]);
        std::io::stdout().flush().unwrap();
        srv.run().await.unwrap();
    });
}

/// Starts the meshgate binary as [`start_node`] describes and returns once
/// it announces its `scheme` (`http`, or `https` with a `[tls]` section in
/// `extra_toml`) address, not yet ready.
pub fn spawn_node(
    dir: &std::path::Path,
    operator_key: &str,
    extra_toml: &str,
    scheme: &str,
) -> (Proc, String) {
    let data = dir.join("node");
    std::fs::create_dir_all(&data).unwrap();
    let cfg = dir.join("node.toml");
    std::fs::write(
        &cfg,
        format!(
            "[rate_limit]\ngeneral_per_minute = 1000000000\ngeneral_burst = 100000000\n\
             credential_per_minute = 1000000000\ncredential_burst = 100000000\n\
             namespace_per_minute = 1000000000\nnamespace_burst = 100000000\n\
             anonymous_per_minute = 1000000000\nanonymous_burst = 100000000\n\
             [deploy]\nupstream_allow = [\"127.0.0.0/8\"]\n{extra_toml}"
        ),
    )
    .unwrap();
    let mut cmd = Command::new(
        std::env::var("MESHGATE_BENCH_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_meshgate").to_string()),
    );
    cmd.arg("serve")
        .arg("--config")
        .arg(&cfg)
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(&data)
        .env("MESHGATE_OPERATOR_KEY", operator_key)
        .env(
            "RUST_LOG",
            std::env::var("BENCH_NODE_LOG").unwrap_or_else(|_| "warn".into()),
        );
    let announce: &'static str = if scheme == "https" {
        "meshgate listening on https://"
    } else {
        "meshgate listening on http://"
    };
    spawn_announcing(cmd, announce, "the meshgate node")
}

/// Starts the meshgate binary (`MESHGATE_BENCH_BIN`, another build such as
/// a saved baseline or a release, or this build's) with the rate limits
/// lifted, loopback upstreams allowed, `operator_key`, and `extra_toml`
/// appended to its config; waits until it is ready.
pub fn start_node(dir: &std::path::Path, operator_key: &str, extra_toml: &str) -> (Proc, String) {
    let (node, addr) = spawn_node(dir, operator_key, extra_toml, "http");
    let deadline = Instant::now() + Duration::from_secs(30);
    while http(&addr, "GET", "/readyz", None, None).0 != 200 {
        assert!(Instant::now() < deadline, "the node never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    (node, addr)
}

/// A child process killed (and reaped) on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns `cmd` and waits for its stdout line starting with `prefix`.
pub fn spawn_announcing(mut cmd: Command, prefix: &'static str, what: &str) -> (Proc, String) {
    let mut child = Proc(
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {what}: {e}")),
    );
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(a) = line.strip_prefix(prefix)
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(a.trim().to_string());
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{what} did not start"));
    (child, addr)
}

/// One HTTP/1.1 exchange (`Connection: close`) with a bearer credential.
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&str>,
) -> (u16, String) {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let body = body.unwrap_or("");
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}\
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
