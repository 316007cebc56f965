//! Test support: a real single-member etcd on free loopback ports with a
//! temporary data folder, that a test can stop and start again on the same data.
//! Shared by the store's unit tests and the integration tests (`#[path]`).
//!
//! Flavours: plain `http://` ([`EtcdProcess::start_plain`]); `https://` with
//! client-certificate auth against a throwaway CA made with `openssl` at test
//! time ([`EtcdProcess::start_tls`], see [`TestPki`]); and users
//! ([`EtcdProcess::enable_auth`]). [`EtcdProcess::start`] is plain unless
//! `MESHGATE_TEST_ETCD_TLS=1`, so every etcd test can be run over TLS.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct EtcdProcess {
    child: Option<Child>,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    /// Serves `/health` over plain HTTP in every flavour.
    metrics_port: u16,
    /// The certificates of the TLS flavour.
    tls: Option<TestPki>,
    /// The user and password of [`EtcdProcess::enable_auth`].
    user: Option<(String, String)>,
}

/// A throwaway PKI made with `openssl`: a CA, a server certificate for
/// 127.0.0.1 and a client certificate it signed (both usable as either).
pub struct TestPki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run openssl ({e}): run scripts/test.sh (it installs openssl) or apt-get install -y openssl"
            )
        });
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TestPki {
    /// Makes a CA named `name` and two certificates it signed, in `dir/name/`.
    pub fn generate(dir: &Path, name: &str) -> TestPki {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).expect("pki dir");
        std::fs::write(
            d.join("ca.cnf"),
            format!(
                "[req]\ndistinguished_name = dn\nprompt = no\nx509_extensions = v3_ca\n[dn]\nCN = {name} test CA\n[v3_ca]\nbasicConstraints = critical,CA:TRUE\nkeyUsage = critical,keyCertSign,cRLSign\nsubjectKeyIdentifier = hash\n"
            ),
        )
        .expect("ca.cnf");
        std::fs::write(
            d.join("leaf.cnf"),
            "[leaf]\nbasicConstraints = critical,CA:FALSE\nkeyUsage = critical,digitalSignature\nextendedKeyUsage = serverAuth,clientAuth\nsubjectAltName = IP:127.0.0.1,DNS:localhost\nauthorityKeyIdentifier = keyid\n",
        )
        .expect("leaf.cnf");
        let key = |file: &str| {
            openssl(
                &d,
                &[
                    "genpkey",
                    "-algorithm",
                    "EC",
                    "-pkeyopt",
                    "ec_paramgen_curve:P-256",
                    "-out",
                    file,
                ],
            )
        };
        key("ca.key");
        openssl(
            &d,
            &[
                "req", "-x509", "-new", "-key", "ca.key", "-config", "ca.cnf", "-days", "2",
                "-out", "ca.pem",
            ],
        );
        for (leaf, cn) in [("server", "127.0.0.1"), ("client", "meshgate")] {
            let (k, csr, pem) = (
                format!("{leaf}.key"),
                format!("{leaf}.csr"),
                format!("{leaf}.pem"),
            );
            key(&k);
            openssl(
                &d,
                &[
                    "req",
                    "-new",
                    "-key",
                    &k,
                    "-subj",
                    &format!("/CN={cn}"),
                    "-out",
                    &csr,
                ],
            );
            let serial = format!(
                "{}",
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .expect("the clock is past 1970")
                    .as_nanos()
            );
            openssl(
                &d,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-set_serial",
                    &serial,
                    "-days",
                    "2",
                    "-extfile",
                    "leaf.cnf",
                    "-extensions",
                    "leaf",
                    "-out",
                    &pem,
                ],
            );
        }
        TestPki {
            ca: d.join("ca.pem"),
            server_cert: d.join("server.pem"),
            server_key: d.join("server.key"),
            client_cert: d.join("client.pem"),
            client_key: d.join("client.key"),
        }
    }
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
    /// Starts etcd on a fresh data folder and waits until it answers: over
    /// TLS with client certificates when `MESHGATE_TEST_ETCD_TLS=1`, else plain.
    pub fn start() -> EtcdProcess {
        if std::env::var("MESHGATE_TEST_ETCD_TLS").is_ok_and(|v| v == "1") {
            Self::start_tls()
        } else {
            Self::start_plain()
        }
    }

    /// Starts etcd on plain `http://`.
    pub fn start_plain() -> EtcdProcess {
        Self::launch(false)
    }

    /// Starts etcd on `https://` with `--client-cert-auth`: it trusts only the
    /// client certificates of its own throwaway CA ([`EtcdProcess::pki`]).
    pub fn start_tls() -> EtcdProcess {
        Self::launch(true)
    }

    fn launch(tls: bool) -> EtcdProcess {
        let dir = tempfile::tempdir().expect("temp dir");
        let tls = tls.then(|| TestPki::generate(dir.path(), "etcd-pki"));
        let mut e = EtcdProcess {
            child: None,
            dir,
            client_port: free_port(),
            peer_port: free_port(),
            metrics_port: free_port(),
            tls,
            user: None,
        };
        // A free port is probed, released, then bound by etcd: another test
        // process may take it in between. Such a start is tried again on
        // fresh ports (the data folder is still empty); any other failure,
        // or a fifth lost race, panics with etcd's log.
        for attempt in 1.. {
            e.spawn();
            match e.wait_healthy() {
                Ok(()) => break,
                Err(log) if attempt < 5 && log.contains("address already in use") => {
                    e.stop();
                    let _ = std::fs::remove_dir_all(e.dir.path().join("data"));
                    let _ = std::fs::remove_file(e.dir.path().join("etcd.log"));
                    e.client_port = free_port();
                    e.peer_port = free_port();
                    e.metrics_port = free_port();
                }
                Err(log) => panic!("{log}"),
            }
        }
        e
    }

    /// The peer URL (raft between etcd members: `/members`, `/raft`).
    pub fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    /// The client URL, as `[cluster] etcd` takes it.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The certificates of the TLS flavour.
    pub fn pki(&self) -> Option<&TestPki> {
        self.tls.as_ref()
    }

    /// The `[cluster]` lines that reach this etcd: the endpoint, and the CA
    /// and client certificate (TLS flavour) or the user (after
    /// [`EtcdProcess::enable_auth`]; its password file is written here).
    pub fn cluster_toml(&self) -> String {
        let mut t = format!("etcd = [\"{}\"]\n", self.url());
        if let Some(p) = &self.tls {
            t.push_str(&format!(
                "etcd_ca_file = \"{}\"\netcd_cert_file = \"{}\"\netcd_key_file = \"{}\"\n",
                p.ca.display(),
                p.client_cert.display(),
                p.client_key.display()
            ));
        }
        if let Some((user, password)) = &self.user {
            let file = self.dir.path().join(format!("{user}.password"));
            std::fs::write(&file, format!("{password}\n")).expect("password file");
            t.push_str(&format!(
                "etcd_user = \"{user}\"\netcd_password_file = \"{}\"\n",
                file.display()
            ));
        }
        t
    }

    /// Turns etcd auth on (plain flavour): a `root` user, and `user` with a
    /// role that may read and write the prefix `meshgate/` only. Done through
    /// the etcd-client crate (Debian's etcd-server has no etcdctl).
    pub fn enable_auth(&mut self, user: &str, password: &str) {
        assert!(self.tls.is_none(), "enable_auth is for the plain flavour");
        let url = self.url();
        let (u, p) = (user.to_string(), password.to_string());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                use etcd_client::{Client, Permission};
                let mut c = Client::connect([url], None).await.expect("connect etcd");
                c.user_add("root", "root-test-password", None)
                    .await
                    .expect("user add root");
                c.user_grant_role("root", "root").await.expect("grant root");
                c.role_add("meshgate").await.expect("role add");
                c.role_grant_permission(
                    "meshgate",
                    Permission::read_write("meshgate/").with_prefix(),
                )
                .await
                .expect("grant readwrite meshgate/");
                c.user_add(u.as_str(), p.as_str(), None)
                    .await
                    .expect("user add");
                c.user_grant_role(u.as_str(), "meshgate")
                    .await
                    .expect("grant role");
                c.auth_enable().await.expect("auth enable");
            });
        })
        .join()
        .expect("enable auth");
        self.user = Some((user.to_string(), password.to_string()));
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
        self.spawn();
        if let Err(log) = self.wait_healthy() {
            panic!("{log}");
        }
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none(), "etcd is running");
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("etcd.log"))
            .expect("etcd log");
        let mut cmd = Command::new(etcd_binary());
        if let Some(p) = &self.tls {
            cmd.arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(&p.ca)
                .arg("--cert-file")
                .arg(&p.server_cert)
                .arg("--key-file")
                .arg(&p.server_key);
        }
        let child = cmd
            .arg("--listen-metrics-urls")
            .arg(format!("http://127.0.0.1:{}", self.metrics_port))
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
    }

    /// Until etcd answers; `Err` carries why not, with its log.
    fn wait_healthy(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            // Healthy and still running: a `/health` that answered from
            // another test's etcd on a port this one failed to bind is not it.
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_none() && self.healthy() {
                return Ok(());
            }
            let exited = exited.or_else(|| {
                self.child
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten())
            });
            if let Some(status) = exited {
                self.child = None;
                return Err(format!("etcd exited ({status}): {}", self.log()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "etcd did not become healthy within 30 s: {}",
            self.log()
        ))
    }

    /// Whether `GET /health` on the metrics listener (plain HTTP in every
    /// flavour) answers `"health":"true"`.
    fn healthy(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.metrics_port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let req = format!(
            "GET /health HTTP/1.0\r\nhost: 127.0.0.1:{}\r\n\r\n",
            self.metrics_port
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
