//! Child processes the benches start (an upstream, the node), announced on
//! their stdout, and one-shot HTTP/1.1 calls to them.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

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
