//! Test support: a real single-member etcd on free loopback ports with a
//! temporary data folder, that a test can stop and start again on the same data.
//! Shared by the store's unit tests and the integration tests (`#[path]`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct EtcdProcess {
    child: Option<Child>,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
}

/// The etcd binary: on PATH, else Debian's `/usr/bin/etcd`. Missing etcd fails
/// the test: these tests are never skipped.
fn etcd_binary() -> PathBuf {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("etcd"))
            .find(|p| p.is_file())
    });
    match on_path.or_else(|| Some(PathBuf::from("/usr/bin/etcd")).filter(|p| p.is_file())) {
        Some(p) => p,
        None => panic!(
            "etcd not found: run scripts/test.sh (it installs etcd-server) or apt-get install -y etcd-server"
        ),
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

impl EtcdProcess {
    /// Starts etcd on a fresh data folder and waits until it answers.
    pub fn start() -> EtcdProcess {
        let mut e = EtcdProcess {
            child: None,
            dir: tempfile::tempdir().expect("temp dir"),
            client_port: free_port(),
            peer_port: free_port(),
        };
        e.resume();
        e
    }

    /// The client URL, as `[cluster] etcd` takes it.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Kills etcd (SIGKILL, as a crash would) and reaps it.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Freezes etcd (SIGSTOP): its connections stay open and nothing answers.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a frozen etcd run again (SIGCONT).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("etcd is running").id();
        let status = Command::new("kill")
            .arg(sig)
            .arg(pid.to_string())
            .status()
            .expect("kill");
        assert!(status.success(), "kill {sig} {pid} failed");
    }

    /// Starts etcd again on the same data folder and ports and waits until it answers.
    pub fn resume(&mut self) {
        assert!(self.child.is_none(), "etcd is running");
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("etcd.log"))
            .expect("etcd log");
        let child = Command::new(etcd_binary())
            .arg("--name")
            .arg("test")
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .arg("--listen-client-urls")
            .arg(self.url())
            .arg("--advertise-client-urls")
            .arg(self.url())
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(format!("test={peer}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        self.child = Some(child);
        self.wait_healthy();
    }

    fn wait_healthy(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if self.healthy() {
                return;
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("etcd exited ({status}): {}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("etcd did not become healthy within 30 s: {}", self.log());
    }

    /// Whether `GET /health` answers `"health":"true"`.
    fn healthy(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.client_port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let req = format!(
            "GET /health HTTP/1.0\r\nhost: 127.0.0.1:{}\r\n\r\n",
            self.client_port
        );
        let mut body = String::new();
        s.write_all(req.as_bytes()).is_ok()
            && s.read_to_string(&mut body).is_ok()
            && body.contains("\"health\":\"true\"")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for EtcdProcess {
    fn drop(&mut self) {
        self.stop();
    }
}
